"""One run of APGD, Croce & Hein, ICML 2020, Algorithm 1, batched with per-image state: the
checkpoints, the random start, the projection and the iterates (:func:`apgd_single_run`), which
can save its whole state after any iterate and resume from it with the same result. What each
step implements, and where torchattacks and the official code deviate, is in
:mod:`robust_attn.attacks.apgd` (the attacks APGD-CE and APGD-T, which run it).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from robust_attn.attacks import rng
from robust_attn.attacks.base import AttackInputError

__all__ = ["checkpoints", "random_start", "project", "per_image", "apgd_single_run", "APGDRun", "RHO", "ALPHA"]

RHO = 0.75
ALPHA = 0.75


def checkpoints(n_iter: int) -> list[int]:
    """The paper's checkpoints ``W = {w_0 = 0, w_1, ...}``, ``w_j = ceil(p_j * n_iter) <= n_iter``
    (section 3). ``p_j`` are kept in integer hundredths so the ceiling is exact."""
    if isinstance(n_iter, bool) or not isinstance(n_iter, numbers.Integral) or n_iter < 1:
        raise AttackInputError(f"APGD needs an int number of iterations >= 1, got {n_iter!r}")
    p_prev, p = 0, 22
    out = [0]
    while True:
        w = -(-p * n_iter // 100)   # ceil(p / 100 * n_iter)
        if w > n_iter:
            return out
        if w != out[-1]:
            out.append(w)
        p_prev, p = p, p + max(p - p_prev - 3, 6)


def per_image(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``v`` (one value per image) shaped to broadcast over the images ``x``."""
    return v.view(-1, *([1] * (x.dim() - 1)))


def random_start(images: torch.Tensor, norm: str, eps: float, generator: torch.Generator) -> torch.Tensor:
    """``x(0)``: a point on the eps-sphere of the norm around each image, clipped to [0, 1]."""
    if norm == "linf":
        u = 2 * rng.rand(images.shape, generator, images.device, images.dtype) - 1
        size = u.flatten(1).abs().amax(1)
    else:
        u = rng.randn(images.shape, generator, images.device, images.dtype)
        size = u.flatten(1).norm(dim=1)
    return (images + eps * u / (per_image(size, images) + 1e-12)).clamp(0, 1)


def project(x: torch.Tensor, images: torch.Tensor, norm: str, eps: float) -> torch.Tensor:
    """``P``: into the eps-ball of the norm around ``images``, then into [0, 1]."""
    if norm == "linf":
        return torch.min(torch.max(x, images - eps), images + eps).clamp(0, 1)
    delta = x - images
    size = delta.flatten(1).norm(dim=1)
    scale = torch.where(size > eps, eps / size.clamp_min(1e-30), torch.ones_like(size))
    return (images + delta * per_image(scale, images)).clamp(0, 1)


def _direction(grad: torch.Tensor, norm: str) -> torch.Tensor:
    if norm == "linf":
        return grad.sign()
    return grad / (per_image(grad.flatten(1).norm(dim=1), grad) + 1e-12)


#: the tensors of a run's state (``apgd_single_run``'s ``save`` / ``resume``), in its variables' order
_RUN_TENSORS = ("x_cur", "x_prev", "f_cur", "grad", "x_max", "f_max", "grad_max", "success", "x_success", "eta",
                "increases", "f_max_last", "halved_last")


@dataclass
class APGDRun:
    """One run of Algorithm 1 on a batch. ``x_best``/``loss_best``: the highest-loss point per image;
    ``success``: a successful iterate was found; ``x_success``: the first one (else ``x(0)``);
    ``step``: the final step size per image."""

    x_best: torch.Tensor
    loss_best: torch.Tensor
    success: torch.Tensor
    x_success: torch.Tensor
    step: torch.Tensor


def apgd_single_run(model: nn.Module, images: torch.Tensor, x_init: torch.Tensor,
                    loss_fn: Callable[[torch.Tensor], torch.Tensor],
                    success_fn: Callable[[torch.Tensor], torch.Tensor],
                    norm: str, eps: float, steps: int, rho: float = RHO, alpha: float = ALPHA,
                    stop_on_success: bool = False, resume: dict | None = None,
                    save: Callable[[Callable[[], dict]], None] | None = None) -> APGDRun:
    """Algorithm 1 from ``x_init`` for ``steps`` iterations, batched, with per-image state.

    ``loss_fn(logits, idx)`` gives the per-image objective to maximize and ``success_fn(logits,
    idx)`` a bool per image, for the images ``idx`` (positions in the batch) that ``logits`` belong
    to. One forward and one backward pass of the batch per iterate (``steps + 1`` in all).

    ``stop_on_success``: an image is not iterated further once a successful iterate was found (its
    ``x_success`` is what an evaluation returns), so only the images still resisting cost forward
    and backward passes. Every image's iterates are the same either way, since each image's loss
    and gradient depend on that image alone (eval mode, summed loss); only the float rounding of
    the batched kernels may differ with the batch's composition.

    ``save``, when given, is called after every iterate but the last with a function that returns
    the run's state (every tensor and count the rest of the run depends on); ``resume``, such a
    state, continues from it (``x_init`` is then not used): the same result, bit for bit."""
    checks = set(checkpoints(steps)[1:])
    n = images.shape[0]
    all_idx = torch.arange(n, device=images.device)

    def evaluate(x: torch.Tensor, idx: torch.Tensor = all_idx):
        x = x.detach().requires_grad_(True)
        logits = model(x)
        loss = loss_fn(logits, idx)
        grad, = torch.autograd.grad(loss.sum(), x)
        return loss.detach(), grad.detach(), success_fn(logits.detach(), idx)

    if resume is None:
        x_cur = x_init.detach().clone()
        f_cur, grad, ok = evaluate(x_cur)
        x_max, f_max, grad_max = x_cur.clone(), f_cur.clone(), grad.clone()
        success, x_success = ok.clone(), x_cur.clone()
        eta = torch.full((n,), 2 * eps, dtype=images.dtype, device=images.device)
        x_prev = x_cur
        increases = torch.zeros(n, dtype=torch.long, device=images.device)
        last_w, f_max_last = 0, f_max.clone()
        halved_last = torch.zeros(n, dtype=torch.bool, device=images.device)
        first = 1
    else:
        (x_cur, x_prev, f_cur, grad, x_max, f_max, grad_max, success, x_success, eta, increases, f_max_last,
         halved_last) = (resume[k].to(images.device).clone() for k in _RUN_TENSORS)
        last_w, first = resume["last_w"], resume["k"] + 1
    for k in range(first, steps + 1):   # computes x(k)
        with torch.no_grad():
            z = project(x_cur + per_image(eta, x_cur) * _direction(grad, norm), images, norm, eps)
            if k == 1:
                x_new = z
            else:
                x_new = project(x_cur + alpha * (z - x_cur) + (1 - alpha) * (x_cur - x_prev), images, norm, eps)
        if stop_on_success:
            act = (~success).nonzero().flatten()
            if act.numel() == 0:
                break
            if act.numel() < n:   # the finished images keep their state; only the others are evaluated
                f_new, grad_new, ok = f_cur.clone(), grad.clone(), success.clone()
                x_new = torch.where(per_image(success, x_new), x_cur, x_new)
                f_new[act], grad_new[act], ok[act] = evaluate(x_new[act], act)
            else:
                f_new, grad_new, ok = evaluate(x_new)
        else:
            f_new, grad_new, ok = evaluate(x_new)
        increases += (f_new > f_cur).long()
        better = f_new > f_max
        x_max[better], f_max[better], grad_max[better] = x_new[better], f_new[better], grad_new[better]
        first = ok & ~success
        x_success[first] = x_new[first]
        success |= ok
        x_prev, x_cur, f_cur, grad = x_cur, x_new, f_new, grad_new
        if k in checks:
            cond1 = increases.to(f_cur.dtype) < rho * (k - last_w)
            cond2 = ~halved_last & (f_max <= f_max_last)
            halve = cond1 | cond2
            eta = torch.where(halve, eta / 2, eta)
            x_cur, f_cur, grad = x_cur.clone(), f_cur.clone(), grad.clone()
            x_cur[halve], f_cur[halve], grad[halve] = x_max[halve], f_max[halve], grad_max[halve]
            halved_last, f_max_last, last_w = halve, f_max.clone(), k
            increases.zero_()
        if save is not None and k < steps:
            save(lambda k=k: {"k": k, "last_w": last_w, **{name: value.clone() for name, value in zip(
                _RUN_TENSORS, (x_cur, x_prev, f_cur, grad, x_max, f_max, grad_max, success, x_success, eta,
                               increases, f_max_last, halved_last))}})
    return APGDRun(x_max, f_max, success, x_success, eta)
