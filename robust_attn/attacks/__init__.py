"""Targeted L-infinity PGD of SAN Table 10 with three backends that agree, and its sanity checks.

    >>> from robust_attn.attacks import targeted_pgd, draw_targets, PGDConfig
    >>> targets = draw_targets(labels, num_classes=10, seed=0)
    >>> adv = targeted_pgd(model, images, targets, PGDConfig(eps=8, step=2, steps=4))
"""
from robust_attn.attacks.checks import CheckResult, check_monotone_success, run_checks
from robust_attn.attacks.pgd import BACKENDS, PGDConfig, targeted_pgd
from robust_attn.attacks.targets import draw_targets

__all__ = ["targeted_pgd", "draw_targets", "PGDConfig", "BACKENDS", "CheckResult", "run_checks",
           "check_monotone_success"]
