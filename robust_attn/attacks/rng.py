"""The random draws of the attacks that save their progress within a run (APGD's random starts,
Square's squares and signs): from a CPU ``torch.Generator`` on every device, moved to the images'
device, so that the generator's state in a saved progress (:mod:`robust_attn.attacks.progress`)
means the same on a GPU and a CPU: a member started on a lent GPU finishes on a CPU, or the other
way round, with the random numbers an uninterrupted run would have drawn. On a CPU this is the
draw it always was (bit for bit); on a GPU the numbers differ from a CUDA generator's of the same
seed, which is why progress saved by a CUDA generator (before this module) starts its member again.
The cost on a GPU is a host-to-device copy per draw (one image-sized tensor per APGD run, a few
small ones per Square query)."""
from __future__ import annotations

import torch

__all__ = ["generator", "rand", "randn", "randint", "GENERATOR_DEVICE"]

#: where the attacks' generators live, whatever device they attack on
GENERATOR_DEVICE = torch.device("cpu")


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``."""
    return torch.Generator(device=GENERATOR_DEVICE).manual_seed(seed)


def rand(shape, gen: torch.Generator, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.rand`` drawn from ``gen``, on ``device``."""
    return torch.rand(shape, generator=gen, device=gen.device, dtype=dtype).to(device)


def randn(shape, gen: torch.Generator, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.randn`` drawn from ``gen``, on ``device``."""
    return torch.randn(shape, generator=gen, device=gen.device, dtype=dtype).to(device)


def randint(low: int, high: int, shape, gen: torch.Generator, device) -> torch.Tensor:
    """``torch.randint`` drawn from ``gen``, on ``device``."""
    return torch.randint(low, high, shape, generator=gen, device=gen.device).to(device)
