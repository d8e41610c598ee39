"""Occlusion and patch shuffling (Naseer et al. 2021; robust_attn/shifts/occlusion.py, shuffle.py)."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import torch.nn as nn

from robust_attn.data.base import TensorImageDataset
from robust_attn.shifts.occlusion import drop_patches, occlude_square, square_side
from robust_attn.shifts.shuffle import from_patches, shuffle_patches, to_patches


def _images(n=4, c=3, h=32, w=32):
    return torch.rand(n, c, h, w, generator=torch.Generator().manual_seed(0)) * 0.8 + 0.1  # no pixel is 0


@pytest.mark.parametrize("percent", [1, 10, 25, 50, 75, 100])
def test_square_covers_the_stated_share(percent):
    images = _images()
    out = occlude_square(images, percent, indices=[0, 1, 2, 3], seed=3)
    side = square_side(percent, 32, 32)
    covered = (out == 0).all(dim=1)   # a filled pixel is 0 in every channel
    assert (covered.flatten(1).sum(1) == side * side).all()
    assert abs(side * side / 1024 - percent / 100) <= (2 * side + 1) / 1024   # k% up to rounding the side
    # one solid square per image, the rest untouched
    for k in range(4):
        rows, cols = covered[k].nonzero(as_tuple=True)
        assert rows.max() - rows.min() + 1 == side and cols.max() - cols.min() + 1 == side
        assert torch.equal(out[k][:, ~covered[k]], images[k][:, ~covered[k]])


def test_square_is_seeded_per_image_and_fills_with_the_mean():
    images = _images()
    a = occlude_square(images, 25, [5, 6, 7, 8], seed=1)
    assert torch.equal(a, occlude_square(images, 25, [5, 6, 7, 8], seed=1))
    assert torch.equal(a[2:3], occlude_square(images[2:3], 25, [7], seed=1))   # same image alone
    assert not torch.equal(a, occlude_square(images, 25, [5, 6, 7, 8], seed=2))
    mean = (0.25, 0.5, 0.75)
    filled = occlude_square(images, 25, [5, 6, 7, 8], seed=1, fill=mean)
    where = (a == 0).all(dim=1)
    for c, value in enumerate(mean):
        assert (filled[:, c][where] == value).all()


@pytest.mark.parametrize("grid,percent,cells", [(4, 25, 4), (4, 50, 8), (8, 75, 48), (2, 100, 4)])
def test_patch_drop_blanks_whole_cells(grid, percent, cells):
    images = _images()
    out = drop_patches(images, grid, percent, [0, 1, 2, 3], seed=0)
    size = 32 // grid
    blank = (out == 0).all(dim=1).reshape(4, grid, size, grid, size).permute(0, 1, 3, 2, 4).flatten(3)
    per_cell = blank.float().mean(-1)   # 1: the whole cell dropped, 0: untouched
    assert ((per_cell == 0) | (per_cell == 1)).all()
    assert (per_cell.flatten(1).sum(1) == cells).all()
    assert (out == 0).all(dim=1).flatten(1).float().mean(1).eq(cells / grid ** 2).all()


def test_shuffle_with_one_patch_is_the_identity():
    images = _images()
    assert torch.equal(shuffle_patches(images, 1, [0, 1, 2, 3], seed=9), images)


@pytest.mark.parametrize("grid", [2, 4, 8])
def test_shuffle_permutes_patches(grid):
    images = _images()
    out = shuffle_patches(images, grid, [0, 1, 2, 3], seed=0)
    assert torch.equal(from_patches(to_patches(images, grid), grid), images)
    before, after = to_patches(images, grid).flatten(2), to_patches(out, grid).flatten(2)
    for k in range(4):   # the same patches, each once, in another order
        match = (after[k][:, None] == before[k][None]).all(-1)
        assert match.sum(1).eq(1).all() and match.sum(0).eq(1).all()
        assert not torch.equal(match, torch.eye(grid * grid, dtype=torch.bool))
    assert torch.equal(out, shuffle_patches(images, grid, [0, 1, 2, 3], seed=0))
    assert not torch.equal(out, shuffle_patches(images, grid, [0, 1, 2, 3], seed=1))


def test_patch_order_is_row_major():
    image = torch.arange(16.0).reshape(1, 1, 4, 4)
    patches = to_patches(image, 2)
    assert patches[0, 1, 0].tolist() == [[2.0, 3.0], [6.0, 7.0]]   # the top-right patch is second


@pytest.mark.parametrize("call,message", [
    (lambda x: shuffle_patches(x, 3, [0, 1, 2, 3]), "does not divide the 32x32 image"),
    (lambda x: drop_patches(x, 5, 50, [0, 1, 2, 3]), "does not divide"),
    (lambda x: occlude_square(x, 0, [0, 1, 2, 3]), r"percentage in \(0, 100\]"),
    (lambda x: occlude_square(x, 120, [0, 1, 2, 3]), r"percentage in \(0, 100\]"),
    (lambda x: drop_patches(x, 4, -5, [0, 1, 2, 3]), "dropped fraction"),
    (lambda x: occlude_square(x, 10, [0, 1, 2, 3], fill="grey"), "fill must be"),
])
def test_bad_input_is_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(_images())


def test_protocol_spec_files_agree_with_the_code():
    """protocols/occlusion.toml and shuffle.toml: the settings the protocols and the study run."""
    import math
    import sys
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    from robust_attn.protocols import occlusion, shuffle
    from robust_attn.study.config import StudyConfig

    root = Path(__file__).resolve().parents[1] / "protocols"
    occ = tomllib.loads((root / "occlusion.toml").read_text())
    shuf = tomllib.loads((root / "shuffle.toml").read_text())
    assert occ["protocol"]["name"] == occlusion.PROTOCOL and shuf["protocol"]["name"] == shuffle.PROTOCOL
    assert occ["square"]["areas"] == list(occlusion.DEFAULT_AREAS) == list(StudyConfig().occlusion_areas)
    assert occ["patchdrop"]["grid"] == occlusion.DEFAULT_DROP_GRID
    assert occ["patchdrop"]["dropped"] == list(occlusion.DEFAULT_DROP)
    assert occ["fill"]["kinds"] == list(occlusion.FILLS)
    for k in occ["square"]["areas"]:
        assert square_side(k, 32, 32) == round(math.sqrt(k / 100 * 32 * 32))
    names = [c["name"] for c in occlusion.occlusion_conditions(image_size=(32, 32))]
    assert names == ["clean"] + [f"square{k}_{f}" for k in occ["square"]["areas"] for f in occ["fill"]["kinds"]] + [
        f"drop4x4_{d}_{f}" for d in occ["patchdrop"]["dropped"] for f in occ["fill"]["kinds"]]
    assert shuf["shuffle"]["grids"] == list(shuffle.DEFAULT_GRIDS) == list(StudyConfig().shuffle_grids)
    assert [c["name"] for c in shuffle.shuffle_conditions(image_size=(32, 32))][1:] == [
        f"shuffle{g}" for g in shuf["shuffle"]["grids"]]


class _Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(x.detach().clone())
        return torch.zeros(len(x), 10)


def test_occlusion_protocol_fills_the_mean_condition_with_the_given_colour(tmp_path):
    from robust_attn.protocols.occlusion import occlusion_conditions, run_occlusion

    images = torch.full((2, 3, 8, 8), 255, dtype=torch.uint8)      # white images
    dataset = TensorImageDataset(images, torch.zeros(2, dtype=torch.long))
    conditions = occlusion_conditions(areas=(25.0,), fills=("mean",), drop=(), image_size=(8, 8))
    assert [c["name"] for c in conditions] == ["clean", "square25_mean"]
    model = _Recorder()
    mean = (0.2, 0.4, 0.6)
    run_occlusion(model, dataset, tmp_path / "run", conditions=conditions, mean=mean, batch_size=2, progress=False)
    assert len(model.seen) == 2
    occluded = model.seen[1]
    # a 4x4 square (25% of 8x8) per image, filled with the mean colour; the rest stays white
    for k in range(2):
        filled = (occluded[k] != 1).any(0)
        assert int(filled.sum()) == 16
        colour = occluded[k][:, filled]
        torch.testing.assert_close(colour, torch.tensor(mean).view(3, 1).expand(3, 16))


def test_patch_permutations_draw_from_the_documented_streams():
    from robust_attn.shifts.shuffle import patch_permutations

    for grid in (2, 4):
        perms = patch_permutations(grid, [0, 7], seed=3)
        for row, index in zip(perms, (0, 7)):
            rng = np.random.default_rng([3, zlib.crc32(f"shuffle{grid}".encode()), index])
            assert row.tolist() == rng.permutation(grid * grid).tolist()
