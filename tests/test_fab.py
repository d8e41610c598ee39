"""FAB-T (robust_attn/attacks/fab.py): the minimal distance to a linear model's boundary (closed
form), the eps filter, budget, randomness and clear errors."""
import pytest
import torch
import torch.nn as nn

from robust_attn.attacks.base import AttackConfig, AttackInputError, make_attack
from robust_attn.attacks.fab import multi_targeted
from robust_attn.models.registry import create_model
from robust_attn.models.wrapper import NormalizedModel

K, SHAPE = 10, (3, 8, 8)


@pytest.fixture(scope="module")
def linear():
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(3 * 8 * 8, K)
    with torch.no_grad():
        layer.weight.copy_(0.1 * torch.randn(K, 3 * 8 * 8, generator=g))
        layer.bias.copy_(0.1 * torch.randn(K, generator=g))
    model = nn.Sequential(nn.Flatten(), layer).eval()
    images = 0.4 + 0.2 * torch.rand(6, *SHAPE, generator=g)      # interior: the box is not active
    with torch.no_grad():
        labels = model(images).argmax(1)
    return model, layer, images, labels


def closed_form(layer, images, labels, norm):
    """min over j != y of |(w_y - w_j).x + b_y - b_j| / ||w_y - w_j||_* (dual norm: L2 -> L2, L-inf -> L1),
    and the minimizing perturbation, to check that it stays in the box."""
    w, b = layer.weight.detach(), layer.bias.detach()
    x = images.flatten(1)
    dist, steps = [], []
    for i in range(len(x)):
        best = (float("inf"), None)
        for j in range(K):
            if j == labels[i]:
                continue
            u = w[labels[i]] - w[j]
            f = (u @ x[i] + b[labels[i]] - b[j]).item()
            if norm == "l2":
                d, step = f / u.norm().item(), -f * u / u.norm() ** 2
            else:
                d, step = f / u.abs().sum().item(), -f / u.abs().sum() * u.sign()
            best = min(best, (d, step), key=lambda t: t[0])
        dist.append(best[0])
        steps.append(best[1])
    return torch.tensor(dist), torch.stack(steps)


def sizes(delta, norm):
    flat = delta.flatten(1)
    return flat.abs().amax(1) if norm == "linf" else flat.norm(dim=1)


@pytest.mark.parametrize("norm,eps", [("l2", 3.0), ("linf", 0.1)])
def test_minimal_distance_to_a_linear_boundary(linear, norm, eps):
    model, layer, images, labels = linear
    dist, step = closed_form(layer, images, labels, norm)
    x = images.flatten(1)
    assert ((x + step) >= 0).all() and ((x + step) <= 1).all() and (dist < eps).all(), "reference invalid"
    out = make_attack(AttackConfig("fab-t", norm=norm, eps=eps)).run(model, images, labels)
    with torch.no_grad():
        assert (model(out.adv).argmax(1) != labels).all()
    found = sizes(out.adv - images, norm)
    assert (found >= dist * (1 - 1e-4)).all(), "an adversarial closer than the minimal distance: reference wrong"
    assert (found <= dist * 1.02).all(), (found / dist)


def test_returns_the_clean_image_beyond_eps(linear):
    model, layer, images, labels = linear
    dist, _ = closed_form(layer, images, labels, "l2")
    eps = dist.median().item()
    out = make_attack(AttackConfig("fab-t", norm="l2", eps=eps)).run(model, images, labels)
    far = dist > eps
    assert far.any() and (~far).any()
    assert torch.equal(out.adv[far], images[far])           # no adversarial exists within eps there
    assert (sizes(out.adv - images, "l2") <= eps * (1 + 1e-6)).all()
    near = dist * 1.02 < eps
    with torch.no_grad():
        assert (model(out.adv[near]).argmax(1) != labels[near]).all()


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    net = create_model("resnet26", num_classes=10, resolution="cifar", width=0.25, stem_downsample=4)
    model = NormalizedModel(net, (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)).eval()
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        labels = model(images).argmax(1)
    return model, images, labels


def fab(norm, **kw):
    eps = {"linf": 8 / 255, "l2": 0.5}[norm]
    kw.setdefault("steps", 10)
    return make_attack(AttackConfig("fab-t", norm=norm, eps=eps, options={"n_target_classes": 2}, **kw)), eps


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_budget_and_beats_noise(tiny, norm):
    model, images, labels = tiny
    attack, eps = fab(norm)
    out = attack.run(model, images, labels)
    assert out.adv.min() >= 0 and out.adv.max() <= 1
    assert (sizes(out.adv - images, norm) <= eps * (1 + 1e-5)).all()
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(images.shape, generator=g)
    noise = eps * (noise.sign() if norm == "linf" else noise / noise.flatten(1).norm(dim=1).view(-1, 1, 1, 1))
    with torch.no_grad():
        fooled = (model(out.adv).argmax(1) != labels).sum()
        fooled_noise = (model((images + noise).clamp(0, 1)).argmax(1) != labels).sum()
    assert fooled > fooled_noise


def test_deterministic_and_independent_of_global_rng(tiny):
    model, images, labels = tiny
    attack, _ = fab("l2", restarts=2, steps=3)      # the second restart starts at a random point
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = attack.run(model, images, labels)
    assert torch.equal(torch.get_rng_state(), state), "the global RNG state changed"
    torch.manual_seed(7)
    torch.rand(11)
    b = attack.run(model, images, labels)
    assert torch.equal(a.adv, b.adv)


def test_clear_errors(tiny):
    model, images, labels = tiny
    with pytest.raises(AttackInputError, match="no targeted mode"):
        make_attack(AttackConfig("fab-t", targeted=True))
    with pytest.raises(AttackInputError, match="steps >= 1"):
        make_attack(AttackConfig("fab-t", steps=0))
    with pytest.raises(AttackInputError, match="n_target_classes"):
        make_attack(AttackConfig("fab-t", options={"n_target_classes": 0}))
    with pytest.raises(AttackInputError, match="only 9 wrong classes"):
        make_attack(AttackConfig("fab-t", steps=1, options={"n_target_classes": 12})).run(model, images, labels)




@pytest.mark.parametrize("norm,eps,restarts", [("linf", 2 / 255, 1), ("l2", 0.1, 1), ("l2", 0.2, 2)])
def test_the_written_out_target_loop_equals_torchattacks_perturb(tiny, norm, eps, restarts):
    """fab-t runs torchattacks' single targeted runs in its own loop over target classes
    (``multi_targeted``, so it can save progress between them); torchattacks' ``FAB(multi_targeted=
    True)`` called whole, from the same seed, must give the same images bit for bit: before the
    eps filter and after it (through ``run``). Small radii, so that images survive the first
    target classes; at L2 0.2 the second restart (a random start) fools one image more."""
    import torchattacks

    model = tiny[0]
    images = torch.rand(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        labels = model(images).argmax(1)

    def fab_ta():
        return torchattacks.FAB(model, norm="Linf" if norm == "linf" else "L2", eps=eps, steps=4, n_restarts=restarts,
                                alpha_max=0.1, eta=1.05, beta=0.9, seed=3, multi_targeted=True, n_classes=4)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        theirs = fab_ta()(images, labels)
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(3)
        ours = multi_targeted(fab_ta(), model, images, labels, 3, restarts, norm, eps)
    assert torch.equal(ours, theirs)
    changed = (theirs != images).flatten(1).any(1)
    assert 1 <= changed.sum() < len(images)   # some fooled, some resisted every target class
    fab = make_attack(AttackConfig("fab-t", norm=norm, eps=eps, steps=4, restarts=restarts, seed=3,
                                   options={"n_target_classes": 3}))
    fab.attack_copy = "off"   # bit for bit needs torchattacks' model, not the folded attack copy
    adv = fab.run(model, images, labels).adv
    assert torch.equal(adv, torch.where(changed.view(-1, 1, 1, 1), theirs, images))


@pytest.mark.parametrize("norm,eps", [("linf", 4 / 255), ("l2", 0.3)])
@pytest.mark.parametrize("rand_start", [False, True], ids=["clean start", "random start"])
def test_the_written_out_iterations_equal_torchattacks_single_run_and_resume_anywhere(tiny, norm, eps, rand_start):
    """``targeted_run`` (fab_run.py) against torchattacks' ``attack_single_run_targeted``, the same
    seed: the same images bit for bit, an image the model already gets wrong included (returned
    unchanged); resumed from the state it saves after iteration 1, 3 or 5 of 6 (the global RNG
    restored as the progress restores it), the same images again."""
    import torchattacks

    from robust_attn.attacks.fab_run import targeted_run

    model = tiny[0]
    images = torch.rand(8, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        labels = model(images).argmax(1)
    labels[0] = (labels[0] + 1) % K
    attack = torchattacks.FAB(model, norm="Linf" if norm == "linf" else "L2", eps=eps, steps=6, multi_targeted=True,
                              n_classes=4, seed=0)
    attack.target_class = 2
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(7)
        theirs = attack.attack_single_run_targeted(images, labels, use_rand_start=rand_start)
        torch.manual_seed(7)
        states = []
        ours = targeted_run(attack, images, labels, use_rand_start=rand_start,
                            save=lambda state: states.append((state(), torch.get_rng_state())))
        assert torch.equal(ours, theirs)
        fooled = (theirs != images).flatten(1).any(1)
        assert 2 <= fooled.sum() < 7 and not fooled[0]   # some found, some not; the wrong one untouched
        assert [s["it"] for s, _ in states] == [1, 2, 3, 4, 5]
        for state, rng in (states[0], states[2], states[4]):
            torch.set_rng_state(rng)
            again = targeted_run(attack, images, labels, use_rand_start=rand_start,
                                 resume=state)
            assert torch.equal(again, theirs), state["it"]
