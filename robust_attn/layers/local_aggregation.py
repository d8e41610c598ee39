"""Memory-lean footprint aggregation, ``y_i = sum_{j in R(i)} w_ij (.) v_j`` (SAN eq. 2 and 4).

The straightforward implementation unfolds ``v`` into a ``k^2``-times larger tensor
(``F.unfold``), multiplies by the weights and sums over the footprint; autograd then keeps the
unfolded copy for the backward pass. :func:`footprint_aggregate` instead streams over the
``k^2`` offsets of the footprint, accumulating into the output, and in the backward pass
recomputes each shifted view instead of storing it: it saves only the padded ``v`` (about the
size of ``v``) and the weights (``k^2 / share_planes`` times ``v``'s channel count). On CPU in float32/64
the offset loops (forward, weight gradient, ``v`` gradient) are each one pass of a compiled kernel
(:mod:`.cpu_kernels`); elsewhere, one PyTorch op per offset. On maps no
wider than the padding it uses a transient ``F.unfold`` instead (:class:`_UnfoldAggregate`,
same function, faster there); see :func:`footprint_aggregate`. The backward pass for a range of
offsets (:func:`accumulate_aggregate_grads`) also serves fused operators that recompute their
weights chunk by chunk of offsets instead of saving them (SAN pairwise attention).

Border handling is reflection padding (the SAN authors' choice). :func:`reflect_pad` extends it
to maps smaller than the footprint by mirroring repeatedly (period ``2 (n - 1)``); for
``pad < n`` it equals ``F.pad(..., mode="reflect")``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from robust_attn.layers import cpu_kernels

__all__ = ["reflect_index", "reflect_pad", "footprint_offsets", "shifted", "footprint_aggregate",
           "footprint_aggregate_unfold", "aggregate_grad_buffer", "accumulate_aggregate_grads", "padded_gradient",
           "grouped_padded", "unpadded_gradient", "reflect_pad_backward"]


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


def reflect_pad_backward(grad_padded: torch.Tensor, x: torch.Tensor, pad: int) -> torch.Tensor:
    """The gradient of ``x`` from that of :func:`reflect_pad` ``(x, pad)``: every padded position's
    gradient added to the position it mirrors (the padding's adjoint, by autograd)."""
    with torch.enable_grad():
        leaf = x.detach().requires_grad_()
        grad, = torch.autograd.grad(reflect_pad(leaf, pad), leaf, grad_padded)
    return grad


def footprint_offsets(footprint: int) -> list[tuple[int, int]]:
    """``(dy, dx)`` of every footprint position, row-major: the order of ``F.unfold``."""
    return [(dy, dx) for dy in range(footprint) for dx in range(footprint)]


def _runs(offsets):
    """``(start, end, dy, dx)`` of each run of offsets in one footprint row with consecutive ``dx``
    (row-major chunks of :func:`footprint_offsets` are a few such runs)."""
    start = 0
    while start < len(offsets):
        dy, dx = offsets[start]
        end = start + 1
        while end < len(offsets) and offsets[end] == (dy, dx + end - start):
            end += 1
        yield start, end, dy, dx
        start = end


def _stack_shifted(xpad: torch.Tensor, offsets, height: int, width: int) -> torch.Tensor:
    """The views of :func:`shifted` copied into one new tensor. A run of offsets (:func:`_runs`) forms
    a single strided view (``Tensor.unfold`` along the width), so a run costs one copy, not one per
    offset (``torch.stack`` of the single views copies per offset; docs/performance.md)."""
    n, c = xpad.shape[:2]
    out = xpad.new_empty(n, c, len(offsets), height, width)
    for start, end, dy, dx in _runs(offsets):
        run = xpad[:, :, dy:dy + height, dx:dx + width + end - start - 1].unfold(3, width, 1)
        out[:, :, start:end].copy_(run.permute(0, 1, 3, 2, 4))  # (N, C, run, H, W)
    return out


class _Shifted(torch.autograd.Function):
    """:func:`shifted` with a backward that adds every offset's gradient into one zero tensor
    (:func:`.cpu_kernels.window_fold`; autograd's per-slice backward would allocate and sum one
    padded-size tensor per offset)."""

    @staticmethod
    def forward(ctx, xpad: torch.Tensor, offsets, height: int, width: int) -> torch.Tensor:
        ctx.offsets, ctx.shape = offsets, xpad.shape
        return _stack_shifted(xpad, offsets, height, width)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return cpu_kernels.window_fold(grad, ctx.offsets, grad.new_zeros(ctx.shape)), None, None, None


def shifted(xpad: torch.Tensor, offsets: list[tuple[int, int]], height: int, width: int) -> torch.Tensor:
    """Stack the views ``xpad[..., dy:dy+H, dx:dx+W]`` along a new dim 2: ``(N, C, len(offsets), H, W)``."""
    if torch.is_grad_enabled() and xpad.requires_grad:
        return _Shifted.apply(xpad, offsets, height, width)
    return _stack_shifted(xpad, offsets, height, width)


#: Maps narrower than this stream over flattened rows (see :class:`_StreamAggregate`).
FLAT_ROWS_BELOW_WIDTH = 16


class _StreamAggregate(torch.autograd.Function):
    """``out[n,s,g] = sum_k w[n,g,k] * vpad[n,s,g, shift_k]`` with O(|v|) saved memory.

    For each of the ``k^2`` offsets one multiply-add over the shifted view of ``vpad``. On maps
    narrower than :data:`FLAT_ROWS_BELOW_WIDTH` the rows are flattened at the padded width ``Wp``:
    offset ``(dy, dx)`` is then the contiguous range ``[dy Wp + dx, dy Wp + dx + H Wp)`` of the
    flattened ``vpad`` (extended by ``k - 1`` zeros) and the weights get ``Wp - W`` zero columns, so
    each multiply-add runs over one contiguous range instead of ``H`` rows of a few elements (the
    faster form on small maps, not from 16x16 on: docs/performance.md); the extra columns are dropped.
    """

    @staticmethod
    def forward(ctx, vpad: torch.Tensor, weight: torch.Tensor, footprint: int) -> torch.Tensor:
        n, s, g, hp, wp = vpad.shape
        h, w = hp - footprint + 1, wp - footprint + 1
        ctx.save_for_backward(vpad, weight)
        ctx.footprint = footprint
        offsets = footprint_offsets(footprint)
        if cpu_kernels.uses_kernel(vpad, weight):  # one compiled pass over all offsets
            out = vpad.new_empty(n, s, g, h, w)
            cpu_kernels.window_sum(_offset_major(weight), _group_major(vpad), offsets, _group_major(out))
            return out
        if w >= FLAT_ROWS_BELOW_WIDTH:
            out = vpad.new_zeros(n, s, g, h, w)
            for k, (dy, dx) in enumerate(offsets):
                out.addcmul_(vpad[..., dy:dy + h, dx:dx + w], weight[:, None, :, k])
            return out
        vflat, wflat = _flat(vpad, footprint), _flat_weight(weight, wp)
        out = vpad.new_zeros(n, s, g, h * wp)
        for k, (dy, dx) in enumerate(offsets):
            start = dy * wp + dx
            out.addcmul_(vflat[..., start:start + h * wp], wflat[:, None, :, k])
        return out.view(n, s, g, h, wp)[..., :w]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        vpad, weight = ctx.saved_tensors
        grad_buffer = aggregate_grad_buffer(vpad, ctx.footprint) if ctx.needs_input_grad[0] else None
        grad_w = accumulate_aggregate_grads(vpad, weight, grad_out, ctx.footprint, 0, grad_buffer,
                                            need_weight_grad=ctx.needs_input_grad[1])
        grad_v = None if grad_buffer is None else padded_gradient(grad_buffer, vpad.shape)
        return grad_v, grad_w, None


def aggregate_grad_buffer(vpad: torch.Tensor, footprint: int) -> torch.Tensor:
    """Zeroed gradient buffer of ``vpad (N, S, G, Hp, Wp)`` for :func:`accumulate_aggregate_grads`:
    its rows flattened with ``k - 1`` extra elements (room for the flattened-row kernel's last offset);
    :func:`padded_gradient` gives the ``vpad``-shaped gradient."""
    n, s, g, hp, wp = vpad.shape
    return vpad.new_zeros(n, s, g, hp * wp + footprint - 1)


def padded_gradient(grad_buffer: torch.Tensor, shape) -> torch.Tensor:
    """The ``vpad``-shaped view of a buffer of :func:`aggregate_grad_buffer`."""
    n, s, g, hp, wp = shape
    return grad_buffer[..., :hp * wp].view(n, s, g, hp, wp)


def grouped_padded(v: torch.Tensor, footprint: int, groups: int) -> torch.Tensor:
    """``v (N, C, H, W)`` reflection-padded for the footprint and viewed as ``(N, C/G, G, Hp, Wp)``:
    channel ``c`` in group ``c % G``, the layout of the aggregation kernels."""
    n, c = v.shape[:2]
    vpad = reflect_pad(v, footprint // 2)
    return vpad.view(n, c // groups, groups, *vpad.shape[-2:])


def unpadded_gradient(grad_buffer: torch.Tensor, v: torch.Tensor, footprint: int) -> torch.Tensor:
    """The gradient of the unpadded ``v (N, C, H, W)`` from a buffer of :func:`aggregate_grad_buffer`
    filled for :func:`grouped_padded` ``(v)``: through the reflection padding's adjoint."""
    n, c, h, w = v.shape
    pad = footprint // 2
    grad_vpad = grad_buffer[..., :(h + 2 * pad) * (w + 2 * pad)].reshape(n, c, h + 2 * pad, w + 2 * pad)
    return reflect_pad_backward(grad_vpad, v, pad)


def accumulate_aggregate_grads(vpad: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor, footprint: int,
                               first: int, grad_buffer: torch.Tensor | None,
                               need_weight_grad: bool = True) -> torch.Tensor | None:
    """Backward of the aggregation for the footprint offsets ``first, ..., first + Kc - 1`` (row-major
    order of :func:`footprint_offsets`), whose weights are ``weight (N, G, Kc, H, W)``: adds their share of
    the ``vpad`` gradient into ``grad_buffer`` (from :func:`aggregate_grad_buffer`; None: skip) and returns
    their weight gradient ``(N, G, Kc, H, W)`` (None unless ``need_weight_grad``). ``grad_out``:
    ``(N, S, G, H, W)``. Called on all offsets at once by :class:`_StreamAggregate`, chunk by chunk by
    fused operators that recompute the weights. Maps narrower than :data:`FLAT_ROWS_BELOW_WIDTH` use
    flattened rows (see :class:`_StreamAggregate`)."""
    n, s, g, hp, wp = vpad.shape
    h, w = grad_out.shape[-2:]
    offsets = footprint_offsets(footprint)[first:first + weight.shape[2]]
    if cpu_kernels.uses_kernel(vpad, weight, grad_out):  # compiled passes over all offsets
        if grad_buffer is not None:
            cpu_kernels.window_scatter(_offset_major(weight), _group_major(grad_out), offsets,
                                       _group_major(padded_gradient(grad_buffer, vpad.shape)))
        if not need_weight_grad:
            return None
        grad_w = weight.new_empty(weight.shape)
        cpu_kernels.window_dot(_group_major(grad_out), _group_major(vpad), offsets, _offset_major(grad_w))
        return grad_w
    if w >= FLAT_ROWS_BELOW_WIDTH:
        grad_w = weight.new_empty(weight.shape) if need_weight_grad else None
        grad_v = None if grad_buffer is None else padded_gradient(grad_buffer, vpad.shape)
        for j, (dy, dx) in enumerate(offsets):
            if grad_v is not None:
                grad_v[..., dy:dy + h, dx:dx + w].addcmul_(grad_out, weight[:, None, :, j])
            if grad_w is not None:
                grad_w[:, :, j] = (grad_out * vpad[..., dy:dy + h, dx:dx + w]).sum(1)
        return grad_w
    size = h * wp
    gflat = F.pad(grad_out, (0, wp - w)).reshape(n, s, g, size)
    if grad_buffer is not None:
        wflat = _flat_weight(weight, wp)
        for j, (dy, dx) in enumerate(offsets):
            start = dy * wp + dx
            grad_buffer[..., start:start + size].addcmul_(gflat, wflat[:, None, :, j])
    if not need_weight_grad:
        return None
    vflat = _flat(vpad, footprint)
    grad_flat = weight.new_empty(n, g, len(offsets), h, wp)
    prod = torch.empty_like(gflat)
    for j, (dy, dx) in enumerate(offsets):
        start = dy * wp + dx
        torch.mul(gflat, vflat[..., start:start + size], out=prod)
        torch.sum(prod, 1, out=grad_flat[:, :, j].view(n, g, size))
    return grad_flat[..., :w]


def _group_major(t: torch.Tensor) -> torch.Tensor:
    """``(N, S, G, H, W) -> (N, G, S, H, W)`` view: the features layout of :mod:`.cpu_kernels`."""
    return t.transpose(1, 2)


def _offset_major(weight: torch.Tensor) -> torch.Tensor:
    """``(N, G, K, H, W) -> (K, N, G, H, W)`` view: the weights layout of :mod:`.cpu_kernels`."""
    return weight.permute(2, 0, 1, 3, 4)


def _flat(vpad: torch.Tensor, footprint: int) -> torch.Tensor:
    """``(N, S, G, Hp, Wp) -> (N, S, G, Hp Wp + k - 1)``: rows flattened, ``k - 1`` zeros appended."""
    n, s, g, hp, wp = vpad.shape
    return F.pad(vpad.reshape(n, s, g, hp * wp), (0, footprint - 1))


def _flat_weight(weight: torch.Tensor, wp: int) -> torch.Tensor:
    """``(N, G, K, H, W) -> (N, G, K, H Wp)``: ``Wp - W`` zero columns, rows flattened."""
    n, g, kk, h, w = weight.shape
    return F.pad(weight, (0, wp - w)).reshape(n, g, kk, h * wp)


class _UnfoldAggregate(torch.autograd.Function):
    """Same function as :class:`_StreamAggregate` via one ``F.unfold`` (im2col) of ``vpad``, for
    small maps: there the 49 strided slices of the streaming loop have inner runs of a few
    elements and are slow, while the unfolded copy is small. The copy is transient (recomputed in
    the backward pass, whose ``v`` gradient is one ``F.fold``); only ``vpad`` and the weights are saved."""

    @staticmethod
    def forward(ctx, vpad: torch.Tensor, weight: torch.Tensor, footprint: int) -> torch.Tensor:
        n, s, g, hp, wp = vpad.shape
        h, w = hp - footprint + 1, wp - footprint + 1
        u = F.unfold(vpad.reshape(n, s * g, hp, wp), footprint).view(n, s, g, footprint * footprint, h, w)
        ctx.save_for_backward(vpad, weight)
        ctx.footprint = footprint
        return (u * weight[:, None]).sum(3)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        vpad, weight = ctx.saved_tensors
        k = ctx.footprint
        n, s, g, hp, wp = vpad.shape
        h, w = grad_out.shape[-2:]
        grad_v = grad_w = None
        if ctx.needs_input_grad[1]:
            u = F.unfold(vpad.reshape(n, s * g, hp, wp), k).view(n, s, g, k * k, h, w)
            grad_w = (u * grad_out[:, :, :, None]).sum(1)
            del u
        if ctx.needs_input_grad[0]:
            cols = (weight[:, None] * grad_out[:, :, :, None]).view(n, s * g * k * k, h * w)
            grad_v = F.fold(cols, (hp, wp), k).view(n, s, g, hp, wp)
        return grad_v, grad_w, None


#: Largest unfolded ``v`` (``N C k^2 H W`` elements, 16 MiB in float32) for which
#: :func:`footprint_aggregate` picks the unfold kernel on its own (see there).
UNFOLD_AGGREGATE_ELEMENTS = 1 << 22


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


def footprint_aggregate(v: torch.Tensor, weight: torch.Tensor, footprint: int,
                        kernel: str | None = None) -> torch.Tensor:
    """Lean aggregation (SAN eq. 2/4): ``y[n, c, i] = sum_k weight[n, c % G, k, i] * v[n, c, i + offset_k]``.

    ``v``: ``(N, C, H, W)`` transformed features beta(x); ``weight``: ``(N, G, k*k, H, W)``, one
    weight per footprint position for each of ``G`` channel groups; channel ``c`` uses group
    ``c % G`` (the SAN authors' kernel). Reflection padding at the borders.

    ``kernel``: ``"stream"`` (:class:`_StreamAggregate`), ``"unfold"`` (:class:`_UnfoldAggregate`)
    or ``None``: unfold for maps no wider than the padding (``min(H, W) <= k // 2``, e.g. 2x2 maps
    under a 7x7 footprint, where each streamed slice is a couple of elements wide and one unfold
    kernel call costs less) while the unfolded copy has at most :data:`UNFOLD_AGGREGATE_ELEMENTS`
    elements; streaming otherwise (as fast or faster on 4x4 and larger maps; the timings behind
    both thresholds are in docs/performance.md, "Why each path exists").
    Both compute the same function.
    """
    s, groups = _check(v, weight, footprint)
    n, c, h, w = v.shape
    if kernel not in (None, "stream", "unfold"):
        raise ValueError(f"kernel must be None, 'stream' or 'unfold', got {kernel!r}")
    if kernel is None:
        small = min(h, w) <= footprint // 2 and n * c * footprint * footprint * h * w <= UNFOLD_AGGREGATE_ELEMENTS
        kernel = "unfold" if small else "stream"
    vpad = grouped_padded(v, footprint, groups)
    fn = _UnfoldAggregate if kernel == "unfold" else _StreamAggregate
    out = fn.apply(vpad, weight.to(vpad.dtype), footprint)
    return out.reshape(n, c, h, w)


def footprint_aggregate_unfold(v: torch.Tensor, weight: torch.Tensor, footprint: int) -> torch.Tensor:
    """Reference aggregation via ``F.unfold`` (stores the ``k^2``-times expanded ``v``)."""
    s, groups = _check(v, weight, footprint)
    n, c, h, w = v.shape
    unfolded = F.unfold(reflect_pad(v, footprint // 2), footprint)  # (N, C*k*k, H*W), channel-major
    unfolded = unfolded.view(n, s, groups, footprint * footprint, h, w)
    return (unfolded * weight.to(unfolded.dtype)[:, None]).sum(3).reshape(n, c, h, w)
