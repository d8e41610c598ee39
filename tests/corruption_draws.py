"""Random numbers that two implementations of the corruptions can share: the reference
(``imagecorruptions``, which calls ``numpy.random``'s global functions, often one pixel at a
time) and ours (one ``numpy.random.Generator`` per image, whole arrays at once).

:class:`SharedDraws` hands out, per kind of draw (normal, uniform, integers, Poisson, plain
``random``), the values of its own stream in order, in whatever shapes it is asked for: a
corruption that asks for an (H, W) field in one call gets the same numbers as one that asks
H * W times for one number, as long as the two ask for the same kinds in the same order. Each
stream is uniform doubles from ``default_rng([seed, kind])`` (PCG64 doubles, stable across NumPy
versions), turned into the asked distribution by its inverse CDF, so the values depend only on
the seed and the order of the calls, never on the library that asks.

Imported by ``tests/test_corruption_fixtures.py`` and by the script that wrote the fixtures
(``tests/fixtures/make_corruption_fixtures.py``, run without torch); NumPy and SciPy only.
"""
from __future__ import annotations

import numpy as np
from scipy import special, stats

KINDS = ("normal", "uniform", "integers", "poisson", "random")


class SharedDraws:
    """A stand-in for ``numpy.random.Generator`` (and, patched in, for ``numpy.random``'s
    global ``normal``, ``uniform``, ``randint`` and ``poisson``) that draws from one stream per
    kind. ``taken[kind]`` counts the values handed out, for every kind but ``random``, which
    scikit-image's salt and pepper draws from :attr:`generator` itself."""

    def __init__(self, seed: int):
        self.streams = {kind: np.random.default_rng([seed, k]) for k, kind in enumerate(KINDS)}
        self.taken = dict.fromkeys(KINDS, 0)
        # scikit-image's salt and pepper takes a real Generator; it shares the "random" stream
        self.generator = self.streams["random"]

    def _u(self, kind: str, size):
        shape = () if size is None else tuple(np.atleast_1d(size))
        count = int(np.prod(shape))
        self.taken[kind] += count
        return self.streams[kind].random(count).reshape(shape)

    @staticmethod
    def _out(values, size):
        return values if size is not None else values[()]

    def normal(self, loc=0.0, scale=1.0, size=None):
        return self._out(loc + scale * special.ndtri(self._u("normal", size)), size)

    def uniform(self, low=0.0, high=1.0, size=None):
        return self._out(low + (high - low) * self._u("uniform", size), size)

    def integers(self, low, high=None, size=None):
        if high is None:
            low, high = 0, low
        return self._out(low + np.floor(self._u("integers", size) * (high - low)).astype(np.int64), size)

    randint = integers

    def poisson(self, lam=1.0, size=None):
        lam = np.asarray(lam, dtype=np.float64)
        shape = lam.shape if size is None else size
        draws = stats.poisson.ppf(self._u("poisson", shape), lam)
        out = np.maximum(draws, 0).astype(np.int64)
        return out if np.ndim(out) else out[()]

    def random(self, size=None):
        return self.generator.random(size)
