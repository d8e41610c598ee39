"""Attacks: targeted L-infinity PGD of SAN Table 10 with three backends that agree, its sanity
checks, and the evaluation attacks registered in :mod:`robust_attn.attacks.base` (one file each).

    >>> from robust_attn.attacks import targeted_pgd, draw_targets, PGDConfig
    >>> targets = draw_targets(labels, num_classes=10, seed=0)
    >>> adv = targeted_pgd(model, images, targets, PGDConfig(eps=8, step=2, steps=4))

The native backend's default mode attacks a cached copy of the model with batch norm folded
into the convolutions (:mod:`robust_attn.attacks.fast_model`), in channels-last layout: 1.46x
(resnet26 width 1.0) to 2x (width 0.25) the images/s of torchattacks on CPU, agreeing with it
up to floating-point ties;
``targeted_pgd(..., exact=True)`` is bit-identical to the torchattacks and foolbox backends.
"""
import importlib
import pkgutil

from robust_attn.attacks.base import (ATTACKS, Attack, AttackConfig, AttackOutput, list_attacks, make_attack,
                                      parse_eps, register_attack)
from robust_attn.attacks.checks import CheckResult, check_monotone_success, run_checks
from robust_attn.attacks.targeted_pgd import BACKENDS, PGDConfig, targeted_pgd
from robust_attn.attacks.targets import draw_targets

__all__ = ["targeted_pgd", "draw_targets", "PGDConfig", "BACKENDS", "CheckResult", "run_checks",
           "check_monotone_success", "Attack", "AttackConfig", "AttackOutput", "ATTACKS", "register_attack",
           "make_attack", "list_attacks", "parse_eps"]

# Every module of this package is imported, so an attack file's @register_attack runs: a new
# attack is one new file here, with no list to edit.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
