"""Our 19 corruptions against stored outputs of the reference, ``imagecorruptions`` 1.1.2
(Hendrycks & Dietterich's functions for any image size), at 32 and 224 px and severities 1-5,
on the same random draws: this runs in every install, without the optional extra.

The fixtures (``tests/fixtures/corruptions_{32,224}.npz``, the versions that wrote them in
``corruptions.versions.txt``) were written by ``tests/fixtures/make_corruption_fixtures.py``
with the reference's ``numpy.random`` calls answered by :class:`corruption_draws.SharedDraws`;
here ours gets a ``SharedDraws`` of the same seed as its generator, so both see the same numbers
(see that module for how). The tolerance is one grey level: float rounding before the
reference's truncation to uint8, and for frost OpenCV's fixed-point bicubic resize.

Frost is checked twice: with six small noise photographs stored in the fixture (every run), and
with Hendrycks' photographs, which robust-attn does not ship: that comparison skips, saying so,
where they are not installed. ``test_corruptions_reference.py`` compares with the live package
where it is importable.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from corruption_draws import KINDS, SharedDraws
from helpers import stored_frost_photographs
from robust_attn.shifts.corruptions import COMMON, EXTRA, corrupt_batch
from robust_attn.shifts.corruptions import weather

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TOLERANCE = 1


def load(size: int) -> dict:
    with np.load(FIXTURES / f"corruptions_{size}.npz", allow_pickle=False) as packed:
        return {key: packed[key] for key in packed.files}


@pytest.fixture(scope="module")
def fixtures():
    return {size: load(size) for size in (32, 224)}


@pytest.fixture
def synthetic_frost(monkeypatch, tmp_path):
    """$ROBUST_ATTN_FROST_DIR pointed at the fixture's six noise photographs."""
    monkeypatch.setenv(weather.FROST_ENV, str(stored_frost_photographs(tmp_path)))
    weather.frost_image.cache_clear()
    yield
    weather.frost_image.cache_clear()


def compare(data: dict, name: str, stored: str | None = None) -> None:
    """Every severity and image of ``data`` (one size's fixture) for corruption ``name``
    (fixture entry ``stored``, default the name): same draw counts, outputs within
    :data:`TOLERANCE`."""
    stored = stored or name
    n = list(data["names"]).index(stored)
    start, step = data["subsample"]
    report = {}
    for s in range(1, 6):
        for k, image in enumerate(data["inputs"]):
            draws = SharedDraws(int(data["seeds"][n, s - 1, k]))
            ours = corrupt_batch(image[None], name, s, rngs=[draws])[0][start::step, start::step]
            counted = [kind for kind in KINDS if kind != "random"]
            assert [draws.taken[kind] for kind in counted] == [
                int(data["taken"][n, s - 1, k, KINDS.index(kind)]) for kind in counted], \
                f"{name} severity {s}: ours drew other numbers of values than the reference"
            report[s, k] = int(np.abs(ours.astype(int) - data[stored][s - 1, k].astype(int)).max())
    assert max(report.values()) <= TOLERANCE, f"max grey-level difference per (severity, image): {report}"


@pytest.mark.parametrize("size", [32, 224])
@pytest.mark.parametrize("name", [n for n in COMMON + EXTRA if n != "frost"])
def test_matches_the_stored_reference(fixtures, name, size):
    compare(fixtures[size], name)


@pytest.mark.parametrize("size", [32, 224])
def test_frost_matches_the_stored_reference_with_stored_photographs(fixtures, synthetic_frost, size):
    compare(fixtures[size], "frost", "frost_synthetic")


@pytest.mark.parametrize("size", [32, 224])
def test_frost_matches_the_stored_reference_with_hendrycks_photographs(fixtures, size):
    try:
        weather.frost_dir()
    except FileNotFoundError:
        pytest.skip("frost with Hendrycks' photographs: not installed here (robust-attn does not ship them; "
                    "pip install imagecorruptions or set $ROBUST_ATTN_FROST_DIR); the same code is checked "
                    "with the fixture's photographs")
    weather.frost_image.cache_clear()
    compare(fixtures[size], "frost")


def test_the_fixtures_cover_every_corruption_and_severity(fixtures):
    for size, count in ((32, 2), (224, 1)):
        data = fixtures[size]
        assert sorted(data["names"]) == sorted(COMMON + EXTRA + ("frost_synthetic",))
        assert data["inputs"].shape == (count, size, size, 3)
        start, step = data["subsample"]
        side = len(range(start, size, step))
        for name in data["names"]:
            assert data[name].shape == (5, count, side, side, 3) and data[name].dtype == np.uint8
        # distinct draws everywhere: no two outputs share a seed
        assert len(np.unique(data["seeds"][0])) == data["seeds"][0].size
