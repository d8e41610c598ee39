"""Rotation/flip protocol (SAN section 5.4, Table 9): directions, equivalences, records, drops."""
from __future__ import annotations

import math
import sys

import pandas as pd
import pytest
import torch
import torch.nn as nn

from robust_attn.data import build_dataset
from robust_attn.protocols.rotation import run_rotation, summarize_rotation
from robust_attn.shifts.rotation import (PAPER_CONDITIONS, apply_condition, flip_left_right, flip_upside_down,
                                         rotate_angle, rotate_clockwise, rotation_conditions)
from robust_attn.models.registry import create_model
from robust_attn.runs.store import load_records
from robust_attn.models.wrapper import NormalizedModel


def _asym(h=3, w=4):
    return torch.arange(h * w, dtype=torch.float32).view(1, 1, h, w)


def test_clockwise_90_moves_top_left_to_top_right():
    img = torch.zeros(1, 1, 3, 3)
    img[..., 0, 0] = 1.0  # top-left
    out = rotate_clockwise(img, 1)
    assert out[0, 0, 0, 2] == 1 and out.sum() == 1  # now top-right
    assert rotate_clockwise(img, 2)[0, 0, 2, 2] == 1  # bottom-right
    assert rotate_clockwise(img, 3)[0, 0, 2, 0] == 1  # bottom-left
    # and torch.rot90(k=1) is the counter-clockwise one
    assert torch.rot90(img, 1, (-2, -1))[0, 0, 2, 0] == 1


def test_clockwise_matches_pixel_formula_on_non_square_image():
    img = _asym(3, 5)
    h, w = 3, 5
    out = rotate_clockwise(img, 1)
    assert out.shape[-2:] == (w, h)
    for i in range(w):
        for j in range(h):
            assert out[0, 0, i, j] == img[0, 0, h - 1 - j, i]


def test_flips_and_full_turns():
    img = _asym(4, 4)
    assert torch.equal(flip_upside_down(img)[0, 0, 0], img[0, 0, -1])  # top row is the old bottom row
    assert torch.equal(flip_left_right(img)[0, 0, :, 0], img[0, 0, :, -1])
    four = img
    for _ in range(4):
        four = rotate_clockwise(four, 1)
    assert torch.equal(four, img)
    assert torch.equal(rotate_clockwise(rotate_clockwise(img, 1), 3), img)
    assert torch.equal(rotate_clockwise(img, 2), flip_upside_down(flip_left_right(img)))
    # upside-down flip is not a rotation of this asymmetric image
    assert not torch.equal(flip_upside_down(img), rotate_clockwise(img, 2))


def _reference_rotate(img: torch.Tensor, degrees: float) -> torch.Tensor:
    """Slow per-pixel clockwise rotation about the centre, bilinear, zeros outside."""
    _, _, h, w = img.shape
    out = torch.zeros_like(img)
    t = math.radians(degrees)
    cy, cx = (h - 1) / 2, (w - 1) / 2
    for i in range(h):
        for j in range(w):
            x, y = j - cx, i - cy
            # inverse of a clockwise turn on screen (y down)
            xs, ys = math.cos(t) * x + math.sin(t) * y + cx, -math.sin(t) * x + math.cos(t) * y + cy
            x0, y0 = math.floor(xs), math.floor(ys)
            for yy, wy in ((y0, 1 - (ys - y0)), (y0 + 1, ys - y0)):
                for xx, wx in ((x0, 1 - (xs - x0)), (x0 + 1, xs - x0)):
                    if 0 <= yy < h and 0 <= xx < w:
                        out[..., i, j] += wy * wx * img[..., yy, xx]
    return out


@pytest.mark.parametrize("degrees", [30.0, 135.0])
def test_angle_rotation_matches_slow_reference(degrees):
    img = torch.rand(1, 2, 7, 9, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(rotate_angle(img, degrees), _reference_rotate(img, degrees), atol=1e-5, rtol=0)


def test_angle_rotation_at_multiples_of_90_is_the_exact_rotation():
    img = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    for k in range(4):
        torch.testing.assert_close(rotate_angle(img, 90.0 * k), rotate_clockwise(img, k), atol=1e-5, rtol=0)
    # off the 90s the corners come from outside the image (zero fill); the centre stays
    corner = rotate_angle(torch.ones(1, 1, 9, 9), 45.0)
    assert corner[0, 0, 0, 0] < 0.05 and corner[0, 0, 4, 4] == pytest.approx(1.0)


def test_conditions_list():
    conds = rotation_conditions(angle_step=15)
    names = [c.name for c in conds]
    assert names[:5] == ["none", "cw90", "cw180", "cw270", "flip_ud"] and names[5] == "flip_lr"
    angles = [c.angle for c in conds if c.kind == "angle"]
    assert len(angles) == 24 - 4 and all(a % 90 for a in angles) and angles[0] == 15
    assert all(c.interpolation == "bilinear" and c.fill == "zeros" for c in conds if c.kind == "angle")
    assert [c.name for c in rotation_conditions(0, hflip=False)] == [c.name for c in PAPER_CONDITIONS]
    with pytest.raises(ValueError, match="angle-step"):
        rotation_conditions(-5)


class PixelMean(nn.Module):
    """Rotation- and flip-invariant by construction: global average of pixels -> linear."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.fc = nn.Linear(3, num_classes)

    def forward(self, x):
        return self.fc(x.mean(dim=(2, 3)))


def _synthetic(limit=12):
    return build_dataset("synthetic", split="test", limit=limit)


def test_invariant_model_loses_nothing(tmp_path):
    model = NormalizedModel(PixelMean(), (0.5,) * 3, (0.25,) * 3)
    store = run_rotation(model, _synthetic(), tmp_path / "run", conditions=rotation_conditions(90),
                         batch_size=5, progress=False)
    summary = summarize_rotation(load_records(store.root)).set_index("condition")
    assert list(summary.index) == ["none", "cw90", "cw180", "cw270", "flip_ud", "flip_lr"]
    assert (summary["top1_drop"] == 0).all() and (summary["top5_drop"] == 0).all()
    records = load_records(store.root)
    preds = records.pivot(index="index", columns="condition", values="pred")
    assert (preds.nunique(axis=1) == 1).all()  # same prediction for every image under every condition


def test_records_and_drops_match_an_independent_computation(tmp_path):
    torch.manual_seed(0)
    model = NormalizedModel(create_model("resnet26", num_classes=10, resolution="cifar", width=0.25),
                            (0.5,) * 3, (0.25,) * 3).eval()
    dataset = _synthetic(6)
    conds = rotation_conditions(120, hflip=False)  # the paper's five plus 120 and 240
    store = run_rotation(model, dataset, tmp_path / "run", conditions=conds, batch_size=4, progress=False)
    records = load_records(store.root)
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    labels = torch.tensor([dataset[i][1] for i in range(len(dataset))])
    expected = {}
    with torch.no_grad():
        for cond in conds:
            logits = model(apply_condition(images, cond))
            rec = records[records["condition"] == cond.name].sort_values("index")
            assert rec["pred"].tolist() == logits.argmax(1).tolist()
            top5 = [int(labels[i] in logits[i].topk(5).indices) for i in range(len(labels))]
            assert rec["top5"].tolist() == top5
            expected[cond.name] = (100 * (logits.argmax(1) == labels).float().mean().item(),
                                   100 * sum(top5) / len(top5))
    summary = summarize_rotation(records).set_index("condition")
    for name, (top1, top5) in expected.items():
        assert summary.loc[name, "top1"] == pytest.approx(top1)
        assert summary.loc[name, "top1_drop"] == pytest.approx(expected["none"][0] - top1)
        assert summary.loc[name, "top5_drop"] == pytest.approx(expected["none"][1] - top5)


def test_protocol_spec_file_agrees_with_the_code():
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    from pathlib import Path

    spec = tomllib.loads((Path(__file__).resolve().parents[1] / "protocols" / "rotation.toml").read_text())
    assert [(c["name"], c["kind"], c["angle"]) for c in spec["paper"]["conditions"]] == \
        [(c.name, c.kind, c.angle) for c in PAPER_CONDITIONS]
    extra = spec["extra"]
    conds = rotation_conditions(extra["angle_step"], hflip=extra["hflip"])
    assert [c.name for c in rotation_conditions()] == [c.name for c in conds]  # the defaults
    assert {(c.interpolation, c.fill) for c in conds if c.kind == "angle"} == {(extra["interpolation"], extra["fill"])}


def test_rotation_drop_is_positive_when_accuracy_falls():

    records = pd.DataFrame({"condition": ["none"] * 4 + ["cw90"] * 4,
                            "top1": [1, 1, 1, 0, 1, 0, 0, 0], "top5": [1, 1, 1, 1, 1, 1, 0, 0]})
    summary = summarize_rotation(records).set_index("condition")
    assert summary.loc["none", "top1"] == 75 and summary.loc["cw90", "top1"] == 25
    assert summary.loc["cw90", "top1_drop"] == 50 and summary.loc["cw90", "top5_drop"] == 50
    assert summary.loc["none", "top1_drop"] == 0
