"""Attacks: targeted L-infinity PGD of SAN Table 10 with three backends that agree, its sanity
checks, and the evaluation attacks registered in :mod:`robust_attn.attacks.base` (one file each).

    >>> from robust_attn.attacks import targeted_pgd, draw_targets, PGDConfig
    >>> targets = draw_targets(labels, num_classes=10, seed=0)
    >>> adv = targeted_pgd(model, images, targets, PGDConfig(eps=8, step=2, steps=4))

The native backend's default mode attacks a cached copy of the model with batch norm folded
into the convolutions (:mod:`robust_attn.attacks.fast_model`), in channels-last layout, agreeing
with torchattacks up to floating-point ties (its speed: ``benchmarks/bench_pgd.py``);
``targeted_pgd(..., exact=True)`` is bit-identical to the torchattacks and foolbox backends.
The registry (:data:`ATTACKS`) imports every module of this package when first asked, so a new
attack is one new file here.
"""
from robust_attn.attacks.base import (ATTACKS, Attack, AttackConfig, AttackOutput, list_attacks, make_attack,
                                      parse_eps, register_attack)
from robust_attn.attacks.checks import CheckResult, check_monotone_success, run_checks
from robust_attn.attacks.targeted_pgd import BACKENDS, PGDConfig, targeted_pgd
from robust_attn.attacks.targets import draw_targets

__all__ = ["targeted_pgd", "draw_targets", "PGDConfig", "BACKENDS", "CheckResult", "run_checks",
           "check_monotone_success", "Attack", "AttackConfig", "AttackOutput", "ATTACKS", "register_attack",
           "make_attack", "list_attacks", "parse_eps"]
