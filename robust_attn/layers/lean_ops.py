"""Building blocks of the lean operator paths (:mod:`.san_lean` and its pairwise and patchwise
halves): 1x1 layers as batched matmuls (:func:`conv1x1`, :func:`matmul1x1`) and BatchNorm with given or
closed-form statistics, forward and backward, so that a hand-written autograd function can run
gamma's BatchNorms without keeping their ``k^2``-expanded inputs.

The underscored names are internal to :mod:`robust_attn.layers`; ``conv1x1`` is public (the SAN
blocks use it).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from robust_attn.layers.precision import accumulation_dtype

__all__ = ["BMM_MIN_POSITIONS", "maybe_checkpoint", "bn_scale_shift", "bn_backward_coefficients", "bn_affine", "update_running",
           "matmul1x1", "matmul1x1_weight_grad", "channel_moments", "mean_var", "position_chunks", "conv1x1"]


def maybe_checkpoint(fn, *args):
    if torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def bn_scale_shift(weight, bias, mean: torch.Tensor, var: torch.Tensor, eps: float):
    """BatchNorm with given statistics as ``y = scale x + shift``: ``(scale, shift)``, contiguous, of
    ``mean``'s shape."""
    scale = weight.view(mean.shape) * torch.rsqrt(var + eps)
    return scale.contiguous(), (bias.view(mean.shape) - mean * scale).contiguous()


def bn_backward_coefficients(scale, rstd, mean, g_bias, g_xsum, count: int):
    """BatchNorm on batch statistics differentiated in closed form, from the per-channel sums of the
    output's gradient ``g_bias = sum g`` and ``g_xsum = sum g x`` over ``count`` values: the weight's
    gradient and ``(c1, c0)`` with ``grad x = scale g + c1 x + c0``."""
    g_weight = rstd * (g_xsum - mean * g_bias)
    c1 = -scale * rstd * g_weight / count
    return g_weight, c1, -scale * g_bias / count - c1 * mean


def bn_affine(x: torch.Tensor, weight, bias, eps: float, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """BatchNorm of channel dim 1 with given statistics and affine parameters."""
    scale, shift = bn_scale_shift(weight, bias, mean, var, eps)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return torch.addcmul(shift.view(shape), x, scale.view(shape))


@torch.no_grad()
def update_running(bn: nn.BatchNorm2d, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
    """Running-statistics update of ``nn.BatchNorm2d`` in training mode (unbiased variance)."""
    if not bn.track_running_stats or bn.running_mean is None:
        return
    bn.num_batches_tracked.add_(1)
    momentum = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
    bn.running_mean.mul_(1 - momentum).add_(mean.detach().to(bn.running_mean.dtype), alpha=momentum)
    unbiased = var.detach().to(bn.running_var.dtype) * (count / max(count - 1, 1))
    bn.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)


#: Positions per image from which :func:`matmul1x1` uses a batched matmul rather than ``F.conv2d``.
BMM_MIN_POSITIONS = 256


def matmul1x1(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """1x1 layer ``weight (O, C)`` on ``x (N, C, ...)`` as a matmul, plus ``bias`` (anything that
    broadcasts to ``(N, O, prod(...))``, e.g. ``(O, 1)``).

    With the few channels of gamma (C/16 and C/32) and many positions a batched matmul beats
    ``F.conv2d`` (oneDNN) on CPU, forward and backward; on maps of fewer than
    :data:`BMM_MIN_POSITIONS` positions (8x8 and smaller stages) oneDNN wins, so those go to
    ``F.conv2d`` (docs/performance.md, "Why each path exists")."""
    n, c = x.shape[:2]
    positions = x[0, 0].numel()
    if positions < BMM_MIN_POSITIONS:
        per_channel = bias is not None and bias.shape == (weight.shape[0], 1)
        out = F.conv2d(x.reshape(n, c, positions, 1), weight[:, :, None, None],
                       bias.flatten() if per_channel else None).flatten(2)
        if bias is not None and not per_channel:
            out = out + bias
        return out.view(n, -1, *x.shape[2:])
    # bmm with the weight expanded over the batch: torch.matmul would fold the batch into an mm on
    # transposed copies, which costs more than it saves (docs/performance.md).
    wt, xm = weight.expand(n, *weight.shape), x.reshape(n, c, -1)
    out = torch.bmm(wt, xm) if bias is None else torch.baddbmm(bias, wt, xm)
    return out.view(n, -1, *x.shape[2:])


def matmul1x1_weight_grad(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`matmul1x1`'s ``weight (O, C)`` from ``grad_out (N, O, ...)`` and its input ``x (N, C, ...)``:
    ``sum_n grad_out[n] x[n]^T``."""
    n = x.shape[0]
    return torch.bmm(grad_out.reshape(n, grad_out.shape[1], -1), x.reshape(n, x.shape[1], -1).transpose(1, 2)).sum(0)


def channel_moments(t: torch.Tensor, dims) -> torch.Tensor:
    """Per-channel sum and sum of squares over ``dims`` (two plain reductions, which CPU kernels
    run as contiguous passes, where ``Tensor.var`` over non-adjacent dims does not)."""
    t = t.to(accumulation_dtype(t.dtype))
    return torch.stack([t.sum(dims), (t * t).sum(dims)])


def mean_var(s: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    mean = s[0] / count
    return mean, (s[1] / count - mean * mean).clamp_min(0)


def position_chunks(area: int, size: int) -> list[list[int]]:
    return [list(range(start, min(start + size, area))) for start in range(0, area, size)]


def conv1x1(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """``conv(x)`` for a 1x1, stride-1, ungrouped ``conv``, computed as a batched matmul (on CPU the
    faster choice for the narrow layers of SAN, forward and backward: :func:`matmul1x1`)."""
    return matmul1x1(conv.weight.flatten(1), x, None if conv.bias is None else conv.bias[:, None])
