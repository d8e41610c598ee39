"""Robustness protocols of the SAN paper (section 5.4): rotation/flip (Table 9) and targeted
PGD (Table 10). Each protocol writes a run directory (see :mod:`robust_attn.results`) through
the shared loop in :mod:`robust_attn.protocols.runner`; aggregates come from the records."""
from robust_attn.protocols.rotation import rotation_conditions, run_rotation, summarize_rotation
from robust_attn.protocols.pgd import AttackSetting, pgd_settings, run_pgd, summarize_pgd

__all__ = ["rotation_conditions", "run_rotation", "summarize_rotation", "AttackSetting", "pgd_settings",
           "run_pgd", "summarize_pgd"]
