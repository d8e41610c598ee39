"""Adapters running the same targeted PGD (see :mod:`robust_attn.attacks.targeted_pgd`) through
torchattacks and foolbox, as independent implementations to check the native one against.

torchattacks 3.5 ``PGD`` in ``set_mode_targeted_by_label`` mode takes the targets in place of
the labels and ascends ``-CE(mean)``: ``x' = x + alpha * sign(grad(-CE))``, then
``x = clamp(x0 + clamp(x' - x0, -eps, eps), 0, 1)``. Its ``__call__`` calls ``model.eval()``
(and would restore train mode, which we refuse anyway); it normalizes inputs itself only
for a MAIR ``RobModel``, not for our wrapper.

foolbox 3.3 ``LinfPGD(abs_stepsize, steps, random_start)`` with ``TargetedMisclassification``
descends ``CE(sum)`` with ``x' = x - step * sign(grad)``, projects with
``x0 + clip(x' - x0, -eps, eps)`` and clips to the model's bounds (0, 1). We call the attack's
``run`` (the documented per-epsilon entry point) rather than ``__call__``: ``__call__`` adds one
more forward pass to report success and re-clips the result to the eps-ball, which can move a
pixel by one ulp and would break bit-level agreement. ``PyTorchModel(model, bounds=(0, 1),
device=images.device)``: no preprocessing (the wrapper normalizes) and the device given
explicitly, since foolbox would otherwise ``model.to("cuda:0")`` whenever CUDA exists.
eagerpy computes the input gradient with ``loss.backward()``, which also fills the model's
parameter ``.grad``; we freeze the parameters for the run so the caller's model is untouched.

Sign of the gradient: mean and sum of the cross-entropy differ by the factor 1/N. In real
arithmetic that never changes a sign; in float32 it is exact only for N a power of two, and at
other N a gradient entry within rounding error of zero can take the other sign, so torchattacks
and foolbox can disagree on a batch of 14, 50 or 60 images. ``targeted_pgd(..., exact=True)``
therefore runs every backend on power-of-two blocks of the batch (see its docstring).
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from robust_attn.attacks.inputs import frozen_parameters

if TYPE_CHECKING:
    from robust_attn.attacks.targeted_pgd import PGDConfig

__all__ = ["torchattacks_pgd", "foolbox_pgd", "run_backend"]


def torchattacks_pgd(model: nn.Module, images: torch.Tensor, targets: torch.Tensor,
                     config: PGDConfig) -> torch.Tensor:
    """Targeted PGD with ``torchattacks.PGD`` (targets passed as labels in targeted-by-label mode)."""
    import torchattacks

    attack = torchattacks.PGD(model, eps=config.eps_abs, alpha=config.step_abs, steps=config.steps,
                              random_start=config.random_start)
    attack.set_device(images.device)
    attack.set_mode_targeted_by_label(quiet=True)
    return attack(images, targets)


def foolbox_pgd(model: nn.Module, images: torch.Tensor, targets: torch.Tensor,
                config: PGDConfig) -> torch.Tensor:
    """Targeted PGD with ``foolbox.attacks.LinfPGD`` and a ``TargetedMisclassification`` criterion."""
    with warnings.catch_warnings():  # foolbox 3.3 imports a deprecated scipy namespace
        warnings.simplefilter("ignore", DeprecationWarning)
        import foolbox

    fmodel = foolbox.PyTorchModel(model, bounds=(0, 1), device=images.device)
    attack = foolbox.attacks.LinfPGD(abs_stepsize=config.step_abs, steps=config.steps,
                                     random_start=config.random_start)
    criterion = foolbox.criteria.TargetedMisclassification(targets)
    # eagerpy takes gradients with loss.backward(), which would also accumulate ``.grad`` into
    # every parameter of the caller's model; frozen parameters get none (same input gradient).
    with frozen_parameters(model):
        return attack.run(fmodel, images, criterion, epsilon=config.eps_abs)


_ADAPTERS = {"torchattacks": torchattacks_pgd, "foolbox": foolbox_pgd}


def run_backend(backend: str, model: nn.Module, images: torch.Tensor, targets: torch.Tensor,
                config: PGDConfig) -> torch.Tensor:
    """Dispatch to the adapter of ``backend`` (inputs already validated by ``targeted_pgd``)."""
    if backend not in _ADAPTERS:
        raise ValueError(f"unknown library backend {backend!r}; choose one of {', '.join(_ADAPTERS)}")
    return _ADAPTERS[backend](model, images, targets, config)
