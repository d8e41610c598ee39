"""Per-image random generators of the shifts: every image's randomness depends only on the
shift's seed, the shift's name and the image's position in the evaluated set, so an image is
shifted the same way in any batch, chunk, process or shard, and for every model."""
from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

__all__ = ["image_rngs"]


def image_rngs(name: str, indices: Sequence[int], seed: int = 0) -> list[np.random.Generator]:
    """One generator per image: ``numpy.random.default_rng([seed, crc32(name), index])``."""
    key = zlib.crc32(name.encode())
    return [np.random.default_rng([int(seed), key, int(i)]) for i in indices]
