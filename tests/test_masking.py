"""Gradient-masking checks: hand-made masked models trigger each check, a plain
(tiny, random) ResNet triggers none."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from robust_attn.attacks.base import AttackConfig, make_attack
from robust_attn.attacks.masking import (MaskingCheck, check_blackbox_beats_whitebox, check_gain_with_strength,
                                         check_input_gradients, check_loss_saturation, check_unbounded,
                                         input_gradient_stats, loss_along_directions, plot_loss_along_directions,
                                         run_masking_checks, unbounded_success)
from robust_attn.models.wrapper import NormalizedModel

from helpers import tiny_resnet
EPS = 2 / 255


def _tiny_resnet(seed: int = 1) -> NormalizedModel:
    return tiny_resnet(seed, stem_downsample=4)


class Quantized(nn.Module):
    """A ResNet behind an input quantizer (4 grey levels): torch.round has a zero gradient."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(torch.round(x * 3) / 3)


class Brightness(nn.Module):
    """A steep sigmoid on the mean brightness: class 1 iff mean(x) > 0.5, logits +-1e4 (m - 0.5).
    The softmax saturates, so the cross-entropy and its gradient are exactly 0 away from the
    boundary, yet the whole-image attack (brighten or darken) reaches the other class."""

    def forward(self, x):
        z = 1e4 * (x.mean(dim=(1, 2, 3)) - 0.5)
        return torch.stack([-z, z], dim=1)


class Scaled(nn.Module):
    """Logits times ``scale``: the gradient vanishes (scale << 1) but is neither zero nor masked in sign."""

    def __init__(self, inner: nn.Module, scale: float):
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, x):
        return self.inner(x) * self.scale


@pytest.fixture(scope="module")
def resnet():
    return _tiny_resnet()


@pytest.fixture(scope="module")
def batch(resnet):
    images = torch.rand(8, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        labels = resnet(images).argmax(1)
    return images, labels


@pytest.fixture(scope="module")
def bright_batch():
    """Dark images (mean ~0.25) and bright ones (~0.75), labelled by the Brightness model."""
    gen = torch.Generator().manual_seed(3)
    images = torch.rand(6, 3, 32, 32, generator=gen) * 0.5
    images[3:] += 0.5
    return images, torch.tensor([0, 0, 0, 1, 1, 1])


def _records(indices, success, condition="c"):
    return pd.DataFrame({"index": indices, "success": success, "condition": condition})


def _fooled(model, adv, labels):
    with torch.no_grad():
        return (model(adv).argmax(1) != labels).long().numpy()


# ------------------------------------------------------------------ MaskingCheck


def test_masking_check_to_dict_is_json_and_verdict_validated():
    check = MaskingCheck("x", "flag", "d", {"n": np.int64(3), "idx": np.array([1, 2]), "rate": np.float32(0.5),
                                            "nested": {1: (np.bool_(True),)}})
    back = json.loads(json.dumps(check.to_dict()))
    assert back == {"name": "x", "verdict": "flag", "passed": False, "detail": "d",
                    "evidence": {"n": 3, "idx": [1, 2], "rate": 0.5, "nested": {"1": [True]}}}
    assert MaskingCheck("x", "pass", "d").passed
    with pytest.raises(ValueError, match="verdict must be one of"):
        MaskingCheck("x", "fail", "d")


# ------------------------------------------------------------------ black-box beats white-box


def test_blackbox_beats_whitebox_counts_and_indices():
    rng = np.random.default_rng(0)
    white_idx = np.arange(40)
    white_ok = rng.integers(0, 2, 40)
    square_idx = rng.permutation(np.arange(10, 50))          # partial overlap, shuffled rows
    square_ok = rng.integers(0, 2, 40)
    white = _records(white_idx, white_ok)
    black = {"square": _records(square_idx, square_ok), "transfer:a": _records(white_idx, white_ok)}
    check = check_blackbox_beats_whitebox(white, black)
    w = dict(zip(white_idx, white_ok))
    expected = sorted(i for i, ok in zip(square_idx, square_ok) if i in w and ok and not w[i])
    assert expected, "the draw must contain beaten images for the test to mean anything"
    assert check.verdict == "flag"
    ev = check.evidence["square"]
    assert ev["beats"] == len(expected) and ev["indices"] == expected[:20]
    assert ev["compared"] == 30
    assert ev["white_success"] == int(white_ok[10:].sum())
    assert check.evidence["transfer:a"]["beats"] == 0       # same records: nothing beats


def test_blackbox_subset_of_whitebox_passes_and_bad_input_is_named():
    white = _records(range(6), [1, 1, 0, 1, 0, 1])
    black = {"square": _records(range(6), [1, 0, 0, 1, 0, 0])}
    assert check_blackbox_beats_whitebox(white, black).verdict == "pass"
    two = pd.concat([white, _records(range(6), [0] * 6, "d")])
    with pytest.raises(ValueError, match="condition="):
        check_blackbox_beats_whitebox(two, black)
    assert check_blackbox_beats_whitebox(two, {"s": _records(range(6), [1] * 6)}, condition="d").verdict == "flag"
    with pytest.raises(ValueError, match="share no image"):
        check_blackbox_beats_whitebox(white, {"square": _records(range(10, 12), [1, 1])})
    with pytest.raises(ValueError, match="'success'"):
        check_blackbox_beats_whitebox(white.drop(columns="success"), black)


def test_blackbox_sources_at_other_radii_are_each_held_to_the_white_box_at_theirs():
    """Square at 8/255 fools images 2 and 3: APGD-CE at 8/255 fools 3 but not 2 (a flag), while
    the white-box attack at 2/255, which fools neither, is not what Square is compared with."""
    at_2 = _records(range(6), [1, 0, 0, 0, 0, 0])
    at_8 = _records(range(6), [1, 1, 0, 1, 0, 0])
    square = _records(range(6), [1, 0, 1, 1, 0, 0])
    own = _records(range(6), [1, 0, 0, 0, 0, 0])     # AutoAttack's own Square member, at 2/255
    check = check_blackbox_beats_whitebox({"autoattack's square": at_2, "square": at_8},
                                          {"autoattack's square": own, "square": square})
    assert check.verdict == "flag"
    assert check.evidence["square"]["beats"] == 1 and check.evidence["square"]["indices"] == [2]
    assert check.evidence["square"]["white_success"] == 3 and check.evidence["autoattack's square"]["beats"] == 0
    with pytest.raises(ValueError, match="no white-box records for 'square'"):
        check_blackbox_beats_whitebox({"autoattack's square": at_2}, {"square": square})


# ------------------------------------------------------------------ gain with strength


def test_gain_with_strength_flags_drops_and_stalls():
    up = check_gain_with_strength({"n1": 0.2, "n10": 0.5, "n100": 0.6})
    assert up.verdict == "pass" and up.evidence["gain"] == pytest.approx(0.4)
    drop = check_gain_with_strength({"n100": 0.3, "n1": 0.2, "n10": 0.5}, order=["n1", "n10", "n100"])
    assert drop.verdict == "flag" and drop.evidence["drops"] == [
        {"from": "n10", "to": "n100", "rate_from": 0.5, "rate_to": 0.3}]
    stall = check_gain_with_strength({1: 0.4, 2: 0.4, 4: 0.4})
    assert stall.verdict == "flag" and not stall.evidence["drops"]
    assert check_gain_with_strength({1: 1.0, 2: 1.0}).verdict == "pass"      # already 100%
    assert check_gain_with_strength({1: 0.5, 2: 0.45, 3: 0.6}, tol=0.1).verdict == "pass"
    with pytest.raises(ValueError, match="divide percentages"):
        check_gain_with_strength({1: 40.0, 2: 60.0})
    with pytest.raises(ValueError, match="at least two"):
        check_gain_with_strength({1: 0.4})


# ------------------------------------------------------------------ unbounded attack


def test_unbounded_check_from_records_and_rate():
    check = check_unbounded(_records([5, 7, 9, 11], [1, 0, 1, 0]))
    assert check.verdict == "flag" and check.evidence["indices"] == [7, 11]
    assert check.evidence["success_rate"] == 0.5
    assert check_unbounded(1.0).verdict == "pass" and check_unbounded(0.99).verdict == "flag"
    with pytest.raises(ValueError, match="divide percentages"):
        check_unbounded(100.0)


def test_saturated_model_fails_unbounded_attack(bright_batch):
    images, labels = bright_batch
    model = Brightness().eval()
    records = unbounded_success(model, images, labels, steps=10)
    check = check_unbounded(records)
    assert check.verdict == "flag" and records["success"].sum() == 0
    # the images are far from unreachable: a hand-made eps=1 image (invert brightness) fools every one
    assert _fooled(model, 1 - images, labels).all()


def _pgd_eps_one_by_hand(model, images, labels, steps):
    """Madry et al.'s L-inf PGD at eps = 1 from the clean image, step 2.5 / steps, ascending the
    cross-entropy; an image counts as fooled if any iterate x_0 ... x_steps fools it."""
    x, fooled = images.clone(), torch.zeros(len(images), dtype=torch.bool)
    for k in range(steps + 1):
        x.requires_grad_(True)
        logits = model(x)
        fooled |= logits.argmax(1) != labels
        if k == steps:
            break
        grad, = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"), x)
        x = (images + (x.detach() + 2.5 / steps * grad.sign() - images).clamp(-1, 1)).clamp(0, 1)
    return fooled.long().tolist()


@pytest.mark.parametrize("steps", [1, 5])
def test_unbounded_success_matches_pgd(resnet, batch, steps):
    images, labels = batch
    records = unbounded_success(resnet, images, labels, steps=steps, indices=range(100, 108), random_start=False)
    with torch.no_grad():
        own = resnet(images).argmax(1)   # the check moves each image off the model's own prediction
    assert records["index"].tolist() == list(range(100, 108))
    assert records["success"].tolist() == _pgd_eps_one_by_hand(resnet, images, own, steps)
    assert check_unbounded(records).verdict == ("pass" if records["success"].all() else "flag")


def test_unbounded_success_uses_the_whole_cube():
    """Dark images (pixels 0.1-0.3) and a model that needs their mean above 0.9: at eps = 1 every
    one is fooled (all pixels to 1), at any eps below 0.6 none is (mean at most 0.3 + eps)."""
    class FarThreshold(nn.Module):
        def forward(self, x):
            z = 10 * (x.mean((1, 2, 3)) - 0.9)
            return torch.stack([-z, z], 1)

    model = FarThreshold().eval()
    images = 0.1 + 0.2 * torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    labels = torch.zeros(4, dtype=torch.long)
    records = unbounded_success(model, images, labels, steps=1, random_start=False)
    assert records["success"].tolist() == _pgd_eps_one_by_hand(model, images, labels, 1) == [1] * 4


def test_unbounded_success_attacks_at_eps_one_the_whole_image():
    """A model whose decision needs every pixel moved by more than 0.25 (the mean brightness must
    cross 0.5 from 0.25): only a radius near the whole range can fool it, as eps = 1 can."""
    class MeanBrightness(torch.nn.Module):
        def forward(self, x):
            z = 10 * (x.mean((1, 2, 3)) - 0.5)
            return torch.stack([-z, z], 1)

    model = MeanBrightness().eval()
    images = (0.25 + 0.02 * torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    labels = torch.zeros(6, dtype=torch.long)
    assert unbounded_success(model, images, labels, steps=10)["success"].tolist() == [1] * 6
    smaller = make_attack(AttackConfig("pgd", eps=0.2, steps=10)).run(model, images, labels).adv
    assert not _fooled(model, smaller, labels).any()   # so the check's radius matters here


# ------------------------------------------------------------------ input gradients


def _manual_gradients(model, images, labels):
    """Per-image gradient of the float64 cross-entropy, one image at a time."""
    grads = []
    for x, y in zip(images, labels):
        x = x[None].clone().requires_grad_(True)
        loss = F.cross_entropy(model(x).double(), y[None])
        (g,) = torch.autograd.grad(loss, x)
        grads.append(g.flatten().double())
    return torch.stack(grads)


def test_input_gradient_stats_match_per_image_autograd(resnet, batch):
    images, labels = batch
    stats = input_gradient_stats(resnet, images, labels)
    grads = _manual_gradients(resnet, images, labels)
    assert stats["zero_fraction"] == pytest.approx((grads == 0).double().mean().item(), abs=1e-3)
    assert stats["nonfinite_fraction"] == 0 and stats["zero_images"] == 0
    l2, l1 = grads.norm(dim=1).numpy(), grads.abs().sum(1).numpy()
    assert stats["l2_quantiles"]["0.5"] == pytest.approx(np.median(l2), rel=1e-4)
    assert stats["l1_quantiles"]["1.0"] == pytest.approx(l1.max(), rel=1e-4)
    assert check_input_gradients(stats, stats).verdict == "pass"


def test_quantized_model_flags_input_gradients(resnet, batch):
    images, labels = batch
    stats = input_gradient_stats(Quantized(resnet).eval(), images, labels)
    assert stats["zero_fraction"] == 1.0 and stats["zero_images"] == len(images)
    check = check_input_gradients(stats)
    assert check.verdict == "flag" and check.evidence["zero_indices"] == list(range(len(images)))


def test_vanishing_gradient_flags_only_against_the_baseline(resnet, batch):
    images, labels = batch
    baseline = input_gradient_stats(resnet, images, labels)
    stats = input_gradient_stats(Scaled(resnet, 1e-5).eval(), images, labels)
    assert stats["zero_fraction"] < 0.5 and stats["zero_images"] == 0
    assert check_input_gradients(stats).verdict == "pass"
    check = check_input_gradients(stats, baseline)
    assert check.verdict == "flag" and check.evidence["median_ratio"] < 1e-3


def test_nonfinite_gradient_flags(batch):
    images, labels = batch

    class Sqrt(nn.Module):   # d sqrt(x) / dx is inf at x = 0
        def forward(self, x):
            return torch.stack([x.sqrt().mean((1, 2, 3)), 1 - x.mean((1, 2, 3))], 1)

    x = images.clone()
    x[0, 0, 0, 0] = 0.0
    stats = input_gradient_stats(Sqrt().eval(), x, torch.zeros(len(x), dtype=torch.long))
    assert stats["nonfinite_images"] == 1
    assert check_input_gradients(stats).verdict == "flag"


# ------------------------------------------------------------------ loss along directions


def test_loss_sweep_matches_direct_evaluation(resnet, batch):
    images, labels = batch[0][:3], batch[1][:3]
    frame = loss_along_directions(resnet, images, labels, EPS, points=5, random_directions=2, seed=4,
                                  indices=[10, 11, 12])
    assert len(frame) == 3 * 5 * 3 and set(frame["direction"]) == {"grad_sign", "random_0", "random_1"}
    assert sorted(frame["t"].unique()) == pytest.approx([-EPS, -EPS / 2, 0, EPS / 2, EPS])
    sign = _manual_gradients(resnet, images, labels).view_as(images).sign().float()
    with torch.no_grad():
        clean = F.cross_entropy(resnet(images).double(), labels, reduction="none").numpy()
        ascended = F.cross_entropy(resnet((images + EPS * sign).clamp(0, 1)).double(), labels,
                                   reduction="none").numpy()
    for k, image in enumerate([10, 11, 12]):
        rows = frame[frame["image"] == image]
        assert rows.loc[rows["t"] == 0, "loss"].to_numpy() == pytest.approx([clean[k]] * 3, rel=1e-5)
        top = rows[(rows["direction"] == "grad_sign") & (rows["t"] == rows["t"].max())]["loss"].item()
        assert top == pytest.approx(ascended[k], rel=1e-4)
    again = loss_along_directions(resnet, images, labels, EPS, points=5, random_directions=2, seed=4,
                                  indices=[10, 11, 12])
    pd.testing.assert_frame_equal(frame, again)
    with pytest.raises(ValueError, match="odd"):
        loss_along_directions(resnet, images, labels, EPS, points=4)


def test_loss_saturation_flags_quantized_and_saturated_models(resnet, batch, bright_batch):
    images, labels = batch[0][:4], batch[1][:4]
    frame = loss_along_directions(Quantized(resnet).eval(), images, labels, 8 / 255, points=5, random_directions=2)
    check = check_loss_saturation(frame)
    assert check.verdict == "flag" and check.evidence["flat"] == 4
    grad = frame[frame["direction"] == "grad_sign"]
    assert grad.groupby("image")["loss"].nunique().eq(1).all()      # exactly constant along sign(0) = 0
    bright = loss_along_directions(Brightness().eval(), *bright_batch, 8 / 255, points=5, random_directions=2)
    assert check_loss_saturation(bright).evidence["flat"] == len(bright_batch[0])


def test_loss_saturation_flags_random_beating_gradient():
    t = np.linspace(-1, 1, 5)
    rows = [{"image": 0, "direction": "grad_sign", "t": v, "loss": 1 + 0.1 * v} for v in t]
    rows += [{"image": 0, "direction": "random_0", "t": v, "loss": 1 + v * v} for v in t]
    check = check_loss_saturation(pd.DataFrame(rows))
    assert check.verdict == "flag" and check.evidence["random_wins_indices"] == [0] and check.evidence["flat"] == 0
    only_grad = pd.DataFrame(rows[:5])
    assert check_loss_saturation(only_grad).verdict == "pass"


def test_plot_loss_along_directions(resnet, batch, tmp_path):
    pytest.importorskip("matplotlib")
    frame = loss_along_directions(resnet, batch[0][:2], batch[1][:2], EPS, points=3, random_directions=1)
    path = plot_loss_along_directions(frame, tmp_path / "sub" / "loss.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ a plain ResNet triggers none


def test_plain_resnet_triggers_no_check(resnet, batch, tmp_path):
    images, labels = batch
    eps = 1 / 255      # the white-box attack fools 6 of 8 here: the comparison is not settled by 100%
    white = _fooled(resnet, make_attack(AttackConfig("pgd", eps=eps, steps=5)).run(resnet, images, labels).adv, labels)
    assert 0 < white.mean() < 1
    # black-box: random sign noise at eps; transfer: PGD crafted on another ResNet
    noise = (images + eps * torch.sign(torch.randn(images.shape, generator=torch.Generator().manual_seed(5))))
    source = _tiny_resnet(seed=7)
    with torch.no_grad():
        source_labels = source(images).argmax(1)
    crafted = make_attack(AttackConfig("pgd", eps=eps, steps=5)).run(source, images, source_labels).adv
    idx = range(len(images))
    black = {"noise": _records(idx, _fooled(resnet, noise.clamp(0, 1), labels)),
             "transfer:seed7": _records(idx, _fooled(resnet, crafted, labels))}
    rates = {}
    for e in (0.2, 0.5, 1, 2):
        adv = make_attack(AttackConfig("pgd", eps=e / 255, steps=5)).run(resnet, images, labels).adv
        rates[f"eps{e}"] = float(_fooled(resnet, adv, labels).mean())
    checks = run_masking_checks(resnet, images, labels, EPS, white=_records(idx, white),
                                black=black, rates=rates, baseline=_tiny_resnet(seed=3), unbounded_steps=10,
                                plot_path=tmp_path / "loss.png")
    assert [c.name for c in checks] == ["blackbox_beats_whitebox", "unbounded_attack", "gain_with_strength",
                                        "input_gradients", "loss_saturation"]
    assert [c.verdict for c in checks] == ["pass"] * 5, [c.detail for c in checks if not c.passed]
    json.dumps([c.to_dict() for c in checks])
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_saturated_model_flags_every_model_check(bright_batch, resnet):
    images, labels = bright_batch
    model = Brightness().eval()
    rates = {}
    for eps in (2, 8, 32):
        adv = make_attack(AttackConfig("pgd", eps=eps / 255, steps=5)).run(model, images, labels).adv
        rates[eps] = float(_fooled(model, adv, labels).mean())
    checks = {c.name: c for c in run_masking_checks(model, images, labels, 8 / 255, rates=rates, unbounded_steps=5)}
    assert set(checks) == {"unbounded_attack", "gain_with_strength", "input_gradients", "loss_saturation"}
    assert all(c.verdict == "flag" for c in checks.values()), {n: c.detail for n, c in checks.items()}


# ------------------------------------------------------------------ the white-box follow-up
def test_whitebox_followup_is_apgd_t_then_fab_t_on_what_apgd_t_left():
    from robust_attn.attacks.masking.followup import whitebox_followup

    model, eps = _tiny_resnet(), 0.5 / 255
    gen = torch.Generator().manual_seed(3)
    images = torch.rand(8, 3, 32, 32, generator=gen)
    labels = model(images).argmax(1).detach()   # every image classified "correctly"
    indices = [4, 9, 17, 30, 31, 55, 56, 80]
    found = whitebox_followup(model, images, labels, indices, eps, steps=3, seed=2)
    assert found["index"].tolist() == indices and (found["eps"] == eps).all()
    # the reference: APGD-T on every image, FAB-T on the images it left, as AutoAttack runs them
    apgd_t = _fooled(model, make_attack(AttackConfig("apgd-t", eps=eps, steps=3, seed=2)).run(model, images,
                                                                                             labels).adv, labels)
    left = np.flatnonzero(apgd_t == 0)
    assert 0 < len(left) < len(images)   # both members have work to do here
    fab_t = _fooled(model, make_attack(AttackConfig("fab-t", eps=eps, steps=3, seed=2)).run(
        model, images[left], labels[left]).adv, labels[left])
    expected = np.where(apgd_t == 1, "apgd-t", "none").astype(object)
    expected[left[fab_t == 1]] = "fab-t"
    assert found["by"].tolist() == expected.tolist()


def test_the_followup_clears_only_the_images_it_fools():
    from robust_attn.attacks.masking.followup import apply_followup, contested, with_followup

    white = _records(range(8), [1, 0, 0, 0, 0, 1, 0, 0])          # APGD-CE alone
    black = _records(range(8), [1, 1, 1, 1, 0, 0, 0, 0])          # Square: beats it on 1, 2 and 3
    assert contested(white, black) == [1, 2, 3]
    followup = pd.DataFrame({"index": [1, 2, 3, 1], "eps": [EPS, EPS, EPS, 8 / 255],
                             "by": ["apgd-t", "none", "fab-t", "none"]})
    followed = apply_followup(white, followup, EPS)
    assert followed["success"].tolist() == [1, 1, 0, 1, 0, 1, 0, 0]   # only the radius asked for
    assert white["success"].tolist() == [1, 0, 0, 0, 0, 1, 0, 0]      # the caller's records untouched
    check = with_followup(check_blackbox_beats_whitebox({"square": followed}, {"square": black}),
                          {"square": ([1, 2, 3], followup[(followup["eps"] - EPS).abs() < 1e-9])})
    assert check.verdict == "flag" and check.evidence["square"]["beats"] == 1
    assert check.evidence["square"]["indices"] == [2]
    assert check.evidence["square"]["followup"] == {"beat_white_box": 3, "apgd-t": 1, "fab-t": 1}
    assert "APGD-T fooled 1 and FAB-T 1" in check.detail
    cleared = apply_followup(white, followup.assign(by=["apgd-t", "fab-t", "fab-t", "none"]), EPS)
    assert check_blackbox_beats_whitebox({"square": cleared}, {"square": black}).verdict == "pass"


# ------------------------------------------------------------------ near misses of a working gradient
def test_margins_are_the_label_logit_minus_the_largest_other_before_and_after_pgd_from_the_clean_image():
    from robust_attn.attacks.masking.near_miss import margins

    model, eps = _tiny_resnet(), 0.5 / 255
    images = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    labels = model(images).argmax(1).detach()
    got = margins(model, images, labels, [3, 5, 8, 13, 21, 34], eps, steps=3, seed=1, batch_size=4)
    assert got["index"].tolist() == [3, 5, 8, 13, 21, 34] and (got["eps"] == eps).all()
    pgd = make_attack(AttackConfig("pgd", eps=eps, steps=3, seed=1, options={"random_start": False}))
    adv = pgd.run(model, images, labels).adv   # PGD's steps do not depend on the batch
    for column, x in (("clean_margin", images), ("margin", adv)):
        with torch.no_grad():
            logits = model(x).double()
        others = logits.masked_fill(torch.nn.functional.one_hot(labels, 10).bool(), float("-inf"))
        expected = logits[torch.arange(6), labels] - others.max(1).values
        np.testing.assert_allclose(got[column].to_numpy(), expected.numpy(), rtol=0, atol=1e-9)
    assert (got["clean_margin"] > 0).all() and (got["margin"] < got["clean_margin"]).all()   # PGD moved them


def test_a_near_miss_is_an_image_whose_margin_the_attack_closed_by_half():
    from robust_attn.attacks.masking.near_miss import near_misses

    records = pd.DataFrame({"index": [0, 1, 2, 3, 4, 0], "eps": [EPS] * 5 + [8 / 255],
                            "clean_margin": [2.0, 2.0, 2.0, 1.0, -0.5, 2.0],
                            "margin": [1.0, 1.01, -0.2, 0.9, -1.0, 0.1]})
    assert near_misses(records, EPS) == {0, 2}      # half closed, or crossed; 1 and 3 are short of half
    assert near_misses(records, 8 / 255) == {0}
    assert near_misses(records, EPS, share=0.05) == {0, 1, 2, 3}   # 4: misclassified clean, no margin to close


def test_near_misses_are_reported_apart_and_do_not_flag():
    """On 300 images, where near misses on three images are rare enough (1%)."""
    rest = [0] * 294
    white = _records(range(300), [1, 0, 0, 0, 0, 0] + rest)
    black = {"square": _records(range(300), [1, 1, 1, 0, 0, 0] + rest),
             "transfer": _records(range(300), [0, 0, 1, 1, 0, 0] + rest)}
    flagged = check_blackbox_beats_whitebox(white, black, near={"square": {1}})
    assert flagged.verdict == "flag"
    assert flagged.evidence["square"] == {"compared": 300, "black_success": 3, "white_success": 1, "beats": 1,
                                          "indices": [2], "near_misses": 1, "near_miss_indices": [1],
                                          "near_misses_counted": False,
                                          "near_miss_rule": {"near_miss": 0.5, "rare": 0.01}}
    assert flagged.evidence["transfer"]["beats"] == 2 and "near_misses" not in flagged.evidence["transfer"]
    cleared = check_blackbox_beats_whitebox(white, black, near={"square": {1, 2}, "transfer": {2, 3, 5}})
    assert cleared.verdict == "pass" and cleared.evidence["transfer"]["near_misses"] == 2
    assert cleared.detail.startswith("the white-box attack fools every image the black-box/transfer attacks fool, "
                                     "near misses aside (square: 300 compared; transfer: 300 compared); near misses of "
                                     "the white-box attack, not counted")
    assert cleared.detail.endswith("their clean margin): square: 2; transfer: 2")
    per_source = check_blackbox_beats_whitebox(white, black, near={"square": {1, 2}, "transfer": {3}})
    assert per_source.verdict == "flag" and per_source.evidence["transfer"]["indices"] == [2]   # not square's


def test_near_misses_count_again_once_they_are_not_rare():
    """Past 1% of the images compared (one image always passes) every near miss counts as a beat:
    a gradient that keeps stopping short where a black-box attack crosses is what masking looks like."""
    from robust_attn.attacks.masking.near_miss import RARE, excused

    assert RARE == 0.01
    assert excused(1, 6) and not excused(2, 6) and excused(2, 200) and not excused(3, 200)
    assert excused(10, 1000) and not excused(11, 1000) and excused(11, 1000, rare=0.02)
    white = _records(range(200), [0] * 200)
    black = {"square": _records(range(200), [1, 1, 1, 1] + [0] * 196)}
    rare = check_blackbox_beats_whitebox(white, black, near={"square": {0, 1}})
    assert rare.verdict == "flag" and rare.evidence["square"]["beats"] == 2   # images 2 and 3: no near misses
    many = check_blackbox_beats_whitebox(white, black, near={"square": {0, 1, 2}})
    assert many.verdict == "flag" and many.evidence["square"]["beats"] == 4
    assert many.evidence["square"]["indices"] == [0, 1, 2, 3] and many.evidence["square"]["near_misses_counted"]
    assert many.detail.endswith("counted among them: near misses on 3 of the 200 images compared, more than 1% (a "
                                "gradient that keeps stopping short of the boundary where a black-box attack crosses "
                                "it): square: 3")
    cleared = check_blackbox_beats_whitebox(white, {"square": _records(range(200), [1, 1, 0] + [0] * 197)},
                                            near={"square": {0, 1}})
    assert cleared.verdict == "pass" and cleared.evidence["square"]["near_misses"] == 2
    # the bound is the model's: two sources with two near misses each, on four images, are too many
    sources = {name: _records(range(200), won + [0] * 196) for name, won in (("square", [1, 1, 0, 0]),
                                                                              ("transfer", [0, 0, 1, 1]))}
    spread = check_blackbox_beats_whitebox(white, sources, near={"square": {0, 1}, "transfer": {2, 3}})
    assert spread.verdict == "flag" and [e["beats"] for e in spread.evidence.values()] == [2, 2]
    assert "near misses on 4 of the 200 images compared" in spread.detail
    shared = check_blackbox_beats_whitebox(white, {"square": sources["square"], "aa": sources["square"]},
                                           near={"square": {0, 1}, "aa": {0, 1}})
    assert shared.verdict == "pass"   # the same two images for both sources: two images in all
