"""Dtype handling shared by the attention operators' custom autograd functions.

Under autocast their inputs arrive already cast to one dtype, so autocast is switched off inside
(:func:`autocast_off`); softmax normalizers and BatchNorm statistics of half-precision
activations are accumulated in float32 (:func:`accumulation_dtype`), while float64 stays float64
(``gradcheck``).

On a CPU under autocast, SAN's and SASA's operators run in float32 (:func:`float32_under_cpu_autocast`):
their compiled window kernels (:mod:`.cpu_kernels`) take float32 and float64 only, and the PyTorch
loops that bfloat16 would fall back to made a CIFAR-10 training step 1.5-2.4x slower than float32,
while the operator in float32 and the convolutions around it in bfloat16 is as fast as all float32
or slightly faster (1.02-1.06x; ``benchmarks/results/calibration/options_fp32_attention.json``), so
every family can train under one recipe's autocast. On a GPU autocast applies as everywhere else.
"""
from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["accumulation_dtype", "autocast_off", "float32_under_cpu_autocast"]

#: Whether :func:`float32_under_cpu_autocast` applies; the tests switch it off to run the half-precision
#: paths (those a GPU's autocast takes) on a CPU.
CPU_AUTOCAST_FLOAT32 = True


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for sums, softmax normalizers and statistics of values of ``dtype``: float32 for half types."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def autocast_off(device: torch.device):
    """A context with autocast off on ``device`` (nothing to turn off on e.g. the meta device)."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def float32_under_cpu_autocast(forward):
    """Decorate a module's ``forward(self, x)`` to run with autocast off and a half-precision ``x``
    cast to float32 when ``x`` is on a CPU and CPU autocast is on; its output is then float32
    (autocast casts it again for the next layer that runs in low precision)."""
    @functools.wraps(forward)
    def wrapped(self, x: torch.Tensor) -> torch.Tensor:
        if CPU_AUTOCAST_FLOAT32 and x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                return forward(self, x.float() if x.dtype in (torch.float16, torch.bfloat16) else x)
        return forward(self, x)
    return wrapped
