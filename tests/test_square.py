"""Square Attack (robust_attn/attacks/square.py): budget, randomness, query counts, the p schedule
of the paper, the accept-only-improvements invariant, and clear errors."""
from fractions import Fraction

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import robust_attn.attacks.square as square_module
from robust_attn.attacks.base import AttackConfig, AttackInputError, make_attack
from robust_attn.attacks.square import (P_INIT, Square, _margin, _rectangle, eta_pattern, p_schedule, square_run,
                                        square_side)
from robust_attn.models.registry import create_model
from robust_attn.models.wrapper import NormalizedModel
from helpers import LeadingLinear

EPS = {"linf": 8 / 255, "l2": 0.5}


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    net = create_model("resnet26", num_classes=10, resolution="cifar", width=0.25, stem_downsample=4)
    return NormalizedModel(net, (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)).eval()


@pytest.fixture(scope="module")
def setup():
    model = tiny_model()
    images = torch.rand(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        labels = model(images).argmax(1)      # all correctly classified by construction
    return model, images, labels


def run(model, images, labels, norm="linf", **kw):
    kw.setdefault("queries", 40)
    return make_attack(AttackConfig("square", norm=norm, eps=EPS[norm], **kw)).run(model, images, labels)


def sizes(delta, norm):
    flat = delta.flatten(1)
    return flat.abs().amax(1) if norm == "linf" else flat.norm(dim=1)


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_budget_and_box(setup, norm):
    model, images, labels = setup
    out = run(model, images, labels, norm)
    assert out.adv.min() >= 0 and out.adv.max() <= 1
    assert (sizes(out.adv - images, norm) <= EPS[norm] * (1 + 1e-5)).all()
    assert out.queries.shape == (len(images),) and out.queries.dtype == torch.long


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_beats_random_noise_of_the_same_norm(setup, norm):
    # this untrained model's margins move little under L2 noise: a larger radius and budget for L2
    model, images, labels = setup
    eps = {"linf": 8 / 255, "l2": 1.0}[norm]
    out = make_attack(AttackConfig("square", norm=norm, eps=eps, queries=100 if norm == "linf" else 200)).run(
        model, images, labels)
    g = torch.Generator().manual_seed(5)
    if norm == "linf":
        noise = eps * (torch.randint(0, 2, images.shape, generator=g) * 2 - 1).float()
    else:
        noise = torch.randn(images.shape, generator=g)
        noise = eps * noise / noise.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
    with torch.no_grad():
        m_square = _margin(model(out.adv), labels)
        m_noise = _margin(model((images + noise).clamp(0, 1)), labels)
    assert (m_square < 0).sum() >= (m_noise < 0).sum()
    assert (m_square < m_noise).float().mean() >= 0.75
    assert m_square.mean() < m_noise.mean()


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_deterministic_and_independent_of_global_rng(setup, norm):
    model, images, labels = setup
    torch.manual_seed(123)
    torch.rand(7)
    state = torch.get_rng_state()
    a = run(model, images, labels, norm, seed=3)
    assert torch.equal(torch.get_rng_state(), state), "the attack used or reseeded the global RNG"
    torch.manual_seed(999)
    b = run(model, images, labels, norm, seed=3)
    assert torch.equal(a.adv, b.adv) and torch.equal(a.queries, b.queries)
    c = run(model, images, labels, norm, seed=4)
    assert not torch.equal(a.adv, c.adv), "the seed changes nothing"


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_queries(setup, norm):
    model, images, labels = setup
    labels = labels.clone()
    labels[0] = (labels[0] + 1) % 10          # image 0 is already misclassified
    budget = 30
    one = run(model, images, labels, norm, queries=budget, seed=1)
    two = run(model, images, labels, norm, queries=budget, seed=1, restarts=2)
    with torch.no_grad():
        fooled1 = model(one.adv).argmax(1) != labels
        fooled2 = model(two.adv).argmax(1) != labels
    assert one.queries[0] == 1 and torch.equal(one.adv[0], images[0])
    assert (one.queries >= 1).all() and (one.queries <= 1 + budget).all()
    assert (two.queries <= 1 + 2 * budget).all()
    # fooled images stop at the query that fooled them; the others spend the whole budget
    assert (one.queries[fooled1] <= 1 + budget).all() and (one.queries[~fooled1] == 1 + budget).all()
    assert (two.queries[~fooled2] == 1 + 2 * budget).all()
    assert fooled1[1:].any() and (~fooled1).any(), "pick a setting where some but not all images are fooled"
    # the first restart is the same run: an image fooled there keeps its queries and its image
    assert torch.equal(two.queries[fooled1], one.queries[fooled1])
    assert torch.equal(two.adv[fooled1], one.adv[fooled1])
    assert (two.queries[fooled2 & ~fooled1] > 1 + budget).all()


def test_queries_count_model_calls(setup):
    """The reported count equals the forward passes each image actually went through."""
    model, images, labels = setup
    seen = torch.zeros(len(images), dtype=torch.long)

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            assert not torch.is_grad_enabled(), "square must query the model without gradients"
            # each query is within eps of its clean image and far from the others
            d = (x[:, None] - images[None]).flatten(2).abs().amax(2)
            for i in d.argmin(1).tolist():
                seen[i] += 1
            return self.inner(x)

    counting = Counting().eval()
    attack = make_attack(AttackConfig("square", queries=25, seed=0))
    out = attack._run(counting, images, labels, None)     # _run: without run()'s input check
    assert Square.gradient_free
    assert torch.equal(out.queries, seen)
    assert (seen > 1).all()


def test_p_schedule_is_the_papers():
    # the paper's schedule for a 10000-query run: p_init on iterations 0..10, then halved after
    # 10, 50, 200, 500, 1000, 2000, 4000, 6000, 8000; other budgets are rescaled to 10000
    table = [(0, 10, 1), (11, 50, 2), (51, 200, 4), (201, 500, 8), (501, 1000, 16), (1001, 2000, 32),
             (2001, 4000, 64), (4001, 6000, 128), (6001, 8000, 256), (8001, 10 ** 9, 512)]

    def reference(it, budget):
        i = int(Fraction(it, budget) * 10000)
        return next(P_INIT / div for lo, hi, div in table if lo <= i <= hi)

    for budget in (10000, 5000, 1000, 37, 1):
        for it in range(budget):
            assert p_schedule(P_INIT, it, budget) == reference(it, budget), (it, budget)
    assert p_schedule(0.8, 10, 10000) == 0.8 and p_schedule(0.8, 11, 10000) == 0.4
    assert p_schedule(0.8, 5, 5000) == 0.8 and p_schedule(0.8, 6, 5000) == 0.4   # 6 -> 12 of 10000


def test_square_side():
    assert square_side(0.8, 32, 32, "linf") == 29          # round(sqrt(0.8 * 1024)) = round(28.6)
    assert square_side(0.8 / 512, 32, 32, "linf") == 1
    assert square_side(0.8 / 512, 32, 32, "l2") == 3
    assert square_side(0.2, 32, 32, "l2") == 15             # round(14.3) = 14, made odd
    assert square_side(1.0, 8, 8, "l2") == 7 and square_side(1.0, 8, 8, "linf") == 8


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_accepts_only_improving_updates(setup, norm):
    """Algorithm 1 keeps x_new only if its loss is lower: the margin of the kept point never
    increases, and the stored loss is the margin of the stored point."""
    model, images, labels = setup
    gen = torch.Generator().manual_seed(0)
    active = torch.ones(len(images), dtype=torch.bool)
    with torch.no_grad():
        res = square_run(model, images, active, lambda z, i: _margin(z, labels[i]),
                         lambda z, i: z.argmax(1) != labels[i], norm, EPS[norm], 60, P_INIT, gen, record=True)
        history = torch.stack(res.history)
        assert history.shape == (60, len(images))
        assert (history[1:] <= history[:-1]).all()
        assert (history[-1] < history[0]).any(), "no update was ever accepted"
        torch.testing.assert_close(_margin(model(res.x_best), labels), res.loss, rtol=1e-5, atol=1e-5)
    assert (sizes(res.x_best - images, norm) <= EPS[norm] * (1 + 1e-5)).all()


def test_l2_update_keeps_the_norm_at_eps(setup):
    """Algorithm 3 redistributes the budget: before clipping the perturbation has norm eps."""
    model, images, labels = setup
    gen = torch.Generator().manual_seed(0)
    mid = 0.25 + 0.5 * images                         # away from the box: no clipping at eps = 0.5
    with torch.no_grad():
        y = model(mid).argmax(1)
        res = square_run(model, mid, torch.ones(len(mid), dtype=torch.bool), lambda z, i: _margin(z, y[i]),
                         lambda z, i: torch.zeros(len(i), dtype=torch.bool), "l2", 0.5, 30, P_INIT, gen)
    torch.testing.assert_close(sizes(res.x_best - mid, "l2"), torch.full((len(mid),), 0.5), rtol=1e-4, atol=0)


def test_targeted_uses_cross_entropy_and_hits_the_target(setup):
    model, images, labels = setup
    with torch.no_grad():
        targets = model(images).argsort(1, descending=True)[:, 1]     # the most likely wrong class
    out = make_attack(AttackConfig("square", eps=16 / 255, targeted=True, queries=150, seed=0)).run(
        model, images, labels, targets)
    with torch.no_grad():
        pred = model(out.adv).argmax(1)
    hit = pred == targets
    assert hit.any()
    assert (out.queries[~hit] == 151).all() and (out.queries[hit] <= 151).all()
    gen = torch.Generator().manual_seed(0)
    ce = lambda z, i: nn.functional.cross_entropy(z, targets[i], reduction="none")   # noqa: E731
    with torch.no_grad():
        res = square_run(model, images, torch.ones(len(images), dtype=torch.bool), ce,
                         lambda z, i: torch.zeros(len(i), dtype=torch.bool), "linf", 8 / 255, 40, P_INIT, gen,
                         record=True)
    history = torch.stack(res.history)
    assert (history[1:] <= history[:-1]).all()


def test_clear_errors(setup):
    model, images, labels = setup
    with pytest.raises(AttackInputError, match="queries >= 1"):
        make_attack(AttackConfig("square", queries=0))
    with pytest.raises(AttackInputError, match="non-negative int"):
        AttackConfig("square", queries=-5)
    with pytest.raises(AttackInputError, match="non-negative int"):
        AttackConfig("square", queries=10.5)
    with pytest.raises(AttackInputError, match="p_init"):
        make_attack(AttackConfig("square", options={"p_init": 1.5}))
    with pytest.raises(AttackInputError, match="drop step"):
        make_attack(AttackConfig("square", step=0.01))
    with pytest.raises(AttackInputError, match="at least 5 x 5"):
        make_attack(AttackConfig("square", norm="l2", eps=0.5, queries=3)).run(model, images[:, :, :4, :4], labels)
    with pytest.raises(AttackInputError, match="needs targets"):
        make_attack(AttackConfig("square", targeted=True, queries=3)).run(model, images, labels)


# ------------------------------------------------------------------ targeted loss, eta, init, restarts

def _spy_on_square_run(monkeypatch):
    """Replace ``square_run`` as Square calls it by a wrapper that records its arguments and results."""
    calls = []
    real = square_module.square_run

    def spy(model, images, active, loss_fn, success_fn, *args, **kwargs):
        res = real(model, images, active, loss_fn, success_fn, *args, **kwargs)
        calls.append({"active": active.clone(), "loss_fn": loss_fn, "success_fn": success_fn,
                      "x_best": res.x_best.clone(), "loss": res.loss.clone(), "success": res.success.clone()})
        return res
    monkeypatch.setattr(square_module, "square_run", spy)
    return calls


def test_targeted_loss_is_the_cross_entropy_of_the_target_class(setup, monkeypatch):
    """Algorithm 1's loss in targeted mode is the cross-entropy of the target class, as the paper's
    targeted experiments (and the official code) use, not torchattacks' default margin of the
    target (deviation 5 of the module docstring); untargeted it is the margin z_y - max_{j != y} z_j.
    The loss Square hands to its runs is evaluated on logits written by hand."""
    model, images, labels = setup
    calls = _spy_on_square_run(monkeypatch)
    targets = (labels + 1) % 10
    make_attack(AttackConfig("square", eps=1 / 255, targeted=True, queries=2, seed=0)).run(
        model, images, labels, targets)
    make_attack(AttackConfig("square", eps=1 / 255, queries=2, seed=0)).run(model, images, labels)
    assert len(calls) == 2
    z = torch.tensor([[2.0, 0.5, -1.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
                      [0.0, 4.0, 1.0, 1.0, 0.0, -2.0, 0.0, 0.0, 0.5, 0.0]])
    idx = torch.tensor([2, 5])   # the logits of images 2 and 5 of the batch
    targeted, untargeted = calls
    expected = F.cross_entropy(z, targets[idx], reduction="none")
    torch.testing.assert_close(targeted["loss_fn"](z, idx), expected)
    # the two rules differ on these logits: the margin of the target would not pass
    assert not torch.allclose(-_margin(z, targets[idx]), expected)
    assert torch.equal(targeted["success_fn"](z, idx), z.argmax(1) == targets[idx])
    y = labels[idx]
    by_hand = torch.stack([z[i, y[i]] - torch.cat([z[i, :y[i]], z[i, y[i] + 1:]]).max() for i in range(2)])
    torch.testing.assert_close(untargeted["loss_fn"](z, idx), by_hand)
    assert torch.equal(untargeted["success_fn"](z, idx), z.argmax(1) != y)


def test_margin_is_the_label_logit_minus_the_largest_other_logit():
    """The untargeted loss ``z_y - max_{j != y} z_j`` on logits written by hand, also where every
    other logit is negative (a margin that let the label's own slot, or a zero, into the max would
    differ there) and where the image is already misclassified (negative margin)."""
    z = torch.tensor([[-1.0, -3.0, -0.5, -2.0],
                      [2.0, -4.0, -1.0, -1.5],
                      [0.5, 1.5, 1.0, 0.25]])
    y = torch.tensor([1, 0, 2])
    torch.testing.assert_close(_margin(z, y), torch.tensor([-3.0 + 0.5, 2.0 + 1.0, 1.0 - 1.5]))


def _paper_eta_rectangle(h1: int, h2: int, n: int) -> torch.Tensor:
    """Square Attack, section 3.2 (L2): eta^(h1,h2)_{r,s} = sum_{k=0}^{M(r,s)} 1 / (n + 1 - k)^2 with
    M(r,s) = n - max(|r - floor(h1/2) - 1|, |s - floor(h2/2) - 1|), r, s counted from 1."""
    out = torch.zeros(h1, h2, dtype=torch.float64)
    for r in range(1, h1 + 1):
        for s in range(1, h2 + 1):
            m = n - max(abs(r - h1 // 2 - 1), abs(s - h2 // 2 - 1))
            out[r - 1, s - 1] = sum(1.0 / (n + 1 - k) ** 2 for k in range(m + 1))
    return out


def test_eta_rectangle_by_hand():
    """eta_r of a 2 x 5 and a 3 x 5 rectangle (the halves of eta for s = 5, n = floor(5/2) = 2): at
    Chebyshev distance d from the centre, sum_{k=d+1}^{3} 1/k^2: d = 0: 49/36, d = 1: 13/36, d = 2: 4/36."""
    top = torch.tensor([[4, 13, 13, 13, 4],
                        [4, 13, 49, 13, 4]], dtype=torch.float64)
    bottom = torch.tensor([[4, 13, 13, 13, 4],
                           [4, 13, 49, 13, 4],
                           [4, 13, 13, 13, 4]], dtype=torch.float64)
    for rows, expected in ((2, top), (3, bottom)):
        got = _rectangle(rows, 5, torch.float64, None)
        torch.testing.assert_close(got, expected / expected.norm(), rtol=1e-12, atol=0)   # unit L2 norm
        torch.testing.assert_close(expected / 36, _paper_eta_rectangle(5, rows, 2).t(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("s", [3, 5, 6, 7, 15])
def test_eta_pattern_is_eq_4(s):
    """eta (eq. 4, Algorithm 3) of side s: two rectangles (eta^(s,k), -eta^(s,s-k)), k = floor(s/2),
    n = floor(s/2), opposite in sign; unit L2 norm (drawn as here, or transposed, with probability
    1/2). As in the authors' code (``eta_rectangles``), each rectangle is normalised before the
    whole: the halves carry equal energy. Here the rectangles are stacked along rows (the paper's
    transposed; the random transpose makes both orientations equally likely)."""
    k, n = s // 2, s // 2
    eta = eta_pattern(s, torch.float64)
    assert eta.shape == (s, s)
    torch.testing.assert_close(eta.norm(), torch.tensor(1.0, dtype=torch.float64), rtol=1e-12, atol=0)
    top, bottom = eta[:k], eta[k:]
    assert (top > 0).all() and (bottom < 0).all()
    r1, r2 = _paper_eta_rectangle(s, k, n).t(), _paper_eta_rectangle(s, s - k, n).t()
    torch.testing.assert_close(top, r1 / r1.norm() / 2 ** 0.5, rtol=1e-12, atol=0)
    torch.testing.assert_close(bottom, -r2 / r2.norm() / 2 ** 0.5, rtol=1e-12, atol=0)
    # the peak is at each rectangle's centre, and the values fall off with the distance from it
    assert top[k // 2, s // 2] == top.max() and bottom[(s - k) // 2, s // 2] == bottom.min()
    assert top[k // 2, 0] < top[k // 2, s // 2]


def test_linf_initialization_is_vertical_stripes():
    """Algorithm 2's init: x + eps * rho, one sign rho in {-1, 1} per image, channel and column
    (vertical stripes of width one). On interior images (no clipping) the start's perturbation is
    +-eps everywhere and constant down each column; columns and channels get their own signs."""
    n, c, h, w = 4, 3, 8, 8
    images = 0.25 + 0.5 * torch.rand(n, c, h, w, generator=torch.Generator().manual_seed(3))
    eps = 8 / 255
    linear = nn.Linear(c * h * w, 5)

    class Flat(nn.Module):
        def forward(self, x):
            return linear(x.flatten(1))

    with torch.no_grad():
        res = square_run(Flat().eval(), images, torch.ones(n, dtype=torch.bool),
                         lambda z, i: z[:, 0], lambda z, i: torch.zeros(len(i), dtype=torch.bool),
                         "linf", eps, 1, P_INIT, torch.Generator().manual_seed(0))   # budget 1: the init only
    delta = res.x_best - images
    torch.testing.assert_close(delta.abs(), torch.full_like(delta, eps), rtol=1e-5, atol=0)
    sign = delta.sign()
    assert torch.equal(sign, sign[:, :, :1, :].expand_as(sign)), "the sign changes down a column"
    assert (sign[:, :, 0, :] > 0).any() and (sign[:, :, 0, :] < 0).any()
    assert not torch.equal(sign[:, 0], sign[:, 1]), "channels share their stripes"


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_restarts_keep_the_lowest_loss_point_of_images_never_fooled(norm, monkeypatch):
    """Over restarts (module docstring), an image never fooled gets the lowest-loss point over all
    restarts, not the last restart's: its returned margin is the minimum of the restarts' losses
    and the image is the x_best of the restart that reached it."""
    model = LeadingLinear(seed=4, lead=60.0).eval()   # unfooled at 8/255; its margin moves with every pixel
    images = 0.25 + 0.5 * torch.rand(8, 3, 8, 8, generator=torch.Generator().manual_seed(6))
    labels = torch.zeros(8, dtype=torch.long)
    calls = _spy_on_square_run(monkeypatch)
    out = make_attack(AttackConfig("square", norm=norm, eps=EPS[norm], queries=6, restarts=3, seed=2)).run(
        model, images, labels)
    assert len(calls) == 3 and not any(call["success"].any() for call in calls)
    losses = torch.stack([call["loss"] for call in calls])   # (restarts, images)
    best = losses.argmin(0)
    assert (best < 2).any(), "the last restart is the best for every image: the rule is not exercised"
    with torch.no_grad():
        margin = _margin(model(out.adv), labels)
    torch.testing.assert_close(margin, losses.min(0).values, rtol=1e-5, atol=1e-5)
    for i in range(8):
        assert torch.equal(out.adv[i], calls[best[i]]["x_best"][i]), i
    assert (out.queries == 1 + 3 * 6).all()
