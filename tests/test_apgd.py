"""APGD-CE and APGD-T (robust_attn/attacks/apgd.py) against Croce & Hein, ICML 2020, Algorithm 1.

The reference below is Algorithm 1 transcribed with per-image Python state (lists of losses,
step sizes and best points per image); it calls the model on the same batch as the attack, so
both see bit-identical logits and gradients and must agree image by image.
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from robust_attn.attacks.apgd import apgd_single_run, checkpoints, dlr_loss, dlr_loss_targeted, random_start
from robust_attn.attacks.base import AttackConfig, AttackInputError, list_attacks, make_attack
from robust_attn.models.wrapper import NormalizedModel

from helpers import tiny_resnet


def _tiny_model(seed: int = 1, num_classes: int = 10) -> NormalizedModel:
    return tiny_resnet(seed, num_classes, stem_downsample=4)


@pytest.fixture(scope="module")
def model() -> NormalizedModel:
    return _tiny_model()


def _batch(model, n: int, seed: int = 2):
    images = torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    images[0, :, :4] = 0.0   # pixels on the [0, 1] boundary exercise the clipping
    images[1, :, :4] = 1.0
    with torch.no_grad():
        labels = model(images).argmax(1)   # every image starts correctly classified
    return images, labels


@pytest.fixture(scope="module")
def batch(model):
    return _batch(model, 8)


def _predict(model, x):
    with torch.no_grad():
        return model(x).argmax(1)


def _size(delta: torch.Tensor, norm: str) -> torch.Tensor:
    d = delta.flatten(1)
    return d.abs().amax(1) if norm == "linf" else d.norm(dim=1)


# ------------------------------------------------------------------ checkpoints and losses

def _paper_checkpoints(n_iter: int) -> list[int]:
    """Section 3, from the recurrence in exact fractions: p_0 = 0, p_1 = 0.22,
    p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06), w_j = ceil(p_j * n_iter), kept while <= n_iter."""
    p = [Fraction(0), Fraction(22, 100)]
    while p[-1] <= 1:
        p.append(p[-1] + max(p[-1] - p[-2] - Fraction(3, 100), Fraction(6, 100)))
    w = [math.ceil(pj * n_iter) for pj in p]
    return sorted({wj for wj in w if wj <= n_iter})


def test_checkpoints_for_100_iterations_are_the_papers():
    expected = _paper_checkpoints(100)
    assert expected == [0, 22, 41, 57, 70, 80, 87, 93, 99]   # the recurrence, worked by hand
    assert checkpoints(100) == expected


@pytest.mark.parametrize("n_iter", [1, 2, 5, 10, 37, 50, 123, 250, 1000])
def test_checkpoints_follow_the_recurrence_for_any_length(n_iter):
    assert checkpoints(n_iter) == _paper_checkpoints(n_iter)


def test_checkpoints_avoid_the_float_trap():
    # the recurrence in floats gives p_3 = 0.5700000000000001, whose ceil(p_3 * 100) is 58, not 57
    p = [0.0, 0.22]
    for _ in range(2):
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
    assert math.ceil(p[3] * 100) == 58
    assert 57 in checkpoints(100) and 58 not in checkpoints(100)


LOGITS = torch.tensor([[1.0, 4.0, 2.0, 3.0, 0.5],
                       [2.0, -1.0, 0.0, 5.0, 2.5]])


def test_dlr_values_by_hand():
    # row 0 sorted: 4, 3, 2, 1, .5; row 1 sorted: 5, 2.5, 2, 0, -1
    # eq. 5, y = (0, 3): -(1 - 4) / (4 - 2) = 1.5;  -(5 - 2.5) / (5 - 2) = -5/6
    got = dlr_loss(LOGITS, torch.tensor([0, 3]))
    torch.testing.assert_close(got, torch.tensor([1.5, -5 / 6]))
    # eq. 5 with y the top class of row 0: -(4 - 3) / (4 - 2) = -0.5
    torch.testing.assert_close(dlr_loss(LOGITS[:1], torch.tensor([1])), torch.tensor([-0.5]))
    # eq. 6, (y, t) = (1, 4): -(4 - .5) / (4 - (2 + 1) / 2) = -1.4;  (3, 1): -(5 + 1) / (5 - (2 + 0) / 2) = -1.5
    got = dlr_loss_targeted(LOGITS, torch.tensor([1, 3]), torch.tensor([4, 1]))
    torch.testing.assert_close(got, torch.tensor([-1.4, -1.5]))


def test_dlr_is_invariant_to_shift_and_positive_scale_of_the_logits():
    z = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    y, t = torch.arange(6) % 10, (torch.arange(6) + 3) % 10
    for a, b in [(3.0, -2.0), (0.1, 7.0)]:
        torch.testing.assert_close(dlr_loss(a * z + b, y), dlr_loss(z, y), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dlr_loss_targeted(a * z + b, y, t), dlr_loss_targeted(z, y, t), rtol=1e-5, atol=1e-5)


def test_dlr_needs_enough_classes():
    with pytest.raises(AttackInputError, match="at least 3 classes.*apgd-ce"):
        dlr_loss(torch.zeros(2, 2), torch.tensor([0, 1]))
    with pytest.raises(AttackInputError, match="at least 4 classes.*apgd-ce"):
        dlr_loss_targeted(torch.zeros(2, 3), torch.tensor([0, 1]), torch.tensor([1, 2]))
    dlr_loss(torch.randn(2, 3), torch.tensor([0, 1]))   # 3 classes are enough for eq. 5


# ------------------------------------------------------------------ the random start x(0)

def _interior(n: int = 6, seed: int = 3) -> torch.Tensor:
    """Images with every value in [0.25, 0.75]: a start of radius <= 0.25 per pixel is never clipped."""
    return 0.25 + 0.5 * torch.rand(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def test_linf_random_start_is_uniform_in_the_cube_scaled_onto_the_eps_sphere():
    """x(0) for L-inf (module docstring of apgd.py, as the official AutoAttack code; Algorithm 1
    leaves x(0) open): u ~ U[-1, 1]^d, x(0) = x + eps * u / ||u||_inf, clipped to [0, 1]: every
    image starts on the boundary of the eps-ball, ||x(0) - x||_inf == eps, not at a fraction of it."""
    images, eps = _interior(), 8 / 255
    start = random_start(images, "linf", eps, torch.Generator().manual_seed(5))
    delta = start - images
    torch.testing.assert_close(_size(delta, "linf"), torch.full((6,), eps), rtol=1e-6, atol=0)
    # the direction is uniform in the cube, not a corner: about half the pixels move less than eps / 2
    inner = (delta.abs() < eps / 2).float().mean().item()
    assert 0.35 < inner < 0.65, inner
    u = 2 * torch.rand(images.shape, generator=torch.Generator().manual_seed(5)) - 1   # the same draw, by hand
    torch.testing.assert_close(start, images + eps * u / u.flatten(1).abs().amax(1).view(-1, 1, 1, 1),
                               rtol=0, atol=1e-7)


def test_l2_random_start_is_a_gaussian_direction_on_the_eps_sphere():
    """x(0) for L2: g ~ N(0, I), x(0) = x + eps * g / ||g||_2, clipped to [0, 1]:
    ||x(0) - x||_2 == eps for every (interior) image."""
    images, eps = _interior(), 0.5
    start = random_start(images, "l2", eps, torch.Generator().manual_seed(5))
    delta = start - images
    torch.testing.assert_close(_size(delta, "l2"), torch.full((6,), eps), rtol=1e-6, atol=0)
    g = torch.randn(images.shape, generator=torch.Generator().manual_seed(5))   # the same draw, by hand
    torch.testing.assert_close(delta, eps * g / g.flatten(1).norm(dim=1).view(-1, 1, 1, 1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("norm,eps", [("linf", 8 / 255), ("l2", 0.5)])
def test_random_start_is_deterministic_per_seed_and_clipped_to_the_unit_box(norm, eps):
    images = _interior()
    images[0] = 0.0   # on the box's faces the start is clipped: in [0, 1], inside the ball
    images[1] = 1.0
    state = torch.get_rng_state()
    a = random_start(images, norm, eps, torch.Generator().manual_seed(1))
    b = random_start(images, norm, eps, torch.Generator().manual_seed(1))
    c = random_start(images, norm, eps, torch.Generator().manual_seed(2))
    assert torch.equal(torch.get_rng_state(), state)   # drawn from the generator given, not the global RNG
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.min() >= 0 and a.max() <= 1
    size = _size(a - images, norm)
    assert (size <= eps * (1 + 1e-6)).all()
    torch.testing.assert_close(size[2:], torch.full((4,), eps), rtol=1e-6, atol=0)


# ------------------------------------------------------------------ the reference: Algorithm 1

def _torchattacks_checkpoints(n_iter: int) -> list[int]:
    """torchattacks 3.5.1 (and the official code): a first interval int(0.22 N), shrinking by
    int(0.03 N) down to int(0.06 N), each at least 1."""
    k, out = max(int(0.22 * n_iter), 1), [0]
    while out[-1] + k <= n_iter:
        out.append(out[-1] + k)
        k = max(k - max(int(0.03 * n_iter), 1), max(int(0.06 * n_iter), 1))
    return out


def _reference_run(model, images, x_init, loss_of, success_of, norm, eps, n_iter, rho=0.75, alpha=0.75,
                   torchattacks_logic=False, torchattacks_rounding=False):
    """Algorithm 1, per image. ``x[k]``, ``f[k]``: iterates and losses; the checkpoint w is
    evaluated once x[w] exists, and a restart overwrites x[w] (and f[w], its gradient) by x_max.

    ``torchattacks_logic=True`` applies the deviations 1-5 listed in the module docstring of
    robust_attn/attacks/apgd.py (schedule, condition 1 against 0 and with <=, condition 2 off at
    the first checkpoint, losses of discarded iterates); ``torchattacks_rounding=True`` writes the
    steps and projections in torchattacks' order of float operations (same maths)."""
    W = _torchattacks_checkpoints(n_iter) if torchattacks_logic else _paper_checkpoints(n_iter)
    n = images.shape[0]

    def forward(xs):   # one batch call, so logits and gradients are those the attack sees
        xs = torch.stack(xs).detach().requires_grad_(True)
        logits = model(xs)
        loss = loss_of(logits)
        grad, = torch.autograd.grad(loss.sum(), xs)
        return loss.tolist(), list(grad), success_of(logits).tolist()

    def P(v, x0, tiny=0.0):
        if norm == "linf":
            return torch.clamp(torch.minimum(torch.maximum(v, x0 - eps), x0 + eps), 0, 1)
        d = v - x0
        if torchattacks_rounding:
            size = (d[None] ** 2).sum(dim=(1, 2, 3)).sqrt()[0]
            return torch.clamp(x0 + d / (size + 1e-12) * torch.minimum(torch.tensor(eps), size + tiny), 0, 1)
        size = d[None].flatten(1).norm(dim=1)[0]   # same reduction as the batched flatten(1).norm
        if size > eps:
            d = d * (eps / size)
        return torch.clamp(x0 + d, 0, 1)

    def direction(g):
        if norm == "linf":
            return g.sign()
        return g / (g[None].flatten(1).norm(dim=1)[0] + 1e-12)

    x = [[x_init[i].clone()] for i in range(n)]
    f0, g0, ok0 = forward([x_init[i] for i in range(n)])
    f = [[v] for v in f0]
    f_orig = [[0.0] for _ in f0]   # quirks: the losses as computed, and 0 in place of f(x(0))
    halved_last = [torchattacks_logic] * n
    grads = [[g] for g in g0]
    eta = [2 * eps] * n
    eta_at = [{0: 2 * eps} for _ in range(n)]
    x_max = [x_init[i].clone() for i in range(n)]
    f_max, g_max = list(f0), list(g0)
    f_max_at = [{0: f0[i]} for i in range(n)]
    first = [x_init[i].clone() if ok0[i] else None for i in range(n)]
    for k in range(n_iter):   # computes x[k + 1]
        new = []
        for i in range(n):
            xk, x0 = x[i][k], images[i]
            if torchattacks_rounding and norm == "l2":   # (eta * g) / |g| rounds unlike eta * (g / |g|)
                g = grads[i][k]
                z = P(xk + eta[i] * g / ((g[None] ** 2).sum(dim=(1, 2, 3)).sqrt()[0] + 1e-12), x0)
            else:
                z = P(xk + eta[i] * direction(grads[i][k]), x0)
            if torchattacks_rounding:   # alpha = 1 on the first step, written as a momentum step
                a, back = (1.0, xk) if k == 0 else (alpha, x[i][k - 1])
                new.append(P(xk + a * (z - xk) + (1 - a) * (xk - back), x0, tiny=1e-12))
            else:
                new.append(z if k == 0 else P(xk + alpha * (z - xk) + (1 - alpha) * (xk - x[i][k - 1]), x0))
        fk, gk, okk = forward(new)
        w = k + 1
        for i in range(n):
            x[i].append(new[i])
            f[i].append(fk[i])
            f_orig[i].append(fk[i])
            grads[i].append(gk[i])
            if fk[i] > f_max[i]:
                x_max[i], f_max[i], g_max[i] = new[i], fk[i], gk[i]
            if okk[i] and first[i] is None:
                first[i] = new[i]
            if w in W[1:]:
                prev = W[W.index(w) - 1]
                eta_at[i][w], f_max_at[i][w] = eta[i], f_max[i]
                if torchattacks_logic:
                    increases = sum(f_orig[i][j + 1] > f_orig[i][j] for j in range(prev, w))
                    cond1 = increases <= rho * (w - prev)
                    cond2 = not halved_last[i] and f_max_at[i][prev] >= f_max_at[i][w]
                else:
                    increases = sum(f[i][j + 1] > f[i][j] for j in range(prev, w))
                    cond1 = increases < rho * (w - prev)
                    cond2 = eta_at[i][prev] == eta_at[i][w] and f_max_at[i][prev] == f_max_at[i][w]
                halved_last[i] = cond1 or cond2
                if cond1 or cond2:
                    eta[i] /= 2
                    x[i][w], f[i][w], grads[i][w] = x_max[i], f_max[i], g_max[i]
    return dict(x_best=torch.stack(x_max), loss_best=torch.tensor(f_max), success=[v is not None for v in first],
                x_success=[v for v in first], step=eta)


def _reference_attack(model, images, labels, config: AttackConfig, steps, targets=None, runs_log=None):
    """The attack around Algorithm 1: clean successes kept, ``restarts`` runs per target on the
    images not yet fooled (one random_start per run for the whole batch), first success, else best.
    ``runs_log``, a list, receives per run a dict {image: (best loss of the run, success)}."""
    with torch.no_grad():
        logits = model(images)
    n = images.shape[0]
    if config.attack == "apgd-ce":
        succ = lambda z, idx: z.argmax(1) != labels[idx]
        runs = [lambda z, idx: F.cross_entropy(z, labels[idx], reduction="none")]
    elif config.targeted:
        succ = lambda z, idx: z.argmax(1) == targets[idx]
        runs = [lambda z, idx: dlr_loss_targeted(z, labels[idx], targets[idx])]
    else:
        succ = lambda z, idx: z.argmax(1) != labels[idx]
        order = [sorted((c for c in range(logits.shape[1]) if c != labels[i]), key=lambda c: -logits[i, c].item())
                 for i in range(n)]
        runs = [lambda z, idx, r=r: dlr_loss_targeted(z, labels[idx], torch.tensor([order[i][r] for i in idx.tolist()]))
                for r in range(config.options["n_target_classes"])]
    done = succ(logits, torch.arange(n)).tolist()
    out = [images[i] if done[i] else None for i in range(n)]
    best, best_loss = [None] * n, [-math.inf] * n
    gen = torch.Generator().manual_seed(config.seed)
    for loss in runs:
        for _ in range(config.restarts):
            start = random_start(images, config.norm, config.eps, gen)
            idx = torch.tensor([i for i in range(n) if not done[i]], dtype=torch.long)
            if idx.numel() == 0:
                continue
            res = _reference_run(model, images[idx], start[idx], lambda z, idx=idx: loss(z, idx),
                                 lambda z, idx=idx: succ(z, idx), config.norm, config.eps, steps)
            if runs_log is not None:
                runs_log.append({i: (res["loss_best"][j].item(), res["success"][j])
                                 for j, i in enumerate(idx.tolist())})
            for j, i in enumerate(idx.tolist()):
                if res["success"][j]:
                    out[i], done[i] = res["x_success"][j], True
                if res["loss_best"][j] > best_loss[i]:
                    best[i], best_loss[i] = res["x_best"][j], res["loss_best"][j].item()
    return torch.stack([out[i] if done[i] else best[i] for i in range(n)])


def _agreement(mine: torch.Tensor, ref: torch.Tensor, atol: float = 0.0) -> int:
    return int(((mine - ref).flatten(1).abs().amax(1) <= atol).sum())


@pytest.mark.parametrize("norm,eps", [("linf", 1 / 255), ("l2", 0.1)])
@pytest.mark.parametrize("loss", ["ce", "dlr-targeted"])
def test_single_run_matches_algorithm_1_short(model, norm, eps, loss):
    images, labels = _batch(model, 4)
    start = random_start(images, norm, eps, torch.Generator().manual_seed(0))
    targets = (labels + 3) % 10
    if loss == "ce":
        loss_of = lambda z: F.cross_entropy(z, labels, reduction="none")
    else:
        loss_of = lambda z: dlr_loss_targeted(z, labels, targets)
    success_of = lambda z: z.argmax(1) != labels
    ref = _reference_run(model, images, start, loss_of, success_of, norm, eps, 12)
    mine = apgd_single_run(model, images, start, lambda z, i: loss_of(z), lambda z, i: success_of(z), norm, eps, 12)
    assert _agreement(mine.x_best, ref["x_best"]) == 4
    torch.testing.assert_close(mine.loss_best, ref["loss_best"], rtol=0, atol=0)
    assert mine.success.tolist() == ref["success"]
    assert mine.step.tolist() == pytest.approx(ref["step"], rel=1e-6)   # float32 vs float64 eta
    assert any(s < 2 * eps for s in ref["step"])   # the step-size rule did fire in this run


def _scripted_losses(values):
    """A loss that returns ``values`` in order, one per forward pass (the iterates' losses chosen
    by hand; zero gradient, so the iterates stay put and only the step-size rule acts)."""
    calls = iter(values)
    return lambda z, *idx: torch.full((z.shape[0],), float(next(calls)), dtype=z.dtype) + 0 * z.sum(1)


_RISE = list(range(23))                           # f(x_0..x_22): rising, a new f_max at every step
_SEESAW = [50] + [10 - k % 2 for k in range(1, 23)]   # f_max = 50 at x_0, then rising in half the steps
_STEP_SIZE_CASES = {   # f(x_0..x_22), f(x_23..x_41), the step at the end in units of eps
    "1": (_RISE, [30 + (k % 2) * (k // 2) for k in range(19)], 1),      # new maxima, rising in half the steps
    "2": (_RISE, [0] + list(range(1, 19)), 1),                          # a drop below f_max, then 18 rises
    "neither": (_RISE, list(range(30, 49)), 2),                         # rising past f_max at every step
    "2 but halved at 22": (_SEESAW, [0] + list(range(1, 19)), 1),       # halved at 22 (1), not again at 41
}


@pytest.mark.parametrize("case", list(_STEP_SIZE_CASES))
def test_each_condition_of_the_step_size_rule_halves_the_step_on_its_own(model, case):
    """Section 3.2's two conditions at checkpoint w_j (100 iterations: w = 22, 41, ...): (1) the loss
    rose in fewer than rho = 75% of the steps since w_{j-1}; (2) the step was not halved at w_{j-1}
    and f_max did not improve since. The losses are scripted so that at w = 41 one condition holds
    and the other does not, or neither, or (2) holds but for the halving at 22; the loss rises to
    new maxima after 41. The step ends at eps (halved once) or 2 eps, here and in the Algorithm 1
    loop written out above."""
    first, segment, expected = _STEP_SIZE_CASES[case]
    losses = first + segment + list(range(100, 159))   # f(x_42..x_100): rising, new maxima
    assert len(losses) == 101
    images = _batch(model, 2)[0][:1]
    start = random_start(images, "linf", 1 / 255, torch.Generator().manual_seed(0))
    never = lambda z, *idx: torch.zeros(z.shape[0], dtype=torch.bool)   # noqa: E731
    mine = apgd_single_run(model, images, start, _scripted_losses(losses), never, "linf", 1 / 255, 100)
    ref = _reference_run(model, images, start, _scripted_losses(losses), never, "linf", 1 / 255, 100)
    assert mine.step.tolist() == pytest.approx([expected / 255], rel=1e-6)
    assert ref["step"] == pytest.approx([expected / 255], rel=1e-12)


CASES = [AttackConfig("apgd-ce", "linf", 0.5 / 255, seed=3),
         AttackConfig("apgd-ce", "l2", 0.05, restarts=2, seed=4),
         AttackConfig("apgd-t", "linf", 0.5 / 255, targeted=True, seed=5),
         AttackConfig("apgd-t", "l2", 0.05, seed=6, options={"n_target_classes": 2})]


@pytest.mark.parametrize("config", CASES[:1] + CASES[2:3], ids=lambda c: c.name)
def test_attack_matches_reference_short(model, config):
    images, labels = _batch(model, 4)
    targets = (labels + 1) % 10
    config = dataclasses.replace(config, steps=8, options={**config.options, "early_stop": False})
    mine = make_attack(config).run(model, images, labels, targets if config.targeted else None).adv
    ref = _reference_attack(model, images, labels, config, 8, targets)
    assert _agreement(mine, ref) == 4


@pytest.mark.parametrize("config", CASES[1:2] + CASES[3:4], ids=lambda c: c.name)
def test_attack_with_several_runs_per_image_matches_reference_short(model, config):
    """Several runs per image: 2 restarts (APGD-CE, L2) and 2 target classes of untargeted APGD-T
    (L2). Per image, the first successful iterate over all runs is returned, else the highest-loss
    point over all runs (Algorithm 1's x_max, the best over restarts and targets; module docstring
    of apgd.py). 8 iterations and a small radius fool some images and leave others, and for an
    unfooled one the first run has the higher loss, so "keep the best run" and "keep the last run"
    differ (a mutation keeping the last run's point fails here)."""
    images, labels = _batch(model, 6)
    config = dataclasses.replace(config, steps=8, options={**config.options, "early_stop": False})
    attack = make_attack(config)
    attack.attack_copy = "off"   # the reference queries the model as given: the same rounding
    mine = attack.run(model, images, labels).adv
    runs = []
    ref = _reference_attack(model, images, labels, config, 8, runs_log=runs)
    assert _agreement(mine, ref) == 6
    assert len(runs) == 2   # two runs: 2 restarts x 1 target, or 1 restart x 2 target classes
    fooled = _predict(model, ref) != labels
    assert fooled.any() and not fooled.all()   # both outcomes: first success, and best loss over the runs
    first_run_best = [i for i in (~fooled).nonzero().flatten().tolist() if runs[0][i][0] > runs[1][i][0]]
    assert first_run_best, "for no unfooled image did the first run beat the last one"


@pytest.mark.parametrize("config", CASES, ids=lambda c: c.name)
def test_early_stop_fools_the_same_images(model, config):
    """Images stop costing passes once fooled (the default); every image's iterates are the same
    function as without, so the same images are fooled (the kept points may differ in the float
    rounding of the smaller batches)."""
    images, labels = _batch(model, 16, seed=7)
    targets = (labels + 1) % 10
    config = dataclasses.replace(config, steps=30)
    out = {}
    for early in (True, False):
        c = dataclasses.replace(config, options={**config.options, "early_stop": early})
        adv = make_attack(c).run(model, images, labels, targets if c.targeted else None).adv
        pred = _predict(model, adv)
        out[early] = (pred == targets) if c.targeted else (pred != labels)
    assert torch.equal(out[True], out[False]) and out[True].any()


class _BatchDependent(torch.nn.Module):
    """Two classes; the logits move by 1e-3 when the batch holds one image, as float rounding does
    on a borderline image: image 0 below is misclassified at batch 1 only. Counts its forwards."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def forward(self, x):
        self.sizes.append(len(x))
        z = torch.stack([x.flatten(1).mean(1), torch.full((len(x),), 0.5)], 1)
        return z + torch.tensor([0.0, 1e-3]) * (len(x) == 1)


def test_an_image_fooled_only_in_a_sub_batch_stays_in_play():
    """A run fools image 0 in its sub-batch (image 1 is misclassified already, so not attacked) but
    the whole batch, as the records see it, classifies it correctly: the next restart attacks it
    again, instead of APGD counting it done. Without the whole-batch check restart 2 never runs."""
    images = torch.full((2, 1, 2, 2), 0.5005)   # class 0 by 5e-4 in a batch of two
    images[1] = 0.1
    labels = torch.tensor([0, 0])
    forwards_of_image_0 = {}
    for restarts in (1, 2):   # each run on image 0 stops at its first iterate: one forward of batch 1
        model = _BatchDependent().eval()
        out = make_attack(AttackConfig("apgd-ce", eps=1e-6, steps=2, restarts=restarts)).run(model, images, labels)
        forwards_of_image_0[restarts] = model.sizes.count(1)
        assert _predict(model, out.adv).tolist() == [0, 1]
    assert forwards_of_image_0[2] == forwards_of_image_0[1] + 1


@pytest.mark.slow
@pytest.mark.parametrize("config", CASES, ids=lambda c: c.name)
def test_attack_matches_reference_100_steps(model, config):
    """Default 100 iterations, 16 images: image by image agreement with the Algorithm 1 loop."""
    images, labels = _batch(model, 16, seed=7)
    targets = (labels + 1) % 10
    config = dataclasses.replace(config, options={**config.options, "early_stop": False})
    mine = make_attack(config).run(model, images, labels, targets if config.targeted else None).adv
    ref = _reference_attack(model, images, labels, config, 100, targets)
    agree = _agreement(mine, ref)
    fooled = (_predict(model, mine) != labels).sum().item()
    print(f"{config.name}: {agree}/16 images agree with the reference; {fooled}/16 fooled")
    assert agree == 16
    assert 0 < fooled < 16 or config.targeted   # both outcomes (first success, best loss) are exercised


# ------------------------------------------------------------------ behaviour

@pytest.mark.parametrize("norm,eps", [("linf", 8 / 255), ("l2", 0.5)])
@pytest.mark.parametrize("name", ["apgd-ce", "apgd-t"])
def test_budget_and_unit_range(model, batch, name, norm, eps):
    images, labels = batch
    out = make_attack(AttackConfig(name, norm, eps, steps=5, options={"n_target_classes": 2})).run(model, images, labels)
    assert out.adv.min() >= 0 and out.adv.max() <= 1
    size = _size(out.adv - images, norm)
    assert (size <= eps * (1 + 1e-5)).all()
    assert (size > 0).all()   # every image moved (all start correctly classified)


@pytest.mark.parametrize("norm,eps", [("linf", 1 / 255), ("l2", 0.1)])
@pytest.mark.parametrize("name", ["apgd-ce", "apgd-t"])
def test_beats_random_noise_of_the_same_norm(model, batch, name, norm, eps):
    images, labels = batch
    gen = torch.Generator().manual_seed(11)
    fooled_noise = 0
    for _ in range(4):   # four draws of noise on the sphere of radius eps
        noise = random_start(images, norm, eps, gen) if norm == "l2" else \
            (images + eps * torch.randint(0, 2, images.shape, generator=gen).mul(2).sub(1)).clamp(0, 1)
        fooled_noise = max(fooled_noise, (_predict(model, noise) != labels).sum().item())
    adv = make_attack(AttackConfig(name, norm, eps, steps=20, options={"n_target_classes": 3})).run(
        model, images, labels).adv
    fooled = (_predict(model, adv) != labels).sum().item()
    assert fooled >= fooled_noise + 3, (fooled, fooled_noise)


def test_deterministic_per_seed_and_global_rng_untouched(model, batch):
    images, labels = batch
    config = AttackConfig("apgd-ce", "linf", 1 / 255, steps=5)
    state = torch.get_rng_state()
    first = make_attack(config).run(model, images, labels).adv
    assert torch.equal(torch.get_rng_state(), state)
    again = make_attack(config).run(model, images, labels).adv
    other = make_attack(AttackConfig("apgd-ce", "linf", 1 / 255, steps=5, seed=1)).run(model, images, labels).adv
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_targeted_mode_reaches_the_given_targets(model, batch):
    images, labels = batch
    with torch.no_grad():
        targets = model(images).argsort(1, descending=True)[:, 3]   # the 4th most likely class
    adv = make_attack(AttackConfig("apgd-t", "linf", 16 / 255, targeted=True, steps=20)).run(
        model, images, labels, targets).adv
    hits = (_predict(model, adv) == targets).sum().item()
    untargeted = make_attack(AttackConfig("apgd-ce", "linf", 16 / 255, steps=20)).run(model, images, labels).adv
    by_chance = (_predict(model, untargeted) == targets).sum().item()
    assert hits >= 6 and hits > by_chance, (hits, by_chance)


def test_misclassified_images_are_returned_unchanged(model, batch):
    images, labels = batch
    wrong = labels.clone()
    wrong[:3] = (labels[:3] + 1) % 10   # the model already gets these "wrong"
    for name in ["apgd-ce", "apgd-t"]:
        adv = make_attack(AttackConfig(name, "linf", 1 / 255, steps=3, options={"n_target_classes": 1})).run(
            model, images, wrong).adv
        assert torch.equal(adv[:3], images[:3])
        assert not torch.equal(adv[3:], images[3:])


def test_registered_and_clear_errors(model, batch):
    images, labels = batch
    assert {"apgd-ce", "apgd-t"} <= set(list_attacks())
    with pytest.raises(AttackInputError, match="no targeted mode"):
        make_attack(AttackConfig("apgd-ce", targeted=True))
    with pytest.raises(AttackInputError, match="drop step"):
        make_attack(AttackConfig("apgd-ce", step=1 / 255))
    with pytest.raises(AttackInputError, match="drop schedule"):
        make_attack(AttackConfig("apgd-t", schedule="cosine"))
    with pytest.raises(AttackInputError, match="steps >= 1"):
        make_attack(AttackConfig("apgd-ce", steps=0))
    with pytest.raises(AttackInputError, match="n_target_classes"):
        make_attack(AttackConfig("apgd-t", options={"n_target_classes": 0}))
    with pytest.raises(AttackInputError, match="n_target_classes <= 9"):
        make_attack(AttackConfig("apgd-t", steps=1, options={"n_target_classes": 10})).run(model, images, labels)
    three = _tiny_model(num_classes=3)
    with torch.no_grad():
        y3 = three(images).argmax(1)
    with pytest.raises(AttackInputError, match="at least 4 classes.*use apgd-ce"):
        make_attack(AttackConfig("apgd-t", steps=1)).run(three, images, y3)
    out = make_attack(AttackConfig("apgd-ce", steps=2)).run(three, images, y3)   # CE works with 3 classes
    assert out.adv.shape == images.shape


@pytest.mark.slow
@pytest.mark.parametrize("steps", [100, 10])
@pytest.mark.parametrize("norm,eps", [("linf", 1 / 255), ("l2", 0.1)])
@pytest.mark.parametrize("loss", ["ce", "dlr"])
def test_torchattacks_deviations_are_exactly_the_documented_ones(model, steps, norm, eps, loss):
    """torchattacks' APGD single run from the same start (its global seed and our generator draw
    the same numbers) equals, image by image and bit for bit, the reference with deviations 1-5 of
    the module docstring, while the reference as in the paper (as ours) differs on some images:
    those five are all the logic that separates them."""
    torchattacks = pytest.importorskip("torchattacks")
    images, labels = _batch(model, 32, seed=7)
    ta = torchattacks.APGD(model, norm={"linf": "Linf", "l2": "L2"}[norm], eps=eps, steps=steps, loss=loss)
    state = torch.get_rng_state()
    torch.manual_seed(0)
    ta_best, _, ta_loss, _ = ta.attack_single_run(images, labels)
    torch.set_rng_state(state)
    torch.manual_seed(0)   # torchattacks' start, redrawn: same stream as our generator, its formula
    if norm == "linf":
        u = 2 * torch.rand(images.shape) - 1
        start = (images + eps * torch.ones(32, 1, 1, 1) * u / u.flatten(1).abs().amax(1).view(-1, 1, 1, 1)).clamp(0, 1)
        assert torch.equal(start, random_start(images, norm, eps, torch.Generator().manual_seed(0)))
    else:
        u = torch.randn(images.shape)
        start = (images + eps * torch.ones(32, 1, 1, 1) * u / ((u ** 2).sum(dim=(1, 2, 3), keepdim=True).sqrt()
                                                               + 1e-12)).clamp(0, 1)
        torch.testing.assert_close(start, random_start(images, norm, eps, torch.Generator().manual_seed(0)))
    torch.set_rng_state(state)
    loss_of = (lambda z: F.cross_entropy(z, labels, reduction="none")) if loss == "ce" else \
        (lambda z: dlr_loss(z, labels))
    success_of = lambda z: z.argmax(1) != labels
    args = (model, images, start, loss_of, success_of, norm, eps, steps)
    quirks = _reference_run(*args, torchattacks_logic=True, torchattacks_rounding=True)
    paper = _reference_run(*args, torchattacks_rounding=True)
    ours = apgd_single_run(model, images, start, lambda z, i: loss_of(z), lambda z, i: success_of(z), norm, eps, steps)
    with_quirks, with_paper = _agreement(ta_best, quirks["x_best"]), _agreement(ta_best, paper["x_best"])
    close = _agreement(ta_best, ours.x_best, atol=1e-5)
    print(f"{norm} {loss} N={steps}: torchattacks' x_best equals Algorithm 1 with its deviations on {with_quirks}/32 "
          f"images, Algorithm 1 as in the paper on {with_paper}/32; ours within 1e-5 on {close}/32")
    assert with_quirks == 32
    torch.testing.assert_close(ta_loss, quirks["loss_best"], rtol=0, atol=0)
    assert with_paper < 32


@pytest.mark.parametrize("norm,eps", [("linf", 0.25 / 255), ("l2", 0.05)])   # some images fooled, some not
@pytest.mark.parametrize("stop_on_success", [False, True], ids=["every iterate", "stop on success"])
def test_a_run_resumed_from_any_iterate_it_saved_gives_the_uninterrupted_run(model, batch, norm, eps, stop_on_success):
    """``apgd_single_run`` saves its whole state after every iterate (``save``); resumed from the
    state after iterate 1, after a checkpoint (3, where the step size may halve and the iterate
    restart from the best point) or after the last but one (11 of 12), it ends where the
    uninterrupted run ends, bit for bit: the best points and losses, successes and step sizes."""
    images, labels = batch
    start = random_start(images, norm, eps, torch.Generator().manual_seed(0))
    ce = lambda z, i: F.cross_entropy(z, labels[i], reduction="none")   # noqa: E731
    fooled = lambda z, i: z.argmax(1) != labels[i]   # noqa: E731
    states = []
    whole = apgd_single_run(model, images, start, ce, fooled, norm, eps, 12, stop_on_success=stop_on_success,
                            save=lambda state: states.append(state()))
    assert [s["k"] for s in states] == list(range(1, 12))
    assert 1 <= whole.success.sum() < len(images) and (whole.step < 2 * eps).any()   # successes, halvings
    for state in [s for s in states if s["k"] in (1, 3, 11)]:
        again = apgd_single_run(model, images, None, ce, fooled, norm, eps, 12, stop_on_success=stop_on_success,
                                resume=state)
        for name in ("x_best", "loss_best", "success", "x_success", "step"):
            assert torch.equal(getattr(again, name), getattr(whole, name)), (state["k"], name)
