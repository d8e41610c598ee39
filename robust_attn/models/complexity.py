"""Parameter and multiply-add counts, without training-time cost.

Multiply-adds are counted with ``torch.utils.flop_counter.FlopCounterMode`` (which counts
2 FLOPs per multiply-add of matmuls and convolutions) on a model built on the ``meta`` device,
so counting an ImageNet-224 model costs no compute. Softmax, normalization and element-wise
operations are not counted, as in the papers' tables.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from robust_attn.models.registry import create_model
from robust_attn.models.resolution import resolve

__all__ = ["count_params", "count_macs", "model_complexity"]


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_macs(model: nn.Module, image_size: int, device: str | torch.device = "meta") -> int:
    """Multiply-adds of one forward pass on a single ``3 x image_size x image_size`` image."""
    x = torch.zeros(1, 3, image_size, image_size, device=device)
    was_training = model.training
    model.eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x)
    model.train(was_training)
    return counter.get_total_flops() // 2


def model_complexity(name: str, num_classes: int = 1000, resolution: str = "imagenet", **overrides) -> dict:
    """``{"params": ..., "macs": ...}`` of a registered architecture, built on the meta device."""
    image_size = resolve(resolution, overrides.get("image_size")).image_size
    with torch.device("meta"):
        model = create_model(name, num_classes, resolution, **overrides)
    return {"params": count_params(model), "macs": count_macs(model, image_size)}
