"""The model every protocol and attack sees: images in [0, 1], normalization inside.

Following RobustBench, mean and std are buffers of the wrapper, so they travel with the
state dict and an attack's gradient flows through the normalization.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

__all__ = ["NormalizedModel"]


class NormalizedModel(nn.Module):
    """``model((x - mean) / std)`` for ``x`` in [0, 1] of shape (N, C, H, W)."""

    def __init__(self, model: nn.Module, mean: Sequence[float], std: Sequence[float]):
        super().__init__()
        if len(mean) != len(std):
            raise ValueError(f"mean and std differ in length: {len(mean)} vs {len(std)}")
        if any(s <= 0 for s in std):
            raise ValueError(f"std must be positive, got {list(std)}")
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    @property
    def arch_args(self) -> dict:
        return getattr(self.model, "arch_args", {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model((x - self.mean) / self.std)
