"""Targeted L-infinity PGD of SAN Table 10 with three backends that agree, and its sanity checks.

    >>> from robust_attn.attacks import targeted_pgd, draw_targets, PGDConfig
    >>> targets = draw_targets(labels, num_classes=10, seed=0)
    >>> adv = targeted_pgd(model, images, targets, PGDConfig(eps=8, step=2, steps=4))

The native backend's default mode attacks a cached copy of the model with batch norm folded
into the convolutions (:mod:`robust_attn.attacks.fast_model`), in channels-last layout: 1.46x
(resnet26 width 1.0) to 2x (width 0.25) the images/s of torchattacks on CPU, agreeing with it
up to floating-point ties;
``targeted_pgd(..., exact=True)`` is bit-identical to the torchattacks and foolbox backends.
"""
from robust_attn.attacks.checks import CheckResult, check_monotone_success, run_checks
from robust_attn.attacks.pgd import BACKENDS, PGDConfig, targeted_pgd
from robust_attn.attacks.targets import draw_targets

__all__ = ["targeted_pgd", "draw_targets", "PGDConfig", "BACKENDS", "CheckResult", "run_checks",
           "check_monotone_success"]
