"""The registered evaluation attack "pgd" (L-inf / L2 PGD of Madry et al. 2018)."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from robust_attn.attacks import PGDConfig, draw_targets, targeted_pgd
from robust_attn.attacks.base import AttackConfig, AttackInputError, list_attacks, make_attack
from robust_attn.attacks.pgd_lp import PGD, step_sizes
from robust_attn.models.wrapper import NormalizedModel

from helpers import tiny_resnet
EPS = {"linf": 8 / 255, "l2": 0.5}


def _tiny_model(seed: int = 1) -> NormalizedModel:
    return tiny_resnet(seed, stem_downsample=4)


@pytest.fixture(scope="module")
def model():
    return _tiny_model()


@pytest.fixture(scope="module")
def batch(model):
    images = torch.rand(8, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    images[0, :, :4] = 0.0  # pixels on the [0, 1] boundary exercise the clamp
    images[1, :, :4] = 1.0
    with torch.no_grad():
        labels = model(images).argmax(1)
    return images, labels, torch.as_tensor(draw_targets(labels, 10, seed=0)).long()


def _pgd(norm="linf", targeted=False, **kw) -> PGD:
    return make_attack(AttackConfig("pgd", norm=norm, eps=kw.pop("eps", EPS[norm]), targeted=targeted, **kw))


def _fooled(model, adv, labels, targets=None) -> torch.Tensor:
    with torch.no_grad():
        pred = model(adv).argmax(1)
    return pred != labels if targets is None else pred == targets


# ---------------------------------------------------------------- registry, errors, schedules


def test_registered_under_pgd():
    assert "pgd" in list_attacks()
    attack = make_attack(AttackConfig("pgd", eps=8 / 255))
    assert isinstance(attack, PGD)
    assert attack.steps == 10 and attack.step == pytest.approx(2.5 * (8 / 255) / 10)  # the documented defaults
    assert make_attack(AttackConfig("pgd", eps=4 / 255, steps=4, step=1 / 255)).step == pytest.approx(1 / 255)


def test_clear_errors():
    with pytest.raises(AttackInputError, match="above 1.*8/255"):
        AttackConfig("pgd", norm="linf", eps=8)
    with pytest.raises(AttackInputError, match="unknown step schedule 'linear'.*constant"):
        AttackConfig("pgd", schedule="linear")
    with pytest.raises(AttackInputError, match="no option.*randomstart.*random_start"):
        make_attack(AttackConfig("pgd", options={"randomstart": False}))
    with pytest.raises(AttackInputError, match="keep must be one of success, last"):
        make_attack(AttackConfig("pgd", options={"keep": "best"}))
    with pytest.raises(AttackInputError, match="random_start must be True or False"):
        make_attack(AttackConfig("pgd", options={"random_start": "no"}))
    with pytest.raises(AttackInputError, match="unknown step schedule"):
        step_sizes(0.1, 4, "linear")


def test_step_schedules():
    a = 0.1
    assert step_sizes(a, 5, "constant") == [a] * 5
    cos = step_sizes(a, 8, "cosine")
    assert cos[0] == a and all(x > y > 0 for x, y in zip(cos, cos[1:]))
    assert cos[4] == pytest.approx(a / 2)  # half-way down at half the steps
    assert step_sizes(a, 8, "step") == pytest.approx([a] * 4 + [a / 10] * 2 + [a / 100] * 2)


# ---------------------------------------------------------------- against references


def _reference_targeted_linf(model, x0, targets, eps, step, steps):
    """Plain targeted L-inf PGD from x0, last iterate; clamps in the other order (they commute in
    real arithmetic: intersecting intervals)."""
    x = x0.clone()
    for _ in range(steps):
        x = x.detach().requires_grad_(True)
        loss = F.cross_entropy(model(x), targets, reduction="sum")
        (g,) = torch.autograd.grad(loss, x)
        x = torch.clamp(x.detach() - step * g.sign(), 0.0, 1.0)
        x = torch.minimum(torch.maximum(x, x0 - eps), x0 + eps)
    return x.detach()


def test_targeted_linf_equals_reference_loop_and_san_pgd(model, batch):
    images, labels, targets = batch
    attack = _pgd("linf", targeted=True, steps=4, step=2 / 255,
                  options={"random_start": False, "keep": "last"})
    ours = attack.run(model, images, labels, targets).adv
    ref = _reference_targeted_linf(model, images, targets, 8 / 255, 2 / 255, 4)
    assert (ours - ref).abs().max().item() <= 1e-6
    # The SAN Table 10 attack {8, 2, 4} in its exact mode takes the very same steps.
    san = targeted_pgd(model, images, targets, PGDConfig(8, 2, 4), exact=True)
    assert torch.equal(ours, san)
    assert (ours - images).abs().amax().item() == pytest.approx(8 / 255, abs=1e-6)


def test_keep_success_never_loses_an_image_the_last_iterate_had(model, batch):
    """keep="success" returns the first fooling iterate: every image fooled by plain PGD's last
    iterate (same start, same steps) is fooled, and so is every image fooled at some iterate."""
    images, labels, _ = batch
    common = dict(steps=6, step=2 / 255, options={"random_start": False})
    last = make_attack(AttackConfig("pgd", eps=4 / 255, **{**common, "options": {"random_start": False,
                                                                                    "keep": "last"}}))
    first = make_attack(AttackConfig("pgd", eps=4 / 255, **common))
    adv_last, adv_first = last.run(model, images, labels).adv, first.run(model, images, labels).adv
    fooled_last, fooled_first = _fooled(model, adv_last, labels), _fooled(model, adv_first, labels)
    assert (fooled_first | ~fooled_last).all()
    assert fooled_first.any()
    # Images never fooled are returned as the last iterate, identical under both rules.
    never = ~fooled_first
    assert torch.equal(adv_first[never], adv_last[never])


def test_l2_untargeted_agrees_with_torchattacks(model, batch):
    """torchattacks' PGDL2 (random_start=False): same update (normalised-gradient step, scale onto the
    ball, clip). Agreement to float tolerance, not bits: it normalises g by ||g|| + 1e-10 and
    differentiates the mean loss (a 1/N scale that the normalisation removes up to rounding)."""
    import torchattacks

    images, labels, _ = batch
    eps, step, steps = 0.5, 0.1, 8
    theirs = torchattacks.PGDL2(model, eps=eps, alpha=step, steps=steps, random_start=False)(images, labels)
    ours = _pgd("l2", eps=eps, steps=steps, step=step, options={"random_start": False, "keep": "last"})
    adv = ours.run(model, images, labels).adv
    assert (adv - theirs).abs().max().item() <= 1e-5
    assert torch.equal(_fooled(model, adv, labels), _fooled(model, theirs, labels))
    norms = (adv - images).flatten(1).norm(dim=1)  # on the sphere, less where [0, 1] clipping cut a corner
    assert norms.max().item() <= eps * (1 + 1e-5) and norms.min().item() > 0.9 * eps


# ---------------------------------------------------------------- budget and strength


@pytest.mark.parametrize("norm", ["linf", "l2"])
@pytest.mark.parametrize("targeted", [False, True])
@pytest.mark.parametrize("schedule", ["constant", "cosine", "step"])
def test_budget_and_unit_range(model, batch, norm, targeted, schedule):
    images, labels, targets = batch
    attack = _pgd(norm, targeted=targeted, steps=3, restarts=2, schedule=schedule, step=3 * EPS[norm])
    adv = attack.run(model, images, labels, targets if targeted else None).adv
    delta = (adv - images).flatten(1)
    size = delta.abs().amax(1) if norm == "linf" else delta.norm(dim=1)
    assert (size <= EPS[norm] * (1 + 1e-5) + 1e-7).all()
    assert adv.min() >= 0 and adv.max() <= 1
    assert (size > 0.5 * EPS[norm]).all()  # the big steps reach the ball's edge


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_beats_random_noise_of_the_same_norm(model, norm):
    images = torch.rand(32, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        labels = model(images).argmax(1)
    eps = 8 / 255 if norm == "linf" else 0.25
    gen = torch.Generator().manual_seed(5)
    if norm == "linf":  # corners of the cube: the largest noise the budget allows
        noise = eps * (torch.randint(0, 2, images.shape, generator=gen) * 2 - 1)
    else:
        noise = torch.randn(images.shape, generator=gen)
        noise = eps * noise / noise.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
    noise_rate = _fooled(model, (images + noise).clamp(0, 1), labels).float().mean().item()
    adv = _pgd(norm, eps=eps, steps=5).run(model, images, labels).adv
    attack_rate = _fooled(model, adv, labels).float().mean().item()
    assert attack_rate > noise_rate + 0.25, (attack_rate, noise_rate)


def test_more_restarts_never_lower_success(model):
    images = torch.rand(16, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        labels = model(images).argmax(1)
    """Restart 1 is the same draw whatever the count (one seeded generator), and the strongest
    restart is kept per image: fooled stays fooled, and an image fooled by none keeps the
    highest loss found."""
    eps = 1 / 255
    fooled, loss = {}, {}
    for r in (1, 2, 4):
        adv = _pgd("linf", eps=eps, steps=2, restarts=r, seed=3).run(model, images, labels).adv
        fooled[r] = _fooled(model, adv, labels)
        with torch.no_grad():
            loss[r] = F.cross_entropy(model(adv), labels, reduction="none")
    assert (fooled[2] | ~fooled[1]).all() and (fooled[4] | ~fooled[2]).all()  # per image, not only on average
    assert 0 < fooled[1].sum() < len(images)  # a budget where restarts can still help
    assert fooled[4].sum() > fooled[1].sum()
    neither = ~fooled[4]
    assert (loss[4][neither] >= loss[1][neither] - 1e-6).all()


def test_seeded_and_independent_of_global_rng(model, batch):
    images, labels, _ = batch
    attack = _pgd("l2", steps=2, seed=11)
    torch.manual_seed(0)
    a = attack.run(model, images, labels).adv
    torch.manual_seed(123)
    state = torch.get_rng_state()
    b = attack.run(model, images, labels).adv
    assert torch.equal(a, b)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG was not drawn from
    c = _pgd("l2", steps=2, seed=12).run(model, images, labels).adv
    assert not torch.equal(a, c)
    # Without a random start the seed does not matter.
    d1 = _pgd("linf", steps=2, seed=1, options={"random_start": False}).run(model, images, labels).adv
    d2 = _pgd("linf", steps=2, seed=2, options={"random_start": False}).run(model, images, labels).adv
    assert torch.equal(d1, d2)


def test_per_image_result_does_not_depend_on_the_batch(model, batch):
    """Summed loss: an image's gradient is the same alone or in a batch (up to kernel rounding)."""
    images, labels, _ = batch
    attack = _pgd("l2", steps=3, options={"random_start": False})
    whole = attack.run(model, images, labels).adv
    alone = torch.cat([attack.run(model, images[i:i + 1], labels[i:i + 1]).adv for i in range(len(images))])
    assert (whole - alone).abs().max().item() <= 1e-4


def test_model_left_as_it_was(model, batch):
    images, labels, targets = batch
    grads = [p.requires_grad for p in model.parameters()]
    _pgd("linf", targeted=True, steps=1).run(model, images, labels, targets)
    assert [p.requires_grad for p in model.parameters()] == grads
    assert all(p.grad is None for p in model.parameters())
    assert not model.training
