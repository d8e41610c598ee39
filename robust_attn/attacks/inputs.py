"""Checks every attack runs on its inputs (eval mode, images in [0, 1] on the model's device,
targets that are class indices) and the freezing of a model's parameters during an attack."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

__all__ = ["validate_attack_inputs", "frozen_parameters", "training_modules"]

# Slack for the float checks on images that callers produced themselves (e.g. after a resize).
_RANGE_TOL = 1e-6


def training_modules(model: nn.Module) -> list[str]:
    return [name or type(model).__name__ for name, m in model.named_modules() if m.training]


def _model_device(model: nn.Module) -> torch.device | None:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return None


def validate_attack_inputs(model: nn.Module, images: torch.Tensor, targets: torch.Tensor,
                           labels: torch.Tensor | None = None) -> int:
    """Raise a ``ValueError``/``TypeError`` that names the fix for bad attack input.

    Checks: the model (and every submodule) is in eval mode; images are a floating (N, C, H, W)
    tensor in [0, 1] on the model's device; targets are N integer class indices of the model's
    output; targets differ from ``labels`` where labels are given. Returns the number of
    classes (from one forward pass of a single image).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a NormalizedModel), got {type(model).__name__}")
    training = training_modules(model)
    if training:
        shown = ", ".join(training[:3]) + (" ..." if len(training) > 3 else "")
        raise ValueError(f"the model is in train mode ({shown}); attacks need a deterministic model: "
                         f"call model.eval() first")
    if not isinstance(images, torch.Tensor) or not images.is_floating_point() or images.dim() != 4:
        raise TypeError("images must be a floating-point tensor of shape (N, C, H, W) in [0, 1], got "
                        + (f"{images.dtype} of shape {tuple(images.shape)}" if isinstance(images, torch.Tensor)
                           else type(images).__name__))
    if images.numel() == 0:
        raise ValueError("images is empty")
    if not torch.isfinite(images).all():
        raise ValueError("images contain NaN or inf")
    low, high = images.min().item(), images.max().item()
    if low < -_RANGE_TOL or high > 1 + _RANGE_TOL:
        raise ValueError(f"images must be in [0, 1] (the model normalizes inside, see NormalizedModel), "
                         f"got values in [{low:.4g}, {high:.4g}]; pass un-normalized images")
    device = _model_device(model)
    if device is not None and device != images.device:
        raise ValueError(f"images are on {images.device} but the model is on {device}; move one of them")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), images.dtype)
    if dtype != images.dtype:
        raise TypeError(f"images are {images.dtype} but the model's parameters are {dtype}; "
                        f"use images.to({dtype})")
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32, torch.int16,
                                                                       torch.int8, torch.uint8):
        raise TypeError(f"targets must be an integer tensor of class indices (see draw_targets), got "
                        f"{targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__}")
    if targets.shape != (images.shape[0],):
        raise ValueError(f"targets must have shape ({images.shape[0]},), one per image, got {tuple(targets.shape)}")
    if labels is not None:
        if labels.shape != targets.shape:
            raise ValueError(f"labels must have shape {tuple(targets.shape)}, got {tuple(labels.shape)}")
        same = (targets.cpu().long() == labels.cpu().long()).nonzero().flatten()
        if same.numel():
            raise ValueError(f"{same.numel()} target(s) equal the true label (first at index {same[0].item()}); "
                             f"a targeted attack needs a wrong class: use draw_targets(labels, num_classes, seed)")
    with torch.no_grad():
        logits = model(images[:1])
    if logits.dim() != 2:
        raise ValueError(f"the model must return logits of shape (N, num_classes), got {tuple(logits.shape)}")
    if not torch.isfinite(logits).all():
        raise ValueError("the model returns NaN or inf logits on these images: an attack on it measures nothing; "
                         "check its weights (a damaged or untrained checkpoint) and that images are in [0, 1]")
    num_classes = logits.shape[1]
    if targets.min().item() < 0 or targets.max().item() >= num_classes:
        raise ValueError(f"targets must be class indices in [0, {num_classes}), got values in "
                         f"[{targets.min().item()}, {targets.max().item()}]")
    return num_classes


@contextlib.contextmanager
def frozen_parameters(model: nn.Module) -> Iterator[None]:
    """Temporarily ``requires_grad_(False)`` on every parameter; restored on exit, also on error."""
    had_grad = [p for p in model.parameters() if p.requires_grad]
    for p in had_grad:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in had_grad:
            p.requires_grad_(True)
