"""Robustness protocols: SAN's rotation/flip (Table 9) and targeted PGD (Table 10), the evaluation
attacks and transfer attacks. Each protocol writes a run directory (see :mod:`robust_attn.runs.store`)
through the shared loop in :mod:`robust_attn.protocols.runner`; aggregates come from the records.
A protocol joins ``robust-attn study`` by registering a step (:mod:`robust_attn.protocols.study_step`);
every module of this package is imported here, so a new protocol is one new file."""
import importlib
import pkgutil

from robust_attn.protocols.rotation import rotation_conditions, run_rotation, summarize_rotation
from robust_attn.protocols.pgd import AttackSetting, pgd_settings, run_pgd, summarize_pgd

__all__ = ["rotation_conditions", "run_rotation", "summarize_rotation", "AttackSetting", "pgd_settings",
           "run_pgd", "summarize_pgd"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
