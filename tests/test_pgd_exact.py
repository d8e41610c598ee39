"""Exact mode of targeted PGD: native, torchattacks and foolbox
give bit-identical images at any batch size, and ``run_pgd`` / ``eval pgd --exact`` reach it."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from robust_attn.attacks import BACKENDS, PGDConfig, draw_targets, targeted_pgd
from robust_attn.attacks.targeted_pgd import power_of_two_blocks
from robust_attn.models.wrapper import NormalizedModel

CFG = PGDConfig(8, 2, 4)  # SAN Table 10 {eps, rho, n}
from helpers import tiny_resnet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _tiny_resnet(seed: int = 1, **overrides) -> NormalizedModel:
    return tiny_resnet(seed, **overrides)


def _shift_model(seed: int = 0) -> nn.Module:
    """A linear model whose second half of input pixels adds the same amount to every logit.

    Along such a pixel the cross-entropy's gradient is exactly zero in real arithmetic
    (softmax - onehot sums to 0), so its float32 sign is rounding noise: the worst case for
    agreement, and a sensitive probe of whether two backends round identically.
    """
    gen = torch.Generator().manual_seed(seed)
    d = 3 * 8 * 8
    weight = 0.05 * torch.randn(10, d, generator=gen)
    weight[:, d // 2:] = torch.randn(1, d - d // 2, generator=gen)
    model = nn.Sequential(nn.Flatten(), nn.Linear(d, 10)).eval()
    model[1].weight.data = weight
    return model


def _batch(model, n: int, shape=(3, 32, 32), seed: int = 3):
    images = torch.rand(n, *shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        labels = model(images).argmax(1)
    return images, labels, torch.as_tensor(draw_targets(labels, 10, seed=0)).long()


def _differing_images(a: torch.Tensor, b: torch.Tensor) -> int:
    return int(((a - b).flatten(1).abs().amax(1) > 0).sum())


def _input_grad(model, images, targets, reduction: str) -> torch.Tensor:
    """torchattacks' gradient (-mean CE) or foolbox's / native's (sum CE)."""
    x = images.clone().requires_grad_(True)
    loss = F.cross_entropy(model(x), targets, reduction=reduction)
    return torch.autograd.grad(-loss if reduction == "mean" else loss, x)[0]


# ---------------------------------------------------------------- blocks


@pytest.mark.parametrize("n", [1, 2, 7, 8, 14, 50, 60, 64, 255])
def test_power_of_two_blocks_tile_the_batch(n):
    blocks = power_of_two_blocks(n)
    sizes = [stop - start for start, stop in blocks]
    assert all(s & (s - 1) == 0 for s in sizes)                     # each a power of two
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert blocks[0][0] == 0 and blocks[-1][1] == n                  # contiguous cover of [0, n)
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    assert len(blocks) == bin(n).count("1")
    assert power_of_two_blocks(0) == []


# ---------------------------------------------------------------- the cause


def test_mean_and_sum_losses_round_alike_only_at_power_of_two_batch_sizes():
    """Why the split is needed: at N = 16 the mean-loss gradient is the sum-loss one times 1/16 bit
    for bit; at N = 14 rounding differs and signs of near-zero entries flip."""
    model = _shift_model()
    for p in model.parameters():
        p.requires_grad_(False)
    x16, _, t16 = _batch(model, 16, (3, 8, 8))
    g_sum, g_mean = _input_grad(model, x16, t16, "sum"), _input_grad(model, x16, t16, "mean")
    assert torch.equal(g_sum * (1.0 / 16), -g_mean)
    x14, _, t14 = _batch(model, 14, (3, 8, 8))
    g_sum, g_mean = _input_grad(model, x14, t14, "sum"), _input_grad(model, x14, t14, "mean")
    assert (g_sum.sign() != -g_mean.sign()).sum() > 0


@pytest.mark.parametrize("n", [14, 50, 60])
def test_exact_mode_agrees_where_the_raw_libraries_do_not(n):
    """On the rounding-noise model the raw libraries (whole batch; torchattacks' mean loss,
    foolbox's sum) disagree at these sizes; in exact mode all three backends are bit-identical."""
    model = _shift_model()
    images, labels, targets = _batch(model, n, (3, 8, 8))
    raw = {b: targeted_pgd(model, images, targets, CFG, backend=b) for b in ("torchattacks", "foolbox")}
    assert _differing_images(raw["torchattacks"], raw["foolbox"]) > 0
    exact = {b: targeted_pgd(model, images, targets, CFG, backend=b, labels=labels, exact=True) for b in BACKENDS}
    for b in BACKENDS[1:]:
        assert torch.equal(exact[b], exact["native"]), b


# ---------------------------------------------------------------- agreement on a resnet


@pytest.fixture(scope="module")
def resnet():
    return _tiny_resnet(stem_downsample=4)


@pytest.mark.parametrize("n", [14, 50, 60])
def test_exact_backends_bit_identical_at_ragged_batch_sizes(resnet, n):
    images, labels, targets = _batch(resnet, n)
    images[0, :, :4] = 0.0  # pixels on the [0, 1] boundary exercise the clamp
    images[1, :, :4] = 1.0
    advs = {b: targeted_pgd(resnet, images, targets, CFG, backend=b, labels=labels, exact=True) for b in BACKENDS}
    for b in BACKENDS[1:]:
        assert torch.equal(advs[b], advs["native"]), (b, _differing_images(advs[b], advs["native"]))
    # the attack did move the images, to the eps-ball's surface
    assert (advs["native"] - images).abs().amax().item() == pytest.approx(CFG.eps_abs, abs=1e-6)


def test_exact_mode_keeps_the_callers_memory_layout():
    """The libraries attack a channels-last batch in channels-last layout (their clone keeps it);
    convolving it contiguously instead rounds differently and moves some images (checked here),
    so the exact native attack keeps the layout too."""
    model = _tiny_resnet()
    images, labels, targets = _batch(model, 48)  # two blocks (32 + 16): slices keep the layout
    images_cl = images.contiguous(memory_format=torch.channels_last)
    advs = {b: targeted_pgd(model, images_cl, targets, CFG, backend=b, labels=labels, exact=True)
            for b in BACKENDS}
    for b in BACKENDS[1:]:
        assert torch.equal(advs[b], advs["native"]), (b, _differing_images(advs[b], advs["native"]))
    contiguous = targeted_pgd(model, images, targets, CFG, backend="native", exact=True)
    assert _differing_images(contiguous, advs["native"]) > 0  # the layout does matter here


# ---------------------------------------------------------------- protocol and CLI


def test_run_pgd_exact_records_agree_across_backends_with_a_ragged_last_chunk(tmp_path, resnet):
    from robust_attn.protocols.pgd import AttackSetting, run_pgd
    from robust_attn.runs.store import load_records

    images, labels, _ = _batch(resnet, 20, seed=5)
    dataset = TensorDataset(images, labels)
    frames = {}
    for backend in BACKENDS:
        store = run_pgd(resnet, dataset, tmp_path / backend, num_classes=10, settings=[AttackSetting(8, 2, 4)],
                        backend=backend, batch_size=14, progress=False, checks=False, exact=True)
        desc = json.loads((store.root / "run.json").read_text())
        assert desc["parameters"]["exact"] is True and desc["parameters"]["backend"] == backend
        frames[backend] = load_records(store.root).sort_values(["condition", "index"]).reset_index(drop=True)
    for backend in BACKENDS[1:]:
        assert frames[backend].equals(frames["native"]), backend
    assert (frames["native"]["condition"] != "clean").sum() == 20
    default = run_pgd(resnet, dataset, tmp_path / "default", num_classes=10, settings=[AttackSetting(8, 2, 4)],
                      batch_size=14, progress=False, checks=False)
    assert json.loads((default.root / "run.json").read_text())["parameters"]["exact"] is False
    with pytest.raises(TypeError, match="exact must be a bool"):
        run_pgd(resnet, dataset, tmp_path / "bad", num_classes=10, exact="yes", progress=False, checks=False)


def test_cli_exact_flag_reaches_run_pgd(tmp_path, monkeypatch):
    """``robust-attn eval pgd --exact`` (the eval command's own parser) passes exact=True on."""
    import argparse

    import robust_attn.protocols.pgd as protocol
    from robust_attn.commands import eval as eval_cmd

    def main(argv):
        parser = argparse.ArgumentParser()
        eval_cmd.add_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(argv)
        return args.func(args)

    seen = []
    real = protocol.run_pgd

    def spy(*args, **kwargs):
        seen.append(kwargs.get("exact"))
        return real(*args, **kwargs)

    monkeypatch.setattr(protocol, "run_pgd", spy)
    common = ["eval", "pgd", "--model", "resnet26", "--model-args", "width=0.25", "--dataset", "synthetic",
              "--no-progress", "--limit", "2", "--batch-size", "2", "--steps", "1", "--no-checks"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*common, "--exact", "--out", str(tmp_path / "e")]) == 0
        assert main([*common, "--out", str(tmp_path / "d")]) == 0
    assert seen == [True, False]
    assert json.loads((tmp_path / "e" / "run.json").read_text())["parameters"]["exact"] is True
