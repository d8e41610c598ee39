"""Target classes for the targeted attacks of SAN Table 10.

The paper does not say how targets are chosen. We draw, for every image, one class uniformly
among the ``num_classes - 1`` wrong ones, from a seeded generator of its own, so that the
targets depend only on (labels, num_classes, seed) and the image's position in the evaluation
set: every model (and every backend) is attacked toward the same targets, and the draw does
not touch, nor depend on, the global torch RNG.
"""
from __future__ import annotations

import numbers

import torch

__all__ = ["draw_targets"]


def draw_targets(labels: torch.Tensor, num_classes: int, seed: int, *, offset: int = 0) -> torch.Tensor:
    """One target per image, uniform over the wrong classes: ``(label + u) % num_classes``.

    ``u`` is uniform on {1, ..., num_classes - 1}, the ``offset + i``-th draw of a
    ``torch.Generator`` seeded with ``seed`` for image ``i``. ``offset`` is the position of
    ``labels[0]`` in the whole evaluation set, so drawing batch by batch with the right offsets
    gives the same targets as one draw over all labels. Returned on ``labels.device``, int64.
    """
    if not isinstance(labels, torch.Tensor) or labels.dim() != 1 or labels.is_floating_point() \
            or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError("labels must be a 1-D integer tensor of class indices")
    for name, value in (("num_classes", num_classes), ("seed", seed), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_classes < 2:
        raise ValueError(f"a targeted attack needs num_classes >= 2, got {num_classes}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    cpu_labels = labels.detach().to("cpu", torch.long)
    if cpu_labels.numel() and (cpu_labels.min() < 0 or cpu_labels.max() >= num_classes):
        raise ValueError(f"labels must be in [0, {num_classes}), got values in "
                         f"[{cpu_labels.min().item()}, {cpu_labels.max().item()}]")
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    shifts = torch.randint(1, num_classes, (offset + cpu_labels.numel(),), generator=generator)[offset:]
    return ((cpu_labels + shifts) % num_classes).to(labels.device)
