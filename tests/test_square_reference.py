"""Square Attack (robust_attn/attacks/square.py) against independent references, per image, on
shared random draws:

* the ``p`` schedule against torchattacks 3.5.1's ``Square.p_selection`` (a copy of the
  AutoAttack authors' schedule: ``p_init`` halved after iterations 10, 50, 200, 500, 1000, 2000,
  4000, 6000 and 8000 of 10000, other budgets rescaled to 10000);
* L-inf (Algorithms 1 and 2) against torchattacks' ``attack_single_run``, one image at a time
  (torchattacks draws one square per batch, ours one per image: on a batch of one the draws are
  the same), ours handed torchattacks' draws. Two differences of torchattacks are undone in the
  reference, both listed in ``square.py``'s docstring: its positions come from
  ``{0, ..., H - s - 1}`` (we hand ours the same integers, so the comparison holds either way),
  and its budget counts iterations after the initial query (``n_queries`` iterations) where ours
  counts the initial query too: the reference runs ``budget - 1`` iterations with ``p`` rescaled
  by ``budget``;
* L2 (Algorithm 3) against the paper's algorithm written below as a slow loop over channels (the
  official code and torchattacks take the available budget over all channels together and
  rescale every update to norm eps, where the paper works per channel; ours follows the paper),
  with the update pattern ``eta`` from torchattacks' ``eta_rectangles``, on ours's draws.

Where a reference needs ours's draws, ``square_module.rng`` is replaced by a feed that returns
given values (and records what it hands out).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import robust_attn.attacks.square as square_module
from robust_attn.attacks.square import P_INIT, _margin, p_schedule, square_run

torchattacks = pytest.importorskip("torchattacks")


def linear_model(seed: int) -> nn.Module:
    """A 10-class linear model on 3 x 32 x 32 images, float64: every pixel moves every logit."""
    g = torch.Generator().manual_seed(seed)
    net = nn.Linear(3 * 32 * 32, 10).double()
    net.weight.data = torch.randn(10, 3 * 32 * 32, generator=g, dtype=torch.float64) * 0.05
    net.bias.data = torch.randn(10, generator=g, dtype=torch.float64) * 0.1
    return nn.Sequential(nn.Flatten(), net).eval()


@pytest.fixture(scope="module")
def problem():
    model = linear_model(3)
    images = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        labels = model(images).argmax(1)
    return model, images, labels


class Feed:
    """Stands in for :mod:`robust_attn.attacks.rng` inside square.py: ``randint`` and ``rand``
    return the given values in order (``values``: a list of tensors; once they run out, the lowest
    allowed value), or, with ``values=None``, draw from a seeded generator; ``log`` keeps what was
    handed out."""

    def __init__(self, values=None, seed: int = 0):
        self.values, self.pos, self.log = values, 0, []
        self.gen = torch.Generator().manual_seed(seed)

    def _next(self, shape, fresh):
        if self.values is None:
            out = fresh()
        elif self.pos < len(self.values):
            out = self.values[self.pos].reshape(shape)
            self.pos += 1
        else:
            out = None
        self.log.append(out)
        return out

    def randint(self, low, high, shape, gen, device):
        out = self._next(shape, lambda: torch.randint(low, high, shape, generator=self.gen))
        return torch.full(shape, low, dtype=torch.long) if out is None else out.long()

    def rand(self, shape, gen, device, dtype=None):
        out = self._next(shape, lambda: torch.rand(shape, generator=self.gen, dtype=torch.float64))
        return torch.zeros(shape, dtype=torch.float64) if out is None else out


def ours(model, image, label, norm, eps, budget, feed, monkeypatch):
    monkeypatch.setattr(square_module, "rng", feed)
    with torch.no_grad():
        return square_run(model, image[None], torch.ones(1, dtype=torch.bool), lambda z, i: _margin(z, label[None]),
                          lambda z, i: z.argmax(1) != label, norm, eps, budget, P_INIT, None)


# --- p schedule ------------------------------------------------------------------------------
def reference_square(model, budget: int, norm="Linf", eps=8 / 255):
    return torchattacks.Square(model, norm=norm, eps=eps, n_queries=budget, p_init=P_INIT, seed=0)


@pytest.mark.parametrize("budget", [10000, 5000, 1000, 100, 37])
def test_p_schedule_matches_torchattacks(budget):
    atk = reference_square(linear_model(0), budget)
    float_cases = [it for it in range(budget) if int(it / budget * 10000) != (10000 * it) // budget]
    for it in range(budget):
        if it in float_cases:      # torchattacks truncates the float it / budget * 10000 (square.py, difference 6)
            continue
        assert p_schedule(P_INIT, it, budget) == atk.p_selection(it), (it, budget)
    assert len(float_cases) < budget // 10


# --- L-inf against torchattacks ----------------------------------------------------------------
class Budgeted(torchattacks.Square):
    """torchattacks' Square with ours's budget convention: ``budget - 1`` iterations after the
    initial query, ``p`` rescaled by ``budget``; its draws recorded."""

    def __init__(self, model, budget, **kw):
        super().__init__(model, n_queries=budget - 1, p_init=P_INIT, **kw)
        self.budget, self.draws = budget, []

    def p_selection(self, it):
        n, self.n_queries = self.n_queries, self.budget
        try:
            return super().p_selection(it)
        finally:
            self.n_queries = n

    def random_int(self, *args, **kwargs):
        out = super().random_int(*args, **kwargs)
        self.draws.append(out.cpu().long())
        return out

    def random_choice(self, shape):
        out = super().random_choice(shape)
        assert (out != 0).all()
        self.draws.append(((out.cpu() + 1) // 2).long())     # sign -> ours's bit (1 for +1)
        return out


@pytest.mark.parametrize("budget", [300])
def test_linf_matches_torchattacks_per_image(problem, monkeypatch, budget):
    model, images, labels = problem
    eps = 6 / 255
    fooled = 0
    for k in range(len(images)):
        atk = Budgeted(model, budget, norm="Linf", eps=eps)
        atk.init_hyperparam(images[k:k + 1])
        torch.manual_seed(10 + k)
        with torch.no_grad():
            ref_queries, ref_best = atk.attack_single_run(images[k:k + 1], labels[k:k + 1])
        assert all(p_schedule(P_INIT, it, budget) == atk.p_selection(it) for it in range(budget - 1))
        run = ours(model, images[k], labels[k], "linf", eps, budget, Feed(atk.draws), monkeypatch)
        torch.testing.assert_close(run.x_best, ref_best, rtol=0, atol=1e-12)
        assert int(run.queries[0]) == int(ref_queries[0]), k
        with torch.no_grad():
            ref_fooled = bool(model(ref_best).argmax(1) != labels[k])
        assert bool(run.success[0]) == ref_fooled
        fooled += ref_fooled
    assert 0 < fooled < len(images), "pick eps so that some images are fooled and some are not"


# --- L2 against the paper, written out ----------------------------------------------------------
def eta(s: int, transpose: bool) -> np.ndarray:
    """Eq. 4 (two stacked rectangles of opposite sign, unit norm) from torchattacks' rectangles."""
    atk = reference_square(linear_model(0), 10, norm="L2", eps=1.0)
    atk.device = torch.device("cpu")
    out = np.concatenate([atk.eta_rectangles(s // 2, s).numpy(), -atk.eta_rectangles(s - s // 2, s).numpy()])
    out = out / np.sqrt((out ** 2).sum())
    return out.T if transpose else out


def paper_l2(model, x, y, eps, budget, draws):
    """Algorithms 1 and 3 for one image (float64, loops), consuming ``draws`` (ours's, in order):
    returns (x_best, queries, fooled)."""
    draws = iter(draws)
    c, h, w = x.shape
    x = x.numpy()

    def margin(v):
        with torch.no_grad():
            z = model(torch.from_numpy(v)[None])[0].numpy()
        return z[y] - np.max(np.delete(z, y)), int(np.argmax(z)) != y

    # initialization: a 5 x 5 grid of tiles of side floor(min(h, w) / 5), centred, each eta with a
    # random orientation and a random sign per channel, scaled to norm eps
    s = min(h, w) // 5
    top, left = (h - 5 * s) // 2, (w - 5 * s) // 2
    delta = np.zeros_like(x)
    for i in range(5):
        for j in range(5):
            flip = float(next(draws)[0]) < 0.5
            signs = next(draws)[0].numpy() * 2 - 1
            for ch in range(c):
                delta[ch, top + i * s: top + (i + 1) * s, left + j * s: left + (j + 1) * s] += signs[ch] * eta(s, flip)
    best = np.clip(x + eps * delta / np.sqrt((delta ** 2).sum()), 0, 1)
    loss, fooled = margin(best)
    queries = 1
    for it in range(budget - 1):
        # side: round(sqrt(p h w)), odd, at least 3 (at most min(h, w)); p from the authors' schedule
        scaled = 10000 * it // budget
        p = P_INIT / 2 ** sum(scaled > b for b in (10, 50, 200, 500, 1000, 2000, 4000, 6000, 8000))
        s = max(int(round(math.sqrt(p * h * w))), 3)
        s += 1 - s % 2
        r1, c1 = int(next(draws)[0]), int(next(draws)[0])
        rho = next(draws)[0].numpy() * 2 - 1
        r2, c2 = int(next(draws)[0]), int(next(draws)[0])
        flip = float(next(draws)[0]) < 0.5
        if fooled:
            continue
        nu = best - x
        unused = max(eps ** 2 - (nu ** 2).sum(), 0.0)
        w1 = np.zeros((h, w), bool)
        w1[r1:r1 + s, c1:c1 + s] = True
        w2 = np.zeros((h, w), bool)
        w2[r2:r2 + s, c2:c2 + s] = True
        pattern = eta(s, flip)
        new = nu.copy()
        for ch in range(c):
            window = nu[ch][w1].reshape(s, s)
            size = np.sqrt((window ** 2).sum())
            temp = rho[ch] * pattern + (window / size if size > 0 else 0.0)
            avail = np.sqrt((nu[ch][w1 | w2] ** 2).sum() + unused / c)
            new[ch][w2] = 0.0
            new[ch][w1] = (avail * temp / np.sqrt((temp ** 2).sum())).ravel()
        candidate = np.clip(x + new, 0, 1)
        cand_loss, cand_fooled = margin(candidate)
        queries += 1
        if cand_loss < loss or cand_fooled:
            best, loss = candidate, cand_loss
        fooled = fooled or cand_fooled
    return torch.from_numpy(best), queries, fooled


def test_l2_matches_the_papers_algorithm_per_image(problem, monkeypatch):
    model, images, labels = problem
    eps, budget = 0.5, 120
    fooled = 0
    for k in range(len(images)):
        feed = Feed(seed=20 + k)
        run = ours(model, images[k], labels[k], "l2", eps, budget, feed, monkeypatch)
        best, queries, ok = paper_l2(model, images[k], int(labels[k]), eps, budget, feed.log)
        # atol: torchattacks builds eta in float32
        torch.testing.assert_close(run.x_best[0], best, rtol=0, atol=1e-6)
        assert int(run.queries[0]) == queries and bool(run.success[0]) == ok, k
        fooled += ok
    assert 0 < fooled < len(images), "pick eps so that some images are fooled and some are not"
