"""Our corruptions against the reference, the ``imagecorruptions`` package (Hendrycks &
Dietterich's functions for any image size), on the same random draws.

Skipped where ``imagecorruptions`` is not importable (it pulls OpenCV and scikit-image, which
robust-attn does not need, and 1.1.2 imports ``pkg_resources``, gone from setuptools 81);
``tests/test_corruption_fixtures.py`` compares with its stored outputs in every run, on draws
shared the same way as here. How the two are made to draw the same random numbers: our corruption runs on a recording
generator; the reference then runs with ``numpy.random``'s functions replaced by replays of
those values (ours draws whole arrays where the reference draws per pixel, so a replay hands
out the values in order, in whatever shapes it is asked for); scikit-image's salt-and-pepper
gets a generator in the same state as ours.

imagecorruptions 1.1.2 (its latest release) no longer runs with NumPy 2 (``np.float_`` in fog)
or scikit-image >= 0.19 (``gaussian(multichannel=True)`` in glass and Gaussian blur); the two
shims below restore what those calls meant.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

ic = pytest.importorskip("imagecorruptions")

from helpers import Recorder, sample_images  # noqa: E402
from robust_attn.shifts.corruptions import COMMON, EXTRA, corrupt_batch  # noqa: E402

#: Max abs difference (grey levels of 255) allowed per corruption: 1 for float rounding before
#: the reference's truncation to uint8 (and, for frost, OpenCV's fixed-point bicubic resize).
TOLERANCE = defaultdict(lambda: 1)
NUMPY_NAMES = {"normal": "normal", "uniform": "uniform", "poisson": "poisson", "integers": "randint"}


class Replay:
    """Stands in for one ``numpy.random`` function: returns the recorded values in order."""

    def __init__(self, name, values):
        self.name = name
        self.flat = np.concatenate([np.ravel(v) for v in values]) if values else np.array([])
        self.pos = 0

    def __call__(self, *args, **kwargs):
        size = kwargs.get("size", args[2] if len(args) > 2 and self.name != "poisson" else None)
        if size is None and self.name == "poisson":
            size = np.shape(args[0])
        count = int(np.prod(size)) if size is not None else 1
        out = self.flat[self.pos:self.pos + count]
        assert len(out) == count, f"the reference drew more {self.name} values than ours"
        self.pos += count
        return out.reshape(size) if size is not None else out[0]


@pytest.fixture
def reference(monkeypatch):
    """``run(image, name, severity, seed)`` -> (ours, reference), both uint8 (H, W, 3)."""
    import skimage.filters
    import skimage.util
    from imagecorruptions import corruptions as module

    monkeypatch.setattr(np, "float_", np.float64, raising=False)
    gaussian = skimage.filters.gaussian

    def gaussian_shim(image, *args, multichannel=None, **kwargs):
        if multichannel:
            kwargs["channel_axis"] = -1
        return gaussian(image, *args, **kwargs)

    monkeypatch.setattr(module, "gaussian", gaussian_shim)

    def run(image, name, severity, seed):
        recorder = Recorder(np.random.default_rng(seed))
        ours = corrupt_batch(image[None], name, severity, rngs=[recorder])[0]
        replays = {ours_name: Replay(ours_name if ours_name != "integers" else "randint", recorder.log[ours_name])
                   for ours_name in NUMPY_NAMES}
        with monkeypatch.context() as m:
            for ours_name, numpy_name in NUMPY_NAMES.items():
                m.setattr(np.random, numpy_name, replays[ours_name])
            random_noise = skimage.util.random_noise
            m.setattr(module.sk.util, "random_noise",
                      lambda img, **kw: random_noise(img, rng=np.random.default_rng(seed), **kw))
            theirs = ic.corrupt(image, corruption_name=name, severity=severity)
        for replay in replays.values():
            assert replay.pos == len(replay.flat), f"{name}: the reference drew fewer {replay.name} values than ours"
        return ours, theirs

    return run


def max_differences(run, size: int, names=COMMON + EXTRA, severities=(1, 2, 3, 4, 5), count: int = 2) -> dict:
    """(name, severity) -> max abs difference (grey levels) over ``count`` images."""
    images = sample_images(size, count)
    out = {}
    for name in names:
        for severity in severities:
            worst = 0
            for k, image in enumerate(images):
                ours, theirs = run(image, name, severity, seed=100 * severity + k)
                assert ours.shape == theirs.shape == image.shape
                worst = max(worst, int(np.abs(ours.astype(int) - theirs.astype(int)).max()))
            out[name, severity] = worst
    return out


@pytest.mark.parametrize("name", COMMON + EXTRA)
def test_agrees_with_imagecorruptions_at_32_px(reference, name):
    diffs = max_differences(reference, 32, names=(name,))
    assert max(diffs.values()) <= TOLERANCE[name], diffs


@pytest.mark.slow
@pytest.mark.parametrize("name", COMMON + EXTRA)
def test_agrees_with_imagecorruptions_at_224_px(reference, name):
    diffs = max_differences(reference, 224, names=(name,), severities=(1, 3, 5), count=1)
    assert max(diffs.values()) <= TOLERANCE[name], diffs
