"""The model every protocol and attack sees: images in [0, 1], normalization inside.

Following RobustBench, mean and std are buffers of the wrapper, so they travel with the
state dict and an attack's gradient flows through the normalization. :class:`ClassSubset` keeps
the logits of a test set's classes where they are a subset of the model's (ImageNet-A, -R).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

__all__ = ["NormalizedModel", "ClassSubset"]


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


class ClassSubset(nn.Module):
    """``model(x)[:, classes]``: the logits of a test set whose classes are some of the model's
    (ImageNet-A and ImageNet-R: 200 of ImageNet's 1,000, in their label order), so predictions,
    top-5 and attacks range over those classes only, as Hendrycks et al. evaluate them."""

    def __init__(self, model: nn.Module, classes: Sequence[int]):
        super().__init__()
        if not classes or len(set(classes)) != len(classes):
            raise ValueError("ClassSubset needs distinct class indices")
        self.model = model
        self.register_buffer("classes", torch.tensor(list(classes), dtype=torch.long), persistent=False)

    @property
    def arch_args(self) -> dict:
        return getattr(self.model, "arch_args", {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        if logits.shape[1] <= int(self.classes.max()):
            raise ValueError(f"the model outputs {logits.shape[1]} classes; the test set's classes index up to "
                             f"{int(self.classes.max())}")
        return logits.index_select(1, self.classes)
