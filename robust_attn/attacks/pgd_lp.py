"""Projected gradient descent under L-inf or L2 (Madry et al. 2018, eq. (2) and section 2.1),
registered as ``"pgd"``: the evaluation attack, targeted or untargeted, with restarts.

Madry et al. maximise the loss inside the eps-ball by iterating ``x_{k+1} = Proj_{x+S}(x_k +
alpha * sgn(grad_x L(theta, x_k, y)))`` (their eq. (2), L-inf) from a random start in the ball.
Here, with the objective ``J = CE(f(x), y)`` (untargeted, ascend) or ``J = -CE(f(x), t)``
(targeted toward ``t``, i.e. descend the target's cross-entropy), and ``d = x_k - x``:

* L-inf: ``x' = x_k + a_k * sign(g)``; ``x_{k+1} = clip_[0,1](x + clip_[-eps,eps](x' - x))``;
* L2 (the paper only treats L-inf; this is the usual normalised-gradient analogue):
  ``x' = x_k + a_k * g / ||g||_2``; ``d' = (x' - x) * min(1, eps / ||x' - x||_2)`` (projection on
  the L2 ball); ``x_{k+1} = clip_[0,1](x + d')`` (clipping only shrinks ``|d'|`` coordinate-wise,
  so the result stays in the ball).

``g`` is the gradient of the *summed* objective over the batch, so an image's step does not
depend on the other images or the batch size.

Choices where the paper is vague or silent (all in :class:`~robust_attn.attacks.base.AttackConfig`):

* ``steps`` default 10; step size ``a`` default ``2.5 * eps / steps`` for both norms (Madry et
  al.'s rule: enough to walk across the ball and back within the budget).
* ``schedule``: "constant" (``a_k = a``), "cosine" (``a_k = a * (1 + cos(pi k / steps)) / 2``,
  from ``a`` at k = 0 decaying toward 0), "step" (``a`` divided by 10 from step ``k >= steps/2``
  and by 100 from ``k >= 3 steps / 4``).
* Random start (``options["random_start"]``, default True): L-inf uniform in the cube; L2 a
  uniformly random direction with a radius uniform in [0, eps] (not uniform in the ball's volume,
  which in 3072 dimensions would put every start on the sphere); then clipped to [0, 1]. With
  ``random_start=False`` the first restart starts at ``x``; every further restart is random.
  Draws come from a local ``torch.Generator`` seeded with ``config.seed`` (never the global RNG).
* What is returned per image (``options["keep"]``): "success" (default) keeps the *first* iterate
  that fools the model (prediction != label, or == target when targeted), evaluated at every
  iterate x_0..x_steps: for an evaluation attack an image once fooled counts as fooled, whereas
  plain PGD's last iterate may wander back (AutoAttack's APGD likewise keeps its best point).
  Images never fooled get the last iterate. "last" returns the last iterate (plain PGD, as
  torchattacks and foolbox).
* Restarts: the strongest per image is kept: a successful restart beats an unsuccessful one;
  among equals the higher objective ``J`` at the returned image wins (the first on ties).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from robust_attn.attacks.base import Attack, AttackInputError, AttackOutput, register_attack

__all__ = ["PGD", "step_sizes", "DEFAULT_STEPS"]

DEFAULT_STEPS = 10
_KEEP = ("success", "last")
_OPTIONS = ("random_start", "keep")
_TINY = 1e-12


def step_sizes(step: float, steps: int, schedule: str) -> list[float]:
    """The step size of each of ``steps`` iterations under ``schedule`` (module docstring)."""
    if schedule == "constant":
        return [step] * steps
    if schedule == "cosine":
        return [step * 0.5 * (1 + math.cos(math.pi * k / steps)) for k in range(steps)]
    if schedule == "step":
        return [step / (100 if k >= 0.75 * steps else 10 if k >= 0.5 * steps else 1) for k in range(steps)]
    raise AttackInputError(f"unknown step schedule {schedule!r}; choose constant, cosine or step")


@register_attack
class PGD(Attack):
    name = "pgd"
    paper = "Madry et al. 2018, Towards Deep Learning Models Resistant to Adversarial Attacks, eq. (2)"

    def __init__(self, config):
        super().__init__(config)
        unknown = set(config.options) - set(_OPTIONS)
        if unknown:
            raise AttackInputError(f"pgd has no option(s) {', '.join(sorted(unknown))}; it takes "
                                   f"{', '.join(_OPTIONS)}")
        if not isinstance(config.options.get("random_start", True), bool):
            raise AttackInputError("pgd option random_start must be True or False")
        if config.options.get("keep", "success") not in _KEEP:
            raise AttackInputError(f"pgd option keep must be one of {', '.join(_KEEP)}, "
                                   f"got {config.options['keep']!r}")
        self.steps = DEFAULT_STEPS if config.steps is None else int(config.steps)
        self.step = config.step if config.step is not None else 2.5 * config.eps / max(self.steps, 1)
        self.schedule = step_sizes(self.step, self.steps, config.schedule)

    # ------------------------------------------------------------ pieces

    def _objective(self, logits, labels, targets) -> torch.Tensor:
        """Per-image J (ascended): CE of the label, or minus CE of the target."""
        if targets is None:
            return F.cross_entropy(logits, labels, reduction="none")
        return -F.cross_entropy(logits, targets, reduction="none")

    def _fooled(self, logits, labels, targets) -> torch.Tensor:
        pred = logits.argmax(1)
        return pred != labels if targets is None else pred == targets

    def _per_image(self, values: torch.Tensor) -> torch.Tensor:
        return values.view(-1, *([1] * 3))

    def _random_start(self, x0: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        eps = self.config.eps
        if self.config.norm == "linf":
            noise = (torch.rand(x0.shape, generator=gen, device=x0.device, dtype=x0.dtype) * 2 - 1) * eps
        else:
            direction = torch.randn(x0.shape, generator=gen, device=x0.device, dtype=x0.dtype)
            direction = direction / self._per_image(direction.flatten(1).norm(dim=1).clamp_min(_TINY))
            radius = torch.rand(len(x0), generator=gen, device=x0.device, dtype=x0.dtype) * eps
            noise = direction * self._per_image(radius)
        return (x0 + noise).clamp(0, 1)

    def _step(self, x: torch.Tensor, x0: torch.Tensor, grad: torch.Tensor, size: float) -> torch.Tensor:
        eps = self.config.eps
        if self.config.norm == "linf":
            x = x + size * grad.sign()
            return (x0 + (x - x0).clamp(-eps, eps)).clamp(0, 1)
        x = x + size * grad / self._per_image(grad.flatten(1).norm(dim=1).clamp_min(_TINY))
        delta = x - x0
        factor = (eps / delta.flatten(1).norm(dim=1).clamp_min(_TINY)).clamp(max=1.0)
        return (x0 + delta * self._per_image(factor)).clamp(0, 1)

    def _evaluate(self, model, x, labels, targets, need_grad: bool):
        """Objective per image, fooled per image and (optionally) the input gradient of sum(J)."""
        x = x.detach().requires_grad_(need_grad)
        logits = model(x)
        objective = self._objective(logits, labels, targets)
        grad = torch.autograd.grad(objective.sum(), x)[0] if need_grad else None
        return objective.detach(), self._fooled(logits.detach(), labels, targets), grad

    def _one_restart(self, model, x0, labels, targets, start) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One PGD run from ``start``: (returned images, fooled, objective at them)."""
        keep_first = self.config.options.get("keep", "success") == "success"
        kept = x0.clone()
        found = torch.zeros(len(x0), dtype=torch.bool, device=x0.device)
        kept_obj = torch.full((len(x0),), -math.inf, dtype=x0.dtype, device=x0.device)
        x = start
        for k in range(self.steps + 1):
            obj, fooled, grad = self._evaluate(model, x, labels, targets, need_grad=k < self.steps)
            if keep_first:
                new = fooled & ~found
                kept[new], kept_obj[new] = x[new], obj[new]
                found |= new
            if k == self.steps:
                break
            with torch.no_grad():
                x = self._step(x.detach(), x0, grad, self.schedule[k])
        out = torch.where(self._per_image(found), kept, x)
        return out, found | fooled, torch.where(found, kept_obj, obj)

    # ------------------------------------------------------------ attack

    def _run(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
             targets: torch.Tensor | None) -> AttackOutput:
        gen = torch.Generator(device=images.device).manual_seed(int(self.config.seed))
        random_first = self.config.options.get("random_start", True)
        best = best_fooled = best_obj = None
        for restart in range(self.config.restarts):
            start = self._random_start(images, gen) if (random_first or restart > 0) else images.clone()
            adv, fooled, obj = self._one_restart(model, images, labels, targets, start)
            if best is None:
                best, best_fooled, best_obj = adv, fooled, obj
                continue
            better = (fooled & ~best_fooled) | ((fooled == best_fooled) & (obj > best_obj))
            best = torch.where(self._per_image(better), adv, best)
            best_fooled, best_obj = best_fooled | fooled, torch.where(better, obj, best_obj)
        return AttackOutput(best)
