"""Memory-lean footprint aggregation, ``y_i = sum_{j in R(i)} w_ij (.) v_j`` (SAN eq. 2 and 4).

The straightforward implementation unfolds ``v`` into a ``k^2``-times larger tensor
(``F.unfold``), multiplies by the weights and sums over the footprint; autograd then keeps the
unfolded copy for the backward pass. :func:`footprint_aggregate` instead streams over the
``k^2`` offsets of the footprint, accumulating into the output, and in the backward pass
recomputes each shifted view instead of storing it: it saves only the padded ``v`` (about the
size of ``v``) and the weights (``k^2 / share_planes`` times ``v``'s channel count).

Border handling is reflection padding (the SAN authors' choice). :func:`reflect_pad` extends it
to maps smaller than the footprint by mirroring repeatedly (period ``2 (n - 1)``); for
``pad < n`` it equals ``F.pad(..., mode="reflect")``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = ["reflect_index", "reflect_pad", "footprint_offsets", "shifted", "footprint_aggregate",
           "footprint_aggregate_unfold"]


def reflect_index(n: int, pad: int, device=None) -> torch.Tensor:
    """Source index of every position of a length-``n`` axis reflection-padded by ``pad``."""
    idx = torch.arange(-pad, n + pad, device=device)
    if n == 1:
        return torch.zeros_like(idx)
    period = 2 * (n - 1)
    idx = torch.remainder(idx, period)
    return torch.where(idx >= n, period - idx, idx)


def reflect_pad(x: torch.Tensor, pad: int) -> torch.Tensor:
    """Reflection-pad the last two dims of ``x`` by ``pad``; also valid when ``pad >= size``."""
    if pad == 0:
        return x
    h, w = x.shape[-2:]
    if pad < h and pad < w and x.dim() in (3, 4):
        return F.pad(x, (pad, pad, pad, pad), mode="reflect")
    return x.index_select(-2, reflect_index(h, pad, x.device)).index_select(-1, reflect_index(w, pad, x.device))


def footprint_offsets(footprint: int) -> list[tuple[int, int]]:
    """``(dy, dx)`` of every footprint position, row-major: the order of ``F.unfold``."""
    return [(dy, dx) for dy in range(footprint) for dx in range(footprint)]


def shifted(xpad: torch.Tensor, offsets: list[tuple[int, int]], height: int, width: int) -> torch.Tensor:
    """Stack the views ``xpad[..., dy:dy+H, dx:dx+W]`` along a new dim 2: ``(N, C, len(offsets), H, W)``."""
    return torch.stack([xpad[:, :, dy:dy + height, dx:dx + width] for dy, dx in offsets], 2)


class _StreamAggregate(torch.autograd.Function):
    """``out[n,s,g] = sum_k w[n,g,k] * vpad[n,s,g, shift_k]`` with O(|v|) saved memory."""

    @staticmethod
    def forward(ctx, vpad: torch.Tensor, weight: torch.Tensor, footprint: int) -> torch.Tensor:
        n, s, g, hp, wp = vpad.shape
        h, w = hp - footprint + 1, wp - footprint + 1
        out = vpad.new_zeros(n, s, g, h, w)
        for k, (dy, dx) in enumerate(footprint_offsets(footprint)):
            out.addcmul_(vpad[..., dy:dy + h, dx:dx + w], weight[:, None, :, k])
        ctx.save_for_backward(vpad, weight)
        ctx.footprint = footprint
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        vpad, weight = ctx.saved_tensors
        h, w = grad_out.shape[-2:]
        grad_v = grad_w = None
        offsets = footprint_offsets(ctx.footprint)
        if ctx.needs_input_grad[0]:
            grad_v = torch.zeros_like(vpad)
            for k, (dy, dx) in enumerate(offsets):
                grad_v[..., dy:dy + h, dx:dx + w].addcmul_(grad_out, weight[:, None, :, k])
        if ctx.needs_input_grad[1]:
            grad_w = torch.empty_like(weight)
            for k, (dy, dx) in enumerate(offsets):
                grad_w[:, :, k] = (grad_out * vpad[..., dy:dy + h, dx:dx + w]).sum(1)
        return grad_v, grad_w, None


def _check(v: torch.Tensor, weight: torch.Tensor, footprint: int) -> tuple[int, int]:
    if v.dim() != 4 or weight.dim() != 5:
        raise ValueError(f"expected v (N, C, H, W) and weight (N, G, k*k, H, W), got {tuple(v.shape)} "
                         f"and {tuple(weight.shape)}")
    n, c, h, w = v.shape
    groups = weight.shape[1]
    if weight.shape != (n, groups, footprint * footprint, h, w) or c % groups:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit v {tuple(v.shape)} with footprint "
                         f"{footprint}: need (N, G, {footprint * footprint}, H, W) with C divisible by G")
    return c // groups, groups


def footprint_aggregate(v: torch.Tensor, weight: torch.Tensor, footprint: int) -> torch.Tensor:
    """Lean aggregation (SAN eq. 2/4): ``y[n, c, i] = sum_k weight[n, c % G, k, i] * v[n, c, i + offset_k]``.

    ``v``: ``(N, C, H, W)`` transformed features beta(x); ``weight``: ``(N, G, k*k, H, W)``, one
    weight per footprint position for each of ``G`` channel groups; channel ``c`` uses group
    ``c % G`` (the SAN authors' kernel). Reflection padding at the borders.
    """
    s, groups = _check(v, weight, footprint)
    n, c, h, w = v.shape
    vpad = reflect_pad(v, footprint // 2)
    vpad = vpad.view(n, s, groups, *vpad.shape[-2:])
    out = _StreamAggregate.apply(vpad, weight.to(vpad.dtype), footprint)
    return out.reshape(n, c, h, w)


def footprint_aggregate_unfold(v: torch.Tensor, weight: torch.Tensor, footprint: int) -> torch.Tensor:
    """Reference aggregation via ``F.unfold`` (stores the ``k^2``-times expanded ``v``)."""
    s, groups = _check(v, weight, footprint)
    n, c, h, w = v.shape
    unfolded = F.unfold(reflect_pad(v, footprint // 2), footprint)  # (N, C*k*k, H*W), channel-major
    unfolded = unfolded.view(n, s, groups, footprint * footprint, h, w)
    return (unfolded * weight.to(unfolded.dtype)[:, None]).sum(3).reshape(n, c, h, w)
