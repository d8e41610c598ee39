"""Targeted PGD of SAN Table 10: backend agreement, targets, bounds, success, errors and checks."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from robust_attn.attacks import BACKENDS, PGDConfig, draw_targets, parse_eps, run_checks, targeted_pgd
from robust_attn.attacks.base import AttackInputError
from robust_attn.attacks import checks
from robust_attn.models.wrapper import NormalizedModel

PAPER_SETTINGS = [PGDConfig(8, 4, 2), PGDConfig(8, 2, 4)]  # SAN Table 10: {eps, rho, n}
from helpers import MEAN, STD, tiny_resnet


def _tiny_model(seed: int = 1) -> NormalizedModel:
    return tiny_resnet(seed)


@pytest.fixture(scope="module")
def model() -> NormalizedModel:
    return _tiny_model()


@pytest.fixture(scope="module")
def batch(model):
    gen = torch.Generator().manual_seed(2)
    images = torch.rand(8, 3, 32, 32, generator=gen)
    images[0, :, :4] = 0.0  # pixels on the [0, 1] boundary exercise the clamp
    images[1, :, :4] = 1.0
    with torch.no_grad():
        labels = model(images).argmax(1)
    return images, labels, draw_targets(labels, 10, seed=0)


def _predict(model, images):
    with torch.no_grad():
        return model(images).argmax(1)


# ---------------------------------------------------------------- config


def test_config_units_and_validation():
    cfg = PGDConfig(8, 2, 4)
    assert cfg.eps_abs == pytest.approx(8 / 255) and cfg.step_abs == pytest.approx(2 / 255)
    assert PGDConfig(0, 0, 0).steps == 0  # step may be 0 when there are no steps
    with pytest.raises(ValueError, match="eps must be >= 0"):
        PGDConfig(-1, 2, 4)
    with pytest.raises(ValueError, match="step must be > 0"):
        PGDConfig(8, 0, 4)
    with pytest.raises(ValueError, match="steps must be >= 0"):
        PGDConfig(8, 2, -1)
    with pytest.raises(TypeError, match="steps must be an int"):
        PGDConfig(8, 2, 2.5)
    with pytest.raises(TypeError, match="eps must be a number"):
        PGDConfig("8", 2, 4)
    with pytest.raises(ValueError, match="finite"):
        PGDConfig(float("nan"), 2, 4)


# ---------------------------------------------------------------- agreement


def _reference_pgd(model, x0, targets, cfg):
    """SAN Table 10 attack written from the equation, per image, with the clamps in the other order:

    x <- clip_{x0, eps}(clip_[0,1](x - step * sign(grad_x CE(model(x), target)))).
    The two clamps commute exactly in real arithmetic (intersecting intervals), not always in floats.
    """
    out = []
    for i in range(len(x0)):
        xi0, ti = x0[i:i + 1], targets[i:i + 1]
        x = xi0.clone()
        for _ in range(cfg.steps):
            x = x.detach().requires_grad_(True)
            loss = F.cross_entropy(model(x), ti)
            (g,) = torch.autograd.grad(loss, x)
            x = torch.clamp(x.detach() - cfg.step_abs * g.sign(), 0.0, 1.0)
            x = torch.minimum(torch.maximum(x, xi0 - cfg.eps_abs), xi0 + cfg.eps_abs)
        out.append(x.detach())
    return torch.cat(out)


@pytest.mark.parametrize("cfg", PAPER_SETTINGS, ids=str)
def test_exact_backends_agree_bit_for_bit(model, batch, cfg):
    """native (exact=True), torchattacks and foolbox take the same steps: identical images.

    Exact (not only close) because all three run the same float32 ops in the same order on the
    same batch; the loss is a mean in torchattacks and a sum elsewhere, a factor 1/8 that is a
    power of two, so even the gradients' rounding is the same. A sign error, a different
    clamp order or a different step would move pixels by multiples of step/255.
    """
    images, labels, targets = batch
    advs = {b: targeted_pgd(model, images, targets, cfg, backend=b, labels=labels, exact=True) for b in BACKENDS}
    preds = {b: _predict(model, a) for b, a in advs.items()}
    for b in BACKENDS[1:]:
        assert torch.equal(preds[b], preds["native"]), b
        assert (advs[b] - advs["native"]).abs().max().item() <= 1e-6, b
    # The attack moved the images and pulled them toward the targets.
    assert (advs["native"] - images).abs().amax() == pytest.approx(cfg.eps_abs, abs=1e-6)
    with torch.no_grad():
        clean_loss = F.cross_entropy(model(images), targets, reduction="none")
        adv_loss = F.cross_entropy(model(advs["native"]), targets, reduction="none")
    assert (adv_loss < clean_loss).all()


@pytest.fixture(scope="module")
def batch16(model):
    gen = torch.Generator().manual_seed(6)
    images = torch.rand(16, 3, 32, 32, generator=gen)
    return images, draw_targets(_predict(model, images), 10, seed=2)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a fallback to the exact model would hide the fast path
@pytest.mark.parametrize("cfg", PAPER_SETTINGS, ids=str)
def test_default_native_agrees_with_libraries_up_to_ties(model, batch16, cfg):
    """The default (fast) native mode against torchattacks and foolbox: "up to floating-point ties".

    The fast mode folds batch norm into the convolutions and uses channels-last kernels, so the
    gradient is rounded differently; a component within rounding error of zero (or a ReLU
    input within rounding error of 0) can change the sign, which moves that pixel by 2 * step
    and changes later steps of that image. Precisely, we require: the adversarial predictions
    agree on >= 15 of 16 images (>= 93.75%); >= 97% of all pixels are identical; the differing
    pixels sit on a few images (>= 10 of 16 images are identical pixel for pixel); and the
    attack itself is as strong (mean target loss within 2%). A real bug (sign, step, clamp)
    changes nearly every pixel of every image. (Measured here: 16/16 predictions, 99.2% of
    pixels and 13/16 whole images at {8, 2, 4}; everything identical at {8, 4, 2}.)
    """
    images, targets = batch16
    fast = targeted_pgd(model, images, targets, cfg)
    for backend in BACKENDS[1:]:
        lib = targeted_pgd(model, images, targets, cfg, backend=backend)
        same = ((fast - lib).abs() <= 1e-6).flatten(1).float().mean(1)
        assert (_predict(model, fast) == _predict(model, lib)).sum().item() >= 15, backend
        assert same.mean().item() >= 0.97, backend
        assert (same == 1).sum().item() >= 10, backend
        with torch.no_grad():
            fast_loss = F.cross_entropy(model(fast), targets).item()
            lib_loss = F.cross_entropy(model(lib), targets).item()
        assert fast_loss == pytest.approx(lib_loss, rel=0.02), backend
    assert (fast - images).abs().amax() == pytest.approx(cfg.eps_abs, abs=1e-6)


def test_fast_mode_gradient_matches_float64(model, batch16):
    """Why the fast mode may differ, checked at the first step: its input gradient (folded
    model, channels-last) is within float32 rounding of a float64 gradient of the original
    model, and its signs differ only where that gradient is within rounding of zero."""
    from robust_attn.attacks.fast_model import attack_model

    images, targets = batch16
    fast_model = attack_model(model, images[:4])
    assert fast_model is not model

    def grad(m, x):
        x = x.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(F.cross_entropy(m(x), targets, reduction="sum"), x)
        return g

    g64 = grad(copy.deepcopy(model).double(), images.double())
    g = grad(fast_model, images.contiguous(memory_format=torch.channels_last)).double()
    scale = g64.abs().flatten(1).amax(1).view(-1, 1, 1, 1)
    assert ((g - g64).abs() / scale).max().item() < 1e-2
    flipped = g.sign() != g64.sign()
    assert flipped.float().mean().item() < 1e-3
    if flipped.any():
        assert ((g64.abs() / scale)[flipped]).max().item() < 1e-2


@pytest.mark.parametrize("cfg", PAPER_SETTINGS, ids=str)
def test_native_matches_per_image_reference(model, batch, cfg):
    """Against an independent per-image loop: the same images up to floating-point ties.

    Batch size 1 uses other convolution kernels, so gradients differ in rounding; a component
    that is almost zero can change sign, which moves one pixel by 2*step and perturbs later steps.
    We therefore ask for the same pixels nearly everywhere and the same predictions for most images.
    """
    images, _, targets = batch
    ours = targeted_pgd(model, images, targets, cfg)
    ref = _reference_pgd(model, images, targets, cfg)
    same_pixels = ((ours - ref).abs() <= 1e-6).float().mean().item()
    assert same_pixels >= 0.97
    assert (_predict(model, ours) == _predict(model, ref)).sum().item() >= 7


# ---------------------------------------------------------------- targets


def test_parse_eps_reads_radii_in_image_units():
    assert parse_eps("8/255") == 8 / 255 and parse_eps(" 0.5/255 ") == 0.5 / 255
    assert parse_eps("0.031") == 0.031 and parse_eps(0.25) == 0.25
    assert parse_eps("1.5", norm="l2") == 1.5
    for bad, message in (("abc", "not a number"), ("8/0", "not a number"), ("8", "8/255"), ("-1/255", ">= 0")):
        with pytest.raises(AttackInputError, match=message):
            parse_eps(bad)


def test_targets_uniform_over_wrong_classes():
    num_classes, n = 10, 45_000
    labels = torch.randint(0, num_classes, (n,))
    targets = draw_targets(labels, num_classes, seed=3)
    assert targets.dtype == torch.long and targets.shape == labels.shape
    assert (targets != labels).all()
    assert ((targets >= 0) & (targets < num_classes)).all()
    # Given the label, the target is uniform on the other 9 classes: chi-square over the
    # 9 offsets (label + offset) % 10; df = 8, the 0.999 quantile is 26.12.
    offsets = (targets - labels) % num_classes
    counts = torch.bincount(offsets, minlength=num_classes).double()
    assert counts[0] == 0
    expected = n / (num_classes - 1)
    chi2 = (((counts[1:] - expected) ** 2) / expected).sum().item()
    assert chi2 < 26.12
    # And uniform for a single label (not only on average over labels).
    zeros = draw_targets(torch.zeros(9_000, dtype=torch.long), num_classes, seed=4)
    per_class = torch.bincount(zeros, minlength=num_classes)
    assert per_class[0] == 0 and per_class[1:].min() > 850 and per_class[1:].max() < 1150


def test_targets_reproducible_and_independent_of_global_rng():
    labels = torch.randint(0, 100, (500,))
    torch.manual_seed(123)
    first = draw_targets(labels, 100, seed=7)
    rng_state = torch.get_rng_state()
    torch.manual_seed(999)
    second = draw_targets(labels, 100, seed=7)
    assert torch.equal(first, second)
    assert not torch.equal(first, draw_targets(labels, 100, seed=8))
    # The draw uses its own generator: the global RNG stream is untouched.
    torch.manual_seed(123)
    draw_targets(labels, 100, seed=7)
    assert torch.equal(torch.get_rng_state(), rng_state)


def test_targets_depend_only_on_position():
    labels = torch.randint(0, 10, (64,))
    full = draw_targets(labels, 10, seed=0)
    # Batch by batch with offsets gives the same targets as one draw.
    pieces = [draw_targets(labels[i:i + 16], 10, seed=0, offset=i) for i in range(0, 64, 16)]
    assert torch.equal(torch.cat(pieces), full)
    # Changing one image's label changes only that image's target.
    changed = labels.clone()
    changed[5] = (changed[5] + 3) % 10
    other = draw_targets(changed, 10, seed=0)
    keep = torch.arange(64) != 5
    assert torch.equal(other[keep], full[keep]) and other[5] != changed[5]


def test_targets_bad_input():
    with pytest.raises(ValueError, match="num_classes >= 2"):
        draw_targets(torch.zeros(3, dtype=torch.long), 1, 0)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\)"):
        draw_targets(torch.tensor([0, 10]), 10, 0)
    with pytest.raises(TypeError, match="1-D integer"):
        draw_targets(torch.zeros(3), 10, 0)


# ---------------------------------------------------------------- bounds, eps = 0, success


@pytest.mark.parametrize("backend", BACKENDS)
def test_perturbation_within_eps_and_unit_range(model, batch, backend):
    images, _, targets = batch
    cfg = PGDConfig(4, 3, 3)  # step close to eps: the projection is active from step 2 on
    adv = targeted_pgd(model, images, targets, cfg, backend=backend)
    assert adv.shape == images.shape and adv.dtype == images.dtype
    delta = (adv - images).abs()
    assert delta.max().item() <= cfg.eps_abs + 1e-6
    assert delta.max().item() >= cfg.eps_abs - 1e-6  # the attack did move to the ball's edge
    assert adv.min().item() >= 0.0 and adv.max().item() <= 1.0
    # Pixels at 0 and 1 could only move inward.
    assert adv[0, :, :4].min() >= 0 and adv[1, :, :4].max() <= 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_eps_zero_gives_clean_images(model, batch, backend):
    images, _, targets = batch
    adv = targeted_pgd(model, images, targets, PGDConfig(0, 2, 3), backend=backend)
    assert torch.equal(adv, images)
    assert torch.equal(_predict(model, adv), _predict(model, images))


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_start_stays_in_bounds_and_differs(model, batch, backend):
    images, _, targets = batch
    cfg = PGDConfig(8, 2, 1, random_start=True)
    adv = targeted_pgd(model, images, targets, cfg, backend=backend)
    plain = targeted_pgd(model, images, targets, PGDConfig(8, 2, 1), backend=backend)
    assert (adv - images).abs().max().item() <= cfg.eps_abs + 1e-6
    assert adv.min().item() >= 0.0 and adv.max().item() <= 1.0
    # From a random point one step of 2/255 lands off the grid {x, x +- 2/255} of the plain run.
    assert ((adv - plain).abs() > 1e-4).float().mean().item() > 0.5


def test_unbounded_attack_reaches_most_targets(model):
    """eps = 255 (no bound but [0, 1]): 20 steps reach the target for most images.

    On 16x16 inputs to keep it fast. Before the attack no image is classified as its target
    (targets are wrong classes of the predicted label); a sign error would push away from it.
    """
    gen = torch.Generator().manual_seed(5)
    images = torch.rand(8, 3, 16, 16, generator=gen)
    targets = draw_targets(_predict(model, images), 10, seed=1)
    adv = targeted_pgd(model, images, targets, PGDConfig(255, 8, 20))
    success = (_predict(model, adv) == targets).float().mean().item()
    assert success >= 0.75
    with torch.no_grad():
        before = F.cross_entropy(model(images), targets, reduction="none")
        after = F.cross_entropy(model(adv), targets, reduction="none")
    assert (after < 0.5 * before).all()


def test_loss_toward_target_decreases_with_steps(model, batch):
    images, _, targets = batch
    losses = []
    for steps in (0, 1, 2, 4):
        adv = targeted_pgd(model, images, targets, PGDConfig(8, 2, steps))
        with torch.no_grad():
            losses.append(F.cross_entropy(model(adv), targets).item())
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


# ---------------------------------------------------------------- errors and side effects


def test_clear_errors(model, batch):
    images, labels, targets = batch
    cfg = PAPER_SETTINGS[0]
    with pytest.raises(ValueError, match="native, torchattacks, foolbox"):
        targeted_pgd(model, images, targets, cfg, backend="cleverhans")
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        targeted_pgd(model, (images - 0.5) / 0.25, targets, cfg)
    with pytest.raises(ValueError, match="equal the true label"):
        targeted_pgd(model, images, labels, cfg, labels=labels)
    with pytest.raises(ValueError, match="class indices"):
        targeted_pgd(model, images, targets + 10, cfg)
    with pytest.raises(ValueError, match="shape"):
        targeted_pgd(model, images, targets[:3], cfg)
    with pytest.raises(TypeError, match="use images.to"):
        targeted_pgd(model, images.double(), targets, cfg)
    with pytest.raises(TypeError, match="PGDConfig"):
        targeted_pgd(model, images, targets, (8, 2, 4))
    with pytest.raises(TypeError, match="exact must be a bool"):
        targeted_pgd(model, images, targets, cfg, exact="yes")
    model.train()
    try:
        with pytest.raises(ValueError, match=r"train mode.*model\.eval\(\)"):
            targeted_pgd(model, images, targets, cfg)
    finally:
        model.eval()


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_leave_model_as_it_was(batch, backend):
    model = _tiny_model(seed=3)
    model.model.fc.weight.requires_grad_(False)  # a partly frozen model stays partly frozen
    grads_before = [p.requires_grad for p in model.parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    images, _, targets = batch
    with torch.no_grad():  # callers may hold no_grad; the attack must still get gradients
        adv = targeted_pgd(model, images, targets, PAPER_SETTINGS[0], backend=backend)
    assert not (adv - images).abs().max().item() == 0
    assert not any(m.training for m in model.modules())
    assert [p.requires_grad for p in model.parameters()] == grads_before
    assert all(p.grad is None for p in model.parameters())
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


# ---------------------------------------------------------------- sanity checks


def test_run_checks_pass_on_a_sound_attack(model, batch):
    images, _, targets = batch
    cfg = PAPER_SETTINGS[1]
    adv = targeted_pgd(model, images, targets, cfg)
    results = run_checks(model, images, targets, adv, cfg, max_images=4)
    assert {r.name for r in results} == {"eval_mode", "deterministic", "perturbation_bound", "image_range",
                                         "input_gradient", "eps_zero"}
    assert all(r.passed for r in results), [r for r in results if not r.passed]
    assert all(isinstance(r.detail, str) and r.detail for r in results)


def test_checks_fail_for_train_mode_dropout_model():
    net = nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(3 * 8 * 8, 10))
    model = NormalizedModel(net, MEAN, STD).train()
    images = torch.rand(4, 3, 8, 8)
    targets = torch.tensor([1, 2, 3, 4])
    adv = images.clone()
    results = {r.name: r for r in run_checks(model, images, targets, adv, PGDConfig(8, 2, 4))}
    assert not results["eval_mode"].passed and "train mode" in results["eval_mode"].detail
    assert not results["deterministic"].passed
    assert "eps_zero" not in results  # not run: the attack refuses train-mode models
    model.eval()
    assert checks.check_eval_mode(model).passed and checks.check_deterministic(model, images).passed


def test_check_perturbation_bound_and_range_fail_when_they_should(batch):
    images = batch[0]
    eps = 8 / 255
    assert checks.check_perturbation_bound(images, (images + eps).clamp(0, 1), eps).passed
    too_far = images + torch.where(torch.rand_like(images) < 0.5, -1.0, 1.0) * 2 * eps
    assert not checks.check_perturbation_bound(images, too_far, eps).passed
    assert not checks.check_perturbation_bound(images, images[:2], eps).passed
    assert not checks.check_image_range(too_far).passed  # images has exact 0s and 1s
    assert not checks.check_image_range(images - 1.5).passed   # below 0 only
    assert not checks.check_image_range(images + 1.5).passed   # above 1 only
    nan = images.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert not checks.check_image_range(nan).passed
    assert checks.check_image_range(images).passed


def test_check_input_gradient_fails_for_masked_gradient(model, batch):
    images, _, targets = batch
    assert checks.check_input_gradient(model, images[:2], targets[:2]).passed

    class Quantized(nn.Module):  # rounding to 8 bits: zero gradient almost everywhere
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(torch.round(x * 255) / 255)

    result = checks.check_input_gradient(Quantized(model).eval(), images[:2], targets[:2])
    assert not result.passed and "zero input gradient" in result.detail

    class Detached(Quantized):
        def forward(self, x):
            return self.inner(x.detach())

    assert not checks.check_input_gradient(Detached(model).eval(), images[:2], targets[:2]).passed


def test_check_eps_zero_fails_for_an_attack_ignoring_eps(model, batch):
    images, _, targets = batch

    def ignores_eps(m, x, t, cfg):
        return (x + cfg.step_abs * torch.sign(torch.randn_like(x))).clamp(0, 1)

    cfg = PAPER_SETTINGS[0]
    assert not checks.check_eps_zero(model, images[:4], targets[:4], cfg, attack=ignores_eps).passed
    assert checks.check_eps_zero(model, images[:4], targets[:4], cfg).passed

    def raises(m, x, t, cfg):
        raise RuntimeError("boom")

    result = checks.check_eps_zero(model, images[:4], targets[:4], cfg, attack=raises)
    assert not result.passed and "boom" in result.detail


def test_check_monotone_success():
    rates = {PGDConfig(2, 2, 1): 0.1, PGDConfig(8, 2, 1): 0.3, PGDConfig(8, 2, 4): 0.9,
             PGDConfig(8, 4, 2): 0.2}  # a different step size: not compared with the others
    result = checks.check_monotone_success(rates)
    assert result.passed and result.detail.startswith("3 comparable")
    falling = dict(rates)
    falling[PGDConfig(16, 2, 4)] = 0.5  # more eps, same steps, lower success than {8, 2, 4}
    result = checks.check_monotone_success(falling)
    assert not result.passed and "0.5000 < " in result.detail
    assert checks.check_monotone_success(falling, tol=0.5).passed
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        checks.check_monotone_success({PGDConfig(8, 2, 4): 90.0})


# ---------------------------------------------------------------- batch-norm folding (fast mode)


def _random_bn(c: int, gen: torch.Generator, affine: bool = True) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(c, affine=affine, eps=1e-3)
    if affine:
        bn.weight.data = torch.rand(c, generator=gen) + 0.5
        bn.bias.data = torch.randn(c, generator=gen)
    bn.running_mean.copy_(torch.randn(c, generator=gen))
    bn.running_var.copy_(torch.rand(c, generator=gen) + 0.1)
    return bn.eval()


@pytest.mark.parametrize("bias,groups,affine", [(False, 1, True), (True, 2, True), (False, 1, False)])
def test_fold_conv_bn_equals_conv_then_batchnorm(bias, groups, affine):
    from robust_attn.attacks.fast_model import fold_conv_bn

    gen = torch.Generator().manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=bias, groups=groups)
    bn = _random_bn(6, gen, affine)
    x = torch.randn(2, 4, 9, 9, generator=gen)
    weight = conv.weight.detach().clone()
    fused = fold_conv_bn(conv, bn)
    with torch.no_grad():
        # BN in eval mode from its definition: (y - mean) / sqrt(var + eps) * gamma + beta.
        y = conv(x)
        want = (y - bn.running_mean.view(1, -1, 1, 1)) / torch.sqrt(bn.running_var.view(1, -1, 1, 1) + bn.eps)
        if affine:
            want = want * bn.weight.view(1, -1, 1, 1) + bn.bias.view(1, -1, 1, 1)
        assert torch.allclose(fused(x), want, atol=1e-5, rtol=1e-5)
    assert fused.bias is not None and (conv.bias is None) == (not bias)  # the conv itself is unchanged
    assert torch.equal(conv.weight, weight) and fused.weight is not conv.weight
    with pytest.raises(ValueError, match="output channels"):
        fold_conv_bn(conv, _random_bn(5, gen))


def test_fold_batchnorm_resnet_copy(model, batch):
    from robust_attn.attacks.fast_model import fold_batchnorm

    images = batch[0]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    folded, count = fold_batchnorm(model)
    assert count == n_bn == 29  # resnet26: stem 1 + 8 blocks x 3 + 4 projection shortcuts
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    assert not folded.training
    with torch.no_grad():
        want, got = model(images), folded(images)
    assert torch.allclose(got, want, atol=1e-4 * want.abs().max().item())
    # The caller's model is untouched and still has its batch norms.
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 29
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    model.train()
    try:
        with pytest.raises(ValueError, match="model.eval"):
            fold_batchnorm(model)
    finally:
        model.eval()


class _DataDependent(nn.Module):
    """fx cannot trace ``if x.mean() > 0`` (a Python branch on a tensor)."""

    def __init__(self, c: int, gen: torch.Generator):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1), _random_bn(c, gen)

    def forward(self, x):
        y = self.bn(self.conv(x))
        return y if x.mean() > 0 else -y


class _Mixed(nn.Module):
    def __init__(self, gen: torch.Generator):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1, bias=False), _random_bn(4, gen)
        self.odd = _DataDependent(4, gen)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 1), _random_bn(4, gen)
        self.shared = nn.Conv2d(4, 4, 1)  # its output feeds two users: must not be folded
        self.bn3 = _random_bn(4, gen)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.bn2(self.conv2(self.odd(x)))
        y = self.shared(x)
        return (self.bn3(y) + y).mean((2, 3))


def test_fold_batchnorm_keeps_untraceable_parts_whole():
    from robust_attn.attacks.fast_model import fold_batchnorm

    gen = torch.Generator().manual_seed(1)
    net = _Mixed(gen).eval()
    folded, count = fold_batchnorm(net)
    # bn1 and bn2 around the opaque module; not the one inside it, nor bn3 (conv output reused).
    assert count == 2
    assert sum(isinstance(m, nn.BatchNorm2d) for m in folded.modules()) == 2
    assert folded.odd.bn is not net.odd.bn and isinstance(folded.odd.bn, nn.BatchNorm2d)  # a copy
    for sign in (1.0, -1.0):  # both branches of the data-dependent module still work
        x = sign * torch.rand(2, 3, 8, 8, generator=gen)
        with torch.no_grad():
            assert torch.allclose(folded(x), net(x), atol=1e-5)
    # A model whose own forward cannot be traced is attacked as it is.
    odd = _DataDependent(4, gen).eval()
    assert fold_batchnorm(odd) == (odd, 0)


def test_attack_model_cache_and_invalidation():
    from robust_attn.attacks.fast_model import attack_model

    model = _tiny_model(seed=4)
    x = torch.rand(2, 3, 32, 32)
    first = attack_model(model, x)
    assert first is not model and attack_model(model, x) is first
    assert not any(p.requires_grad for p in first.parameters())
    assert all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        model.model.fc.bias.add_(1.0)  # an in-place update (e.g. an optimizer step)
    second = attack_model(model, x)
    assert second is not first
    with torch.no_grad():
        assert torch.allclose(second(x), model(x), atol=1e-4)
    model.model.fc.bias.data.sub_(1.0)  # through .data: no version bump, still noticed
    third = attack_model(model, x)
    assert third is not second
    with torch.no_grad():
        assert torch.allclose(third(x), model(x), atol=1e-4)


def test_attack_model_falls_back_when_folding_changes_the_output(monkeypatch):
    from robust_attn.attacks import fast_model

    model = _tiny_model(seed=5)
    x = torch.rand(2, 3, 32, 32)

    def broken(m):  # stands for a trace that missed part of the model
        copied = copy.deepcopy(m)
        copied.model.fc.bias.data += 1.0
        return copied, 1

    monkeypatch.setattr(fast_model, "fold_batchnorm", broken)
    with pytest.warns(RuntimeWarning, match="exact=True"):
        assert fast_model.attack_model(model, x) is model
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fast_model.attack_model(model, x) is model  # the verdict is cached, warned once


def test_exact_and_fast_modes_on_a_model_without_batchnorm():
    """Nothing to fold: the fast mode attacks the model itself (in channels-last layout)."""
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
    model = NormalizedModel(net, MEAN, STD).eval()
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    targets = draw_targets(_predict(model, images), 10, seed=0)
    from robust_attn.attacks.fast_model import attack_model

    assert attack_model(model, images) is model
    fast = targeted_pgd(model, images, targets, PAPER_SETTINGS[1])
    exact = targeted_pgd(model, images, targets, PAPER_SETTINGS[1], exact=True)
    assert ((fast - exact).abs() <= 1e-6).float().mean().item() >= 0.97
    assert (fast - images).abs().max().item() <= PAPER_SETTINGS[1].eps_abs + 1e-6


def test_the_random_start_is_uniform_over_the_whole_eps_ball():
    """PGD's random start (Madry et al.) draws each pixel's offset uniformly in [-eps, eps]: both signs,
    centred on the image (a start drawn in [0, eps] brightens every image before the first step)."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10)).eval()
    images = torch.full((16, 3, 8, 8), 0.5)                     # mid-grey: no offset is clipped
    torch.manual_seed(0)
    start = targeted_pgd(model, images, torch.zeros(16, dtype=torch.long),
                         PGDConfig(eps=8, step=2, steps=0, random_start=True))
    offset, eps = start - images, 8 / 255
    assert offset.abs().max() <= eps + 1e-7
    assert offset.min() < -0.95 * eps and offset.max() > 0.95 * eps
    assert abs(offset.mean().item()) < 0.05 * eps               # 3,072 draws: the standard error is 0.01 eps
    assert 0.45 < (offset < 0).float().mean().item() < 0.55
