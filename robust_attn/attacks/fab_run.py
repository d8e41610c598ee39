"""One targeted FAB run (Croce & Hein, ICML 2020, FAB, Algorithm 1; :mod:`robust_attn.attacks.fab`),
the iterations written out so that a run can save its state after any iteration and resume there.

torchattacks 3.5.1's ``FAB.attack_single_run_targeted`` keeps its iterate, best adversarial and
best norm in local variables for its whole run of ``steps`` iterations: on a GPU one run (one
target class) on 800 images took minutes, longer than a stop signal's grace, and on a CPU tens of
minutes. :func:`targeted_run` computes the same thing, step for step in the same floating-point
operations (``tests/test_fab.py``: the same images bit for bit, L-inf and L2, from the clean image
and from a random start), using torchattacks' own pieces for what it does not change: the
linearization (``get_diff_logits_grads_batch_targeted``: ``f_t - f_y`` and its input gradient)
and the exact projections onto a hyperplane within the box (``projection_linf``,
``projection_l2``, section 3.1). Each iteration (Algorithm 1, steps 3-8):

* ``delta = proj(x(i))``, ``delta_orig = proj(x_orig)`` onto the linearized boundary;
* ``alpha = min(max(||delta|| / (||delta|| + ||delta_orig||), 0), alpha_max)`` (norms at least 1e-8);
* ``x(i+1) = clip((1 - alpha)(x(i) + eta delta) + alpha (x_orig + eta delta_orig))``;
* where ``x(i+1)`` is adversarial: kept if its norm is the smallest so far, then the backward step
  ``x(i+1) <- x_orig + beta (x(i+1) - x_orig)``.

The random start (a restart after the first) draws from the CPU's global generator, as
torchattacks does; a saved state holds everything the rest of the run depends on.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["targeted_run"]

FAR = 1e10   # torchattacks' "no adversarial found yet" norm


def _flat_norm(v: torch.Tensor, norm: str) -> torch.Tensor:
    """Per-row norm of a (rows, pixels) tensor, as torchattacks computes it."""
    return v.abs().max(dim=1)[0] if norm == "linf" else (v ** 2).sum(dim=-1).sqrt()


def _random_start(im2: torch.Tensor, res2: torch.Tensor, eps: float, norm: str) -> torch.Tensor:
    """A random point at distance ``min(best, eps) / 2`` from the images (global CPU generator)."""
    shape = [-1, *[1] * (im2.dim() - 1)]
    radius = torch.min(res2, eps * torch.ones(res2.shape).to(im2.device)).reshape(shape)
    if norm == "linf":
        t = 2 * torch.rand(im2.shape).to(im2.device) - 1
        size = t.reshape([t.shape[0], -1]).abs().max(dim=1, keepdim=True)[0].reshape(shape)
    else:
        t = torch.randn(im2.shape).to(im2.device)
        size = (t ** 2).view(t.shape[0], -1).sum(dim=-1).sqrt().view(t.shape[0], *shape[1:])
    return (im2 + radius * t / size * 0.5).clamp(0.0, 1.0)


def targeted_run(attack, x: torch.Tensor, y: torch.Tensor, use_rand_start: bool = False,
                 resume: dict | None = None, save: Callable[[Callable[[], dict]], None] | None = None) -> torch.Tensor:
    """``attack.attack_single_run_targeted(x, y, use_rand_start)`` of a ``torchattacks.FAB``
    (``attack.target_class`` picks the target: the ``target_class``-th most likely class), as the
    module describes. ``save``, when given, is called after every iteration with a function that
    returns the run's state (a dict of tensors and the iteration count); ``resume``, such a
    state, continues from it (the random start is not drawn again)."""
    from torchattacks.attacks.fab import projection_l2, projection_linf

    if attack.norm not in ("Linf", "L2"):
        raise ValueError(f"targeted_run supports the Linf and L2 FAB, not {attack.norm!r}")
    norm = "linf" if attack.norm == "Linf" else "l2"
    project = projection_linf if norm == "linf" else projection_l2
    x = x.detach().clone().float()
    y = y.detach().clone().long()
    if resume is None:
        pred = attack._get_predicted_label(x) == y
        if pred.sum() == 0:
            return x
        pred = attack.check_shape(pred.nonzero().squeeze())
        la_target = attack.get_logits(x).sort(dim=-1)[1][:, -attack.target_class]
        la_target2 = la_target[pred].detach().clone()
    else:
        pred, la_target2 = resume["pred"].to(x.device), resume["la_target"].to(x.device)
    im2, la2 = x[pred].detach().clone(), y[pred].detach().clone()
    bs = im2.shape[0]
    shape = [-1, *[1] * (im2.dim() - 1)]
    x0 = im2.clone().reshape([bs, -1])
    if resume is None:
        adv = im2.clone()
        res2 = FAR * torch.ones([bs]).to(x.device)
        x1 = _random_start(im2, res2, attack.eps, norm) if use_rand_start else im2.clone()
        first = 0
    else:
        adv, res2, x1 = (resume[k].to(x.device).clone() for k in ("adv", "res2", "x1"))   # updated in place
        first = resume["it"]
    for it in range(first, attack.steps):
        with torch.no_grad():
            df, dg = attack.get_diff_logits_grads_batch_targeted(x1, la2, la_target2)
            dg2 = dg[:, 0]   # one hyperplane: f_t - f_y
            b = -df[:, 0] + (dg2 * x1).view(bs, -1).sum(dim=-1)
            w = dg2.reshape([bs, -1])
            d3 = project(torch.cat((x1.reshape([bs, -1]), x0), 0), torch.cat((w, w), 0), torch.cat((b, b), 0))
            d1, d2 = torch.reshape(d3[:bs], x1.shape), torch.reshape(d3[-bs:], x1.shape)
            a0 = (d3.abs().max(dim=1, keepdim=True)[0] if norm == "linf"
                  else (d3 ** 2).sum(dim=1, keepdim=True).sqrt()).view(shape)
            a0 = torch.max(a0, 1e-8 * torch.ones(a0.shape).to(x.device))
            a1, a2 = a0[:bs], a0[-bs:]
            alpha = torch.min(torch.max(a1 / (a1 + a2), torch.zeros(a1.shape).to(x.device)),
                              attack.alpha_max * torch.ones(a1.shape).to(x.device))
            x1 = ((x1 + attack.eta * d1) * (1 - alpha) + (im2 + d2 * attack.eta) * alpha).clamp(0.0, 1.0)
            is_adv = attack._get_predicted_label(x1) != la2
            if is_adv.sum() > 0:
                i = attack.check_shape(is_adv.nonzero().squeeze())
                t = _flat_norm((x1[i] - im2[i]).reshape([i.shape[0], -1]), norm)
                closer, farther = (t < res2[i]).float(), (t >= res2[i]).float()   # the smaller norm stays
                adv[i] = x1[i] * closer.reshape(shape) + adv[i] * farther.reshape(shape)
                res2[i] = t * closer + res2[i] * farther
                x1[i] = im2[i] + (x1[i] - im2[i]) * attack.beta
        if save is not None and it + 1 < attack.steps:
            save(lambda it=it: {"it": it + 1, "pred": pred, "la_target": la_target2, "x1": x1.clone(),
                                "adv": adv.clone(), "res2": res2.clone()})
    found = attack.check_shape((res2 < FAR).nonzero().squeeze())
    out = x.clone()
    out[pred[found]] = adv[found].clone()
    return out
