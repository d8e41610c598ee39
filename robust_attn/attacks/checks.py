"""Sanity checks run alongside every attack, in the spirit of AutoAttack's ``checks.py``.

Each check returns a :class:`CheckResult` (name, passed, detail) instead of raising, so the
protocol runner records them next to the numbers they vouch for. They flag the usual ways a
robustness number is wrong: a stochastic or train-mode model, a broken projection, a masked
(zero) gradient, an attack that changes images at eps = 0, and success rates that fall as the
attack gets stronger. :func:`run_checks` runs the per-batch checks; :func:`check_monotone_success`
takes the success rates of a sweep of settings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from robust_attn.attacks.targeted_pgd import PGDConfig, targeted_pgd

__all__ = ["CheckResult", "check_eval_mode", "check_deterministic", "check_perturbation_bound",
           "check_image_range", "check_input_gradient", "check_eps_zero", "check_monotone_success",
           "run_checks"]

Attack = Callable[[nn.Module, torch.Tensor, torch.Tensor, PGDConfig], torch.Tensor]

# float32 rounding of x0 + delta: a few ulps of numbers <= 1.
BOUND_ATOL = 1e-6


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one sanity check: ``detail`` says what was measured, passed or not."""

    name: str
    passed: bool
    detail: str

    def to_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


def check_eval_mode(model: nn.Module) -> CheckResult:
    """Every submodule is in eval mode (dropout off, batch norm on running statistics)."""
    training = [name or type(model).__name__ for name, m in model.named_modules() if m.training]
    if training:
        return CheckResult("eval_mode", False, f"{len(training)} module(s) in train mode, e.g. {training[0]}")
    return CheckResult("eval_mode", True, "all modules in eval mode")


def check_deterministic(model: nn.Module, images: torch.Tensor) -> CheckResult:
    """Two forward passes on the same images give identical logits."""
    with torch.no_grad():
        first, second = model(images), model(images)
    diff = (first - second).abs().max().item()
    if diff == 0:
        return CheckResult("deterministic", True, "two forward passes give identical logits")
    return CheckResult("deterministic", False, f"two forward passes differ by up to {diff:.3g} in the logits")


def check_perturbation_bound(images: torch.Tensor, adversarial: torch.Tensor, eps_abs: float,
                             atol: float = BOUND_ATOL) -> CheckResult:
    """``max |adv - x| <= eps`` (plus float slack ``atol``), and the shapes match."""
    if adversarial.shape != images.shape:
        return CheckResult("perturbation_bound", False,
                           f"adversarial shape {tuple(adversarial.shape)} != images {tuple(images.shape)}")
    linf = (adversarial.detach().float() - images.detach().float()).abs().max().item()
    ok = linf <= eps_abs + atol
    return CheckResult("perturbation_bound", ok,
                       f"max |adv - x| = {linf * 255:.4f}/255 {'<=' if ok else '>'} eps = {eps_abs * 255:.4f}/255")


def check_image_range(adversarial: torch.Tensor) -> CheckResult:
    """Adversarial images are finite and in [0, 1]."""
    if not torch.isfinite(adversarial).all():
        return CheckResult("image_range", False, "adversarial images contain NaN or inf")
    low, high = adversarial.min().item(), adversarial.max().item()
    ok = low >= 0.0 and high <= 1.0
    return CheckResult("image_range", ok, f"adversarial values in [{low:.6g}, {high:.6g}]")


def check_input_gradient(model: nn.Module, images: torch.Tensor, targets: torch.Tensor) -> CheckResult:
    """The gradient of the targeted loss reaches the input: finite, not all zero, for every image.

    A zero gradient means the attack cannot move (gradient masking, a detached or
    non-differentiable forward); white-box PGD numbers from such a model are meaningless.
    """
    x = images.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        loss = F.cross_entropy(model(x), targets.to(images.device, torch.long), reduction="sum")
        if not loss.requires_grad:
            return CheckResult("input_gradient", False, "the loss does not depend on the input through autograd")
        (grad,) = torch.autograd.grad(loss, x, allow_unused=True)
    if grad is None:
        return CheckResult("input_gradient", False, "no gradient reaches the input")
    if not torch.isfinite(grad).all():
        return CheckResult("input_gradient", False, "the input gradient contains NaN or inf")
    per_image = grad.flatten(1).abs().amax(dim=1)
    zero = int((per_image == 0).sum())
    if zero:
        return CheckResult("input_gradient", False, f"zero input gradient for {zero} of {len(per_image)} image(s)")
    return CheckResult("input_gradient", True,
                       f"non-zero input gradient for all {len(per_image)} image(s), "
                       f"smallest max |grad| {per_image.min().item():.3g}")


def check_eps_zero(model: nn.Module, images: torch.Tensor, targets: torch.Tensor, config: PGDConfig,
                   attack: Attack | None = None) -> CheckResult:
    """The attack run with eps = 0 (same step and steps) returns the clean images and predictions."""
    attack = attack or targeted_pgd
    zero = PGDConfig(0, config.step, config.steps)
    try:
        adversarial = attack(model, images, targets, zero)
    except Exception as err:  # recorded, not raised: the runner keeps every check's outcome
        return CheckResult("eps_zero", False, f"attack with eps=0 raised {type(err).__name__}: {err}")
    linf = (adversarial - images).abs().max().item()
    with torch.no_grad():
        same = (model(adversarial).argmax(1) == model(images).argmax(1))
    changed = int((~same).sum())
    ok = linf == 0 and changed == 0
    return CheckResult("eps_zero", ok, f"eps=0: max |adv - x| = {linf:.3g}, "
                                       f"{changed} of {len(same)} prediction(s) changed")


def check_monotone_success(success_rates: Mapping[PGDConfig, float], tol: float = 0.0) -> CheckResult:
    """Across a sweep, success never decreases as eps or steps grow (at the same step size).

    Settings are compared when they share the step size and one has both eps and steps at
    least as large as the other (a partial order); ``{8, 4, 2}`` and ``{8, 2, 4}`` are therefore
    not compared (our choice: a smaller step with more iterations is not a stronger attack by
    construction). A drop larger than ``tol`` fails. PGD returns its last iterate, so a small
    drop is possible in principle; a large one usually means a broken attack or a masked gradient.
    """
    items = list(success_rates.items())
    for config, rate in items:
        if not isinstance(config, PGDConfig):
            raise TypeError(f"success_rates keys must be PGDConfig, got {type(config).__name__}")
        if not 0.0 <= float(rate) <= 1.0:
            raise ValueError(f"success rate of {config} must be in [0, 1], got {rate}")
    violations = []
    compared = 0
    for weak, weak_rate in items:
        for strong, strong_rate in items:
            if weak is strong or weak.step != strong.step or weak.random_start != strong.random_start:
                continue
            if strong.eps >= weak.eps and strong.steps >= weak.steps and (strong.eps, strong.steps) != (weak.eps, weak.steps):
                compared += 1
                if strong_rate < weak_rate - tol:
                    violations.append(f"[{strong}] {strong_rate:.4f} < [{weak}] {weak_rate:.4f}")
    if violations:
        return CheckResult("monotone_success", False, "success falls as the attack grows: " + "; ".join(violations))
    return CheckResult("monotone_success", True, f"{compared} comparable pair(s), none decreasing beyond tol={tol}")


def run_checks(model: nn.Module, images: torch.Tensor, targets: torch.Tensor, adversarial: torch.Tensor,
               config: PGDConfig, backend: str = "native", max_images: int = 8) -> list[CheckResult]:
    """The per-batch checks for one attack run; the costly ones use the first ``max_images`` images.

    Cost: two forward passes and one backward on ``max_images`` images, plus one eps = 0 attack
    of ``config.steps`` steps on them.
    """
    sub_x, sub_t = images[:max_images], targets[:max_images]
    results = [check_eval_mode(model), check_deterministic(model, sub_x),
               check_perturbation_bound(images, adversarial, config.eps_abs), check_image_range(adversarial),
               check_input_gradient(model, sub_x, sub_t)]
    if results[0].passed:  # targeted_pgd refuses train-mode models; the failure is already recorded
        results.append(check_eps_zero(model, sub_x, sub_t, config,
                                      attack=lambda m, x, t, c: targeted_pgd(m, x, t, c, backend=backend)))
    return results
