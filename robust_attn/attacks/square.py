"""Square Attack: Andriushchenko, Croce, Flammarion & Hein, ECCV 2020, "Square Attack: a
query-efficient black-box adversarial attack via random search".

Score-based: only the model's outputs are used, never its gradients (the model runs under
``torch.no_grad``). Own implementation, because torchattacks 3.5.1's ``Square`` neither returns
per-image query counts nor leaves the global RNG alone. torchattacks 3.5.1 and the official
fra31/auto-attack ``square.py`` (the code AutoAttack's standard results come from) were read
against the paper; their differences are listed at the end.

Algorithm 1 (random search), per image, batched over the images still to fool:

* loss ``L``: untargeted, the margin loss on the logits ``z_y - max_{j != y} z_j``; targeted, the
  cross-entropy of the target class (as the paper's targeted experiments). Success: untargeted
  ``argmax z != y``, targeted ``argmax z == t`` (the definition the rest of the harness uses; the
  official code's ``margin <= 0`` differs only on exact ties).
* an update ``x_new`` replaces the current best ``x_hat`` only if ``L(x_new) < L(x_hat)`` (or
  ``x_new`` succeeds): the loss of ``x_hat`` never increases. An image stops being queried as
  soon as it is fooled.
* ``p`` (the fraction of pixels a square covers) starts at ``p_init`` (default 0.8,
  ``options["p_init"]``) and is halved after iterations 10, 50, 200, 500, 1000, 2000, 4000, 6000
  and 8000 of a 10000-query run; for another budget ``Q`` iteration ``i`` (0-based) reads as
  ``floor(10000 i / Q)``, the official code's rescaling (:func:`p_schedule`). These are the
  breakpoints of the authors' code; the paper (not in /work/shared/papers, so unchecked here)
  describes the same piecewise-constant halving.
* side of the square: ``round(sqrt(p * H * W))``, at least 1 (L-inf) or at least 3 and odd (L2),
  at most ``min(H, W)`` (largest odd value for L2); position uniform over all
  ``(H - s + 1) x (W - s + 1)`` placements, drawn per image.

L-inf (Algorithm 2): init ``x + eps * rho``, ``rho in {-1, 1}`` per image, channel and column
(vertical stripes of width one), clipped to [0, 1]. Update: add ``2 eps rho_c`` (one sign per
channel) on the square of ``x_hat``, then project onto the eps-box around ``x`` and [0, 1].

L2 (Algorithm 3): init: a 5 x 5 grid of tiles of side ``floor(min(H, W) / 5)``, centred, each
holding the pattern ``eta`` with a random sign per channel, scaled to norm eps, clipped to [0, 1].
Update: two windows ``W1``, ``W2`` of the same side; per channel ``nu_temp = rho eta* +
nu_W1 / ||nu_W1||``, ``eps_avail = sqrt(||nu_{W1 u W2}||^2 + eps_unused^2 / c)`` with
``eps_unused^2 = max(eps^2 - ||nu||^2, 0)``; ``nu_W2 <- 0``, ``nu_W1 <- eps_avail nu_temp /
||nu_temp||``; then clip to [0, 1]. ``eta`` (eq. 4) is two stacked rectangles ``(eta_r, -eta_r)``
with ``eta_r`` at Chebyshev distance ``d`` from the rectangle's centre equal to
``sum_{k=d+1}^{N+1} 1/k^2``, ``N = floor(s / 2)``, normalised to unit L2 norm and transposed with
probability 1/2 (per image here). Where the paper's wording is vague (tile layout, ``N``) we
follow the authors' code.

Queries (``AttackOutput.queries``, per image): the clean check is query 1 (an image the model
already gets wrong is returned unchanged with 1 query); each restart spends 1 query on its
initial point and one per iteration, ``config.queries`` (default 5000) in all, i.e.
``queries - 1`` iterations. The count is frozen when the image is first fooled, so it reads as
"the query that fooled it"; an image never fooled reports ``1 + restarts * queries``. Restarts
(``config.restarts``) run only on the images not yet fooled; an image never fooled gets the
lowest-loss point over all restarts. ``config.steps`` is ignored (Square's budget is
``queries``), so that AutoAttack can pass the same ``steps`` to every member.

Progress: with ``attack.progress`` (set by AutoAttack) the state after an iteration is saved when
due, generator included, and a saved state resumes there with the same result
(:mod:`robust_attn.attacks.progress`).

Randomness: a local CPU ``torch.Generator`` seeded by ``config.seed`` on every device (the global
RNG is neither used nor reseeded; :mod:`robust_attn.attacks.rng`: a saved progress resumes on
another device type). Every draw is made for the whole batch (also for images already done), so the
random numbers an image gets do not depend on when the other images of the batch were fooled
(they do depend on the batch size).

Differences of the official code (fra31/auto-attack, ``SquareAttack``) and torchattacks 3.5.1
``Square`` (a copy of it) from the paper, and what we do:

1. one square position (and one orientation of ``eta``) per iteration for the whole batch, not
   per image as in Algorithms 2 and 3 (and in the authors' first code): we draw per image.
2. positions are drawn from ``{0, ..., H - s - 1}`` (``random_int(0, h - s)`` truncates), never
   touching the last row/column (paper: ``{0, ..., w - h}``): we include ``H - s``.
3. ``n_queries`` iterations after the initial query, ``n_queries + 1`` queries per restart: here
   the budget counts the initial query. Per-image queries are computed but not returned by
   torchattacks; both count a query for every image still to fool.
4. global RNG: ``torch.random.manual_seed(seed)`` reseeds it on every call.
5. torchattacks' targeted mode optimizes the margin loss by default (``loss="margin"``), not the
   paper's cross-entropy (the official code uses the cross-entropy when targeted).
6. ``p`` is rescaled with the float ``int(i / Q * 10000)``; we use exact integers.
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.nn as nn
import torch.nn.functional as F

from robust_attn.attacks import rng
from robust_attn.attacks.base import Attack, AttackConfig, AttackInputError, AttackOutput, register_attack
from robust_attn.attacks.progress import changed_rows, put_rows

__all__ = ["Square", "p_schedule", "square_side", "eta_pattern", "square_run", "SquareRun", "DEFAULT_QUERIES",
           "P_INIT", "P_BREAKS"]

DEFAULT_QUERIES = 5000
P_INIT = 0.8
P_BREAKS = (10, 50, 200, 500, 1000, 2000, 4000, 6000, 8000)   # halvings, in a 10000-query run
PAPER = "Andriushchenko, Croce, Flammarion & Hein, ECCV 2020, Algorithms 1-3 (Square Attack)"


def p_schedule(p_init: float, it: int, budget: int) -> float:
    """``p`` at iteration ``it`` (0-based) of a run with ``budget`` queries: ``p_init`` halved once
    for every breakpoint of :data:`P_BREAKS` below ``floor(10000 * it / budget)``."""
    scaled = (10000 * it) // budget
    return p_init / 2 ** sum(scaled > b for b in P_BREAKS)


def square_side(p: float, height: int, width: int, norm: str) -> int:
    """Side of the square covering a fraction ``p`` of the ``height x width`` pixels (module docstring)."""
    s = int(round(math.sqrt(p * height * width)))
    top = min(height, width)
    if norm == "linf":
        return min(max(s, 1), top)
    s = max(s, 3)
    s += 1 - s % 2
    return s if s <= top else top - 1 + top % 2


def _rectangle(rows: int, cols: int, dtype, device) -> torch.Tensor:
    """``eta_r``: value ``sum_{k=d+1}^{N+1} 1/k^2`` at Chebyshev distance ``d`` from the centre."""
    big = max(rows // 2, cols // 2)
    d = torch.maximum((torch.arange(rows, device=device) - rows // 2).abs()[:, None],
                      (torch.arange(cols, device=device) - cols // 2).abs()[None, :])
    tail = torch.cumsum(1.0 / torch.arange(big + 1, 0, -1, dtype=torch.float64, device=device) ** 2, 0).flip(0)
    out = tail[d].to(dtype)                      # tail[d] = sum_{k=d+1}^{big+1} 1/k^2
    return out / out.norm()


def eta_pattern(s: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """The L2 update pattern ``eta`` of side ``s`` (eq. 4), unit L2 norm, not transposed."""
    out = torch.cat([_rectangle(s // 2, s, dtype, device), -_rectangle(s - s // 2, s, dtype, device)], 0)
    return out / out.norm()


def _place(pattern: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Per image ``i``, ``pattern[i]`` (s x s) placed at ``(rows[i], cols[i])`` in an (n, H, W) zero frame."""
    n, s = pattern.shape[0], pattern.shape[-1]
    frame = pattern.new_zeros(n, height, width)
    r = rows[:, None, None] + torch.arange(s, device=rows.device)[None, :, None]
    c = cols[:, None, None] + torch.arange(s, device=cols.device)[None, None, :]
    frame[torch.arange(n, device=rows.device)[:, None, None], r, c] = pattern
    return frame


def _window(rows: torch.Tensor, cols: torch.Tensor, s: int, height: int, width: int) -> torch.Tensor:
    """(n, 1, H, W) boolean mask of the s x s squares at ``(rows, cols)``."""
    h = torch.arange(height, device=rows.device)
    w = torch.arange(width, device=cols.device)
    in_r = (h[None] >= rows[:, None]) & (h[None] < rows[:, None] + s)
    in_c = (w[None] >= cols[:, None]) & (w[None] < cols[:, None] + s)
    return (in_r[:, :, None] & in_c[:, None, :])[:, None]


def _signs(shape, gen: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    return rng.randint(0, 2, shape, gen, like.device).to(like.dtype) * 2 - 1


def _norm(v: torch.Tensor) -> torch.Tensor:
    return v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))


def _l2_init(images: torch.Tensor, eps: float, gen: torch.Generator) -> torch.Tensor:
    n, c, h, w = images.shape
    s = min(h, w) // 5
    delta = torch.zeros_like(images)
    top, left = (h - 5 * s) // 2, (w - 5 * s) // 2
    eta = eta_pattern(s, images.dtype, images.device)
    for i in range(5):
        for j in range(5):
            flip = rng.rand(n, gen, images.device) < 0.5
            pat = torch.where(flip[:, None, None], eta.t()[None], eta[None])           # (n, s, s)
            sign = _signs((n, c), gen, images)[:, :, None, None]
            delta[:, :, top + i * s: top + (i + 1) * s, left + j * s: left + (j + 1) * s] += pat[:, None] * sign
    return (images + eps * delta / (_norm(delta) + 1e-12)).clamp(0, 1)


class SquareRun:
    """Result of :func:`square_run`: ``x_best``, ``loss`` (of ``x_best``), ``success``, ``queries``
    (per image, this run only) and, when asked, ``history`` (``loss`` after every iteration)."""

    def __init__(self, x_best, loss, success, queries, history):
        self.x_best, self.loss, self.success, self.queries, self.history = x_best, loss, success, queries, history


def square_run(model: nn.Module, images: torch.Tensor, active: torch.Tensor, loss_fn, success_fn, norm: str,
               eps: float, budget: int, p_init: float, gen: torch.Generator, record: bool = False,
               resume: dict | None = None, save=None) -> SquareRun:
    """One restart of Algorithm 1 on the ``active`` images (all draws are made for the whole batch).

    ``loss_fn(logits, idx)`` / ``success_fn(logits, idx)``: per-image loss to minimize and success,
    for the images ``idx``. ``budget`` queries per image: the initial point and ``budget - 1``
    iterations. ``save(state)``, when given, is called after every iteration with a function that
    returns what the rest of the run depends on besides ``gen`` (a dict); ``resume`` (such a dict,
    with ``gen`` restored by the caller) continues from there."""
    n, c, h, w = images.shape
    x_best = images.clone()
    loss = torch.full((n,), float("inf"), dtype=images.dtype, device=images.device)
    success = torch.zeros(n, dtype=torch.bool, device=images.device)
    queries = torch.zeros(n, dtype=torch.long, device=images.device)
    history = []
    first = 0
    if resume is not None:
        put_rows(x_best, resume["x_best"])
        loss.copy_(resume["loss"])
        success.copy_(resume["success"])
        queries.copy_(resume["queries"])
        first = resume["it"]
    else:
        if norm == "linf":
            start = (images + eps * _signs((n, c, 1, w), gen, images)).clamp(0, 1)
        else:
            start = _l2_init(images, eps, gen)
        idx = active.nonzero().flatten()
        if idx.numel():
            logits = model(start[idx])
            x_best[idx] = start[idx]
            loss[idx] = loss_fn(logits, idx)
            success[idx] = success_fn(logits, idx)
            queries[idx] += 1
        if record:
            history.append(loss.clone())
    for it in range(first, budget - 1):
        p = p_schedule(p_init, it, budget)
        s = square_side(p, h, w, norm)
        rows = rng.randint(0, h - s + 1, (n,), gen, images.device)
        cols = rng.randint(0, w - s + 1, (n,), gen, images.device)
        rho = _signs((n, c), gen, images)[:, :, None, None]
        if norm == "l2":
            rows2 = rng.randint(0, h - s + 1, (n,), gen, images.device)
            cols2 = rng.randint(0, w - s + 1, (n,), gen, images.device)
            flip = rng.rand(n, gen, images.device) < 0.5
        todo = (active & ~success).nonzero().flatten()
        if todo.numel() == 0:
            if record:
                history.append(loss.clone())
            continue
        x, xh = images[todo], x_best[todo]
        win = _window(rows[todo], cols[todo], s, h, w)
        if norm == "linf":
            x_new = torch.where(win, xh + 2 * eps * rho[todo], xh)
            x_new = torch.min(torch.max(x_new, x - eps), x + eps).clamp(0, 1)
        else:
            win2 = _window(rows2[todo], cols2[todo], s, h, w)
            nu = xh - x
            unused = (eps ** 2 - _norm(nu) ** 2).clamp_min(0)                                   # (m, 1, 1, 1)
            eta = eta_pattern(s, images.dtype, images.device)
            pat = torch.where(flip[todo][:, None, None], eta.t()[None], eta[None])
            eta_full = _place(pat, rows[todo], cols[todo], h, w)[:, None]                        # (m, 1, H, W)
            nu_w1 = nu * win
            norm_w1 = nu_w1.pow(2).sum((2, 3), keepdim=True).sqrt()                              # (m, c, 1, 1)
            temp = rho[todo] * eta_full + nu_w1 / (norm_w1 + 1e-12)
            avail = ((nu * (win | win2)).pow(2).sum((2, 3), keepdim=True) + unused / c).sqrt()
            temp = temp / (temp.pow(2).sum((2, 3), keepdim=True).sqrt() + 1e-12) * avail
            nu_new = torch.where(win, temp, torch.where(win2, torch.zeros_like(nu), nu))
            size = _norm(nu_new)
            nu_new = nu_new * torch.where(size > eps, eps / size.clamp_min(1e-30), torch.ones_like(size))
            x_new = (x + nu_new).clamp(0, 1)
        logits = model(x_new)
        new_loss, ok = loss_fn(logits, todo), success_fn(logits, todo)
        queries[todo] += 1
        take = (new_loss < loss[todo]) | ok
        x_best[todo[take]] = x_new[take]
        loss[todo[take]] = new_loss[take]
        success[todo[ok]] = True
        if record:
            history.append(loss.clone())
        if save is not None:
            save(lambda it=it: {"it": it + 1, "x_best": changed_rows(x_best, images), "loss": loss,
                                "success": success, "queries": queries})
    return SquareRun(x_best, loss, success, queries, history)


@register_attack
class Square(Attack):
    """Square Attack (module docstring), score-based; L-inf and L2; untargeted (margin loss) or
    targeted (cross-entropy of the target)."""

    name = "square"
    gradient_free = True
    paper = PAPER
    portable_progress = True   # its generator is a CPU one on every device (robust_attn.attacks.rng)

    def __init__(self, config: AttackConfig):
        super().__init__(config)
        if config.step is not None:
            raise AttackInputError(f"square sets its own square sizes (p schedule): drop step={config.step!r}")
        if config.schedule != "constant":
            raise AttackInputError(f"square has its own p schedule: drop schedule={config.schedule!r}")
        self.budget = DEFAULT_QUERIES if config.queries is None else config.queries
        if self.budget < 1:
            raise AttackInputError(f"square needs queries >= 1 per restart (the initial point costs one; default "
                                   f"{DEFAULT_QUERIES}), got queries={self.budget}")
        self.p_init = config.options.get("p_init", P_INIT)
        if isinstance(self.p_init, bool) or not isinstance(self.p_init, numbers.Real) or not 0 < self.p_init <= 1:
            raise AttackInputError(f"options['p_init'] must be a fraction in (0, 1] (default {P_INIT}), "
                                   f"got {self.p_init!r}")

    def _run(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
             targets: torch.Tensor | None) -> AttackOutput:
        c = self.config
        if c.norm == "l2" and min(images.shape[-2:]) < 5:
            raise AttackInputError(f"square L2 tiles the image in a 5 x 5 grid: it needs images of at least 5 x 5 "
                                   f"pixels, got {tuple(images.shape[-2:])}; use the linf norm or larger images")
        gen = rng.generator(c.seed)   # a CPU generator: progress portable across devices
        with torch.no_grad():
            logits = model(images)
            if c.targeted:
                loss_fn = lambda z, i: F.cross_entropy(z, targets[i], reduction="none")   # noqa: E731
                success_fn = lambda z, i: z.argmax(1) == targets[i]                       # noqa: E731
            else:
                loss_fn = lambda z, i: _margin(z, labels[i])                              # noqa: E731
                success_fn = lambda z, i: z.argmax(1) != labels[i]                        # noqa: E731
            all_idx = torch.arange(len(images), device=images.device)
            done = success_fn(logits, all_idx)
            queries = torch.ones(len(images), dtype=torch.long, device=images.device)
            adv, best = images.clone(), images.clone()
            best_loss = torch.full((len(images),), float("inf"), dtype=images.dtype, device=images.device)
            saved = self.progress.state if self.progress is not None else None
            if saved is not None:   # a killed run: continue its restart at the iteration it saved
                done, queries = saved["done"].to(done), saved["queries"].to(queries)
                best_loss = saved["best_loss"].to(best_loss)
                put_rows(adv, saved["adv"])
                put_rows(best, saved["best"])
                gen.set_state(saved["gen"].cpu())
            for r in range(saved["restart"] if saved is not None else 0, c.restarts):
                active = ~done
                if not active.any():
                    break

                def save(run_state, r=r):
                    if self.progress.due():
                        run = run_state()
                        left = int((~done & ~run["success"]).sum())
                        self.progress.save({"restart": r, "done": done, "queries": queries, "best_loss": best_loss,
                                            "adv": changed_rows(adv, images), "best": changed_rows(best, images),
                                            "gen": gen.get_state(), "run": run},
                                           note=f"query {run['it'] + 1} of {self.budget} (restart {r + 1} of "
                                                f"{c.restarts}), {left} images not fooled yet",
                                           fraction=(r * self.budget + run["it"] + 1) / (c.restarts * self.budget))
                res = square_run(model, images, active, loss_fn, success_fn, c.norm, c.eps, self.budget,
                                 self.p_init, gen, resume=saved["run"] if saved is not None else None,
                                 save=save if self.progress is not None else None)
                saved = None
                queries += res.queries
                hit = active & res.success
                adv[hit] = res.x_best[hit]
                done |= hit
                better = active & ~res.success & (res.loss < best_loss)
                best[better], best_loss[better] = res.x_best[better], res.loss[better]
            miss = ~done & torch.isfinite(best_loss)
            adv[miss] = best[miss]
        return AttackOutput(adv, queries=queries)


def _margin(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The margin loss ``z_y - max_{j != y} z_j`` per image."""
    z_y = logits.gather(1, labels[:, None])[:, 0]
    return z_y - logits.scatter(1, labels[:, None], float("-inf")).amax(1)
