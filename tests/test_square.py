"""Square Attack (robust_attn/attacks/square.py): budget, randomness, query counts, the p schedule
of the paper, the accept-only-improvements invariant, and clear errors."""
from fractions import Fraction

import pytest
import torch
import torch.nn as nn

from robust_attn.attacks.base import AttackConfig, AttackInputError, make_attack
from robust_attn.attacks.square import P_INIT, Square, _margin, p_schedule, square_run, square_side
from robust_attn.registry import create_model
from robust_attn.wrapper import NormalizedModel

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
