"""Dtype handling shared by the attention operators' custom autograd functions.

Under autocast their inputs arrive already cast to one dtype, so autocast is switched off inside
(:func:`autocast_off`); softmax normalizers and BatchNorm statistics of half-precision
activations are accumulated in float32 (:func:`accumulation_dtype`), while float64 stays float64
(``gradcheck``).
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["accumulation_dtype", "autocast_off"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for sums, softmax normalizers and statistics of values of ``dtype``: float32 for half types."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def autocast_off(device: torch.device):
    """A context with autocast off on ``device`` (nothing to turn off on e.g. the meta device)."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()
