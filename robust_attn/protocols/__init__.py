"""Robustness protocols: SAN's rotation/flip (Table 9) and targeted PGD (Table 10), the evaluation
attacks and transfer attacks. Each protocol writes a run directory (see :mod:`robust_attn.runs.store`)
through the shared loop in :mod:`robust_attn.protocols.runner`; aggregates come from the records.
A protocol joins ``robust-attn study`` and ``robust-attn eval`` by registering a step
(:mod:`robust_attn.protocols.study_step`, :mod:`robust_attn.protocols.eval_step`, whose registries
import every module of this package) with its settings (:mod:`robust_attn.protocols.settings`),
so a new protocol is one new file."""
from robust_attn.protocols.rotation import run_rotation, summarize_rotation
from robust_attn.protocols.pgd import AttackSetting, pgd_settings, run_pgd, summarize_pgd

__all__ = ["run_rotation", "summarize_rotation", "AttackSetting", "pgd_settings", "run_pgd", "summarize_pgd"]
