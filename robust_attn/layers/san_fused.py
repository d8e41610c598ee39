"""The SAN operator's compiled CPU kernels (:mod:`.cpu_kernels`, ``csrc/``) as autograd functions:
pairwise attention with a linear relation (:class:`FusedPairwiseAttention`) and patchwise
``concatenation``'s psi part of gamma's first layer (:class:`FusedPatchwiseConcat`), each fused
per tile of one image and one footprint offset so that the ``k^2``-expanded tensors stay in cache.
float32/float64 on CPU only (:func:`.cpu_kernels.uses_kernel`); the chunked PyTorch paths of
:mod:`.san_pairwise` and :mod:`.san_patchwise` are their reference in the tests.
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from robust_attn.layers import cpu_kernels
from robust_attn.layers.lean_ops import bn_backward_coefficients, bn_scale_shift, mean_var
from robust_attn.layers.local_aggregation import grouped_padded, reflect_pad, reflect_pad_backward


def _position_operands(w1p, pos, area: int, positions: int):
    """The position channels as :mod:`.cpu_kernels`' pairwise operator takes them: ``w1p (Hd, 2)`` and
    ``pos (2, K, H*W)`` (batch 1), or two Nones."""
    if pos is None:
        return None, None
    return w1p.contiguous(), pos.reshape(pos.shape[1], area, positions).contiguous()


class FusedPairwiseAttention(torch.autograd.Function):
    """:class:`_PairwiseAttention` for a linear relation (its ``first`` is ``relu(center + neighbour
    shifted)``) as the compiled CPU kernels of ``csrc/pairwise_ops.cpp``: each pass runs gamma,
    the softmax and the aggregation per tile of one image and one footprint offset, so the
    ``k^2``-expanded tensors stay in cache instead of a dozen PyTorch passes through memory per
    chunk. The same passes and the same closed-form BN2 backward as :class:`_PairwiseAttention`
    (BN2's batch moments, then the logits; backward: the logits' gradients, kept, then the first
    layer and the inputs; with BN2's running statistics one backward pass), the same saved tensors;
    the weights' gradients are skipped where no weight needs one (an attack). float32/float64 on CPU
    only (:func:`.cpu_kernels.uses_kernel`).

    Inputs: the footprint ``offsets``, BN2's mode, ``eps`` and running statistics, ``w1, w1p, pos,
    w2, b2, bn2_weight, bn2_bias, v`` as for :class:`_PairwiseAttention`, ``center (N, R, H, W)``
    and the padded ``neighbour (N, R, Hp, Wp)``. Returns the output and BN2's batch mean and variance."""

    @staticmethod
    def forward(ctx, offsets, training: bool, eps: float, running_mean, running_var, w1, w1p, pos, w2, b2,
                bn2_weight, bn2_bias, v, center, neighbour):
        n, c, h, w = v.shape
        groups, area = w2.shape[0], len(offsets)
        k = math.isqrt(area)
        center, neighbour, w1, w2, b2 = (t.contiguous() for t in (center, neighbour, w1, w2, b2))
        positions = _position_operands(w1p, pos, area, h * w)
        if training:
            moments = cpu_kernels.pairwise_moments(center, neighbour, offsets, w1, *positions)
            mean, var = mean_var(moments, n * area * h * w)
            mean, var = mean.to(v.dtype), var.to(v.dtype)
        else:
            mean, var = running_mean.to(v.dtype), running_var.to(v.dtype)
        scale, shift = bn_scale_shift(bn2_weight, bn2_bias, mean, var, eps)
        vpad = grouped_padded(v, k, groups).contiguous()
        out, lse = cpu_kernels.pairwise_forward(center, neighbour, offsets, w1, *positions, scale, shift, w2, b2, vpad)
        ctx.offsets, ctx.training, ctx.eps = offsets, training, eps
        ctx.save_for_backward(w1, w1p, pos, w2, b2, bn2_weight, bn2_bias, mean, var, v, out, lse, center, neighbour)
        ctx.mark_non_differentiable(mean, var)
        return out.view(n, c, h, w), mean, var

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_mean, _grad_var):
        w1, w1p, pos, w2, b2, bn2_weight, bn2_bias, mean, var, v, out, lse, center, neighbour = ctx.saved_tensors
        offsets = ctx.offsets
        n, c, h, w = v.shape
        groups, area = w2.shape[0], len(offsets)
        k = math.isqrt(area)
        count = n * area * h * w
        positions = _position_operands(w1p, pos, area, h * w)
        rstd = torch.rsqrt(var + ctx.eps)
        scale, shift = bn_scale_shift(bn2_weight, bn2_bias, mean, var, ctx.eps)
        vpad = grouped_padded(v, k, groups).contiguous()
        grad_y = grad_out.to(v.dtype).reshape(out.shape).contiguous()
        weight_grads = any(ctx.needs_input_grad[5:10])  # w1, w1p, pos, w2, b2; not in an attack
        one_pass = not ctx.training  # BN2 on running statistics: its gradient is known per tile
        first = cpu_kernels.pairwise_backward(center, neighbour, offsets, w1, *positions, scale, shift, w2, b2, vpad,
                                              out, lse, grad_y, weight_grads, one_pass)
        keep, grad_w2, grad_b2, sums, grad_vpad = first[:5]
        g_bias, g_hsum = sums.to(v.dtype)
        g_weight, coef_h, coef_0 = bn_backward_coefficients(scale, rstd, mean, g_bias, g_hsum, count)
        if one_pass:
            grad_w1, grad_w1p, grad_pos, grad_center, grad_neighbour = first[5:]
        else:  # BN2 on batch statistics: gh = scale gz + c1 h + c0 per channel, from the first pass's sums
            grad_w1, grad_w1p, grad_pos, grad_center, grad_neighbour = cpu_kernels.pairwise_backward_input(
                center, neighbour, offsets, w1, *positions, scale, shift, w2, keep, scale, coef_h, coef_0,
                weight_grads)
        del first, keep
        grad_pos = None if grad_pos is None else grad_pos.view_as(pos)
        grad_v = reflect_pad_backward(grad_vpad.view(n, c, *grad_vpad.shape[-2:]), v, k // 2)
        return (None, None, None, None, None, grad_w1, grad_w1p, grad_pos, grad_w2, grad_b2.to(b2.dtype),
                g_weight, g_bias, grad_v, grad_center, grad_neighbour)


class FusedPatchwiseConcat(torch.autograd.Function):
    """The psi part of patchwise concatenation's gamma up to its first layer,
    ``sum_{c, j} W1[:, rel + c k^2 + j] relu(BN1(psi(x)_c shifted by j))`` ``(N, G, H, W)``, as the
    compiled CPU kernels of ``csrc/patchwise_ops.cpp``: per tile of one image and one offset, so the
    ``k^2 C/r1``-channel input never exists; BN1's moments per channel (c, j) come from one pass over
    the windows; the backward recomputes each tile twice (W1's and BN1's gradients, then psi's, BN1
    differentiated in closed form). float32/float64 on CPU only (:func:`.cpu_kernels.uses_kernel`).

    Inputs: the footprint ``offsets``, BN1's mode, ``eps`` and the psi channels' running statistics,
    weight and bias (``C/r1 * k^2``, channel-major), ``x2 = psi(x)`` ``(N, C/r1, H, W)`` and ``w1``
    ``(G, C/r1 * k^2)``. Returns the hidden layer's psi part and BN1's batch mean and variance ``(C/r1, k^2)``."""

    @staticmethod
    def forward(ctx, offsets, training: bool, eps: float, running_mean, running_var, x2, bn_weight, bn_bias, w1):
        n, rel, h, w = x2.shape
        area = len(offsets)
        xpad = reflect_pad(x2, math.isqrt(area) // 2).contiguous()
        if training:
            mean, var = mean_var(cpu_kernels.patchwise_moments(xpad, offsets, h, w), n * h * w)
            mean, var = mean.to(x2.dtype), var.to(x2.dtype)
        else:
            mean, var = running_mean.view(rel, area).to(x2.dtype), running_var.view(rel, area).to(x2.dtype)
        scale, shift = bn_scale_shift(bn_weight, bn_bias, mean, var, eps)
        hid = cpu_kernels.patchwise_hidden(xpad, offsets, h, w, scale, shift, _by_offset(w1, area))
        ctx.offsets, ctx.training, ctx.eps = offsets, training, eps
        ctx.save_for_backward(x2, bn_weight, bn_bias, w1, mean, var)
        ctx.mark_non_differentiable(mean, var)
        return hid, mean, var

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_hid, _grad_mean, _grad_var):
        x2, bn_weight, bn_bias, w1, mean, var = ctx.saved_tensors
        offsets = ctx.offsets
        n, rel, h, w = x2.shape
        area, groups = len(offsets), w1.shape[0]
        pad = math.isqrt(area) // 2
        xpad = reflect_pad(x2, pad).contiguous()
        scale, shift = bn_scale_shift(bn_weight, bn_bias, mean, var, ctx.eps)
        w1k = _by_offset(w1, area)
        grad_hid = grad_hid.to(x2.dtype).contiguous()
        coef_f = coef_0 = torch.zeros_like(scale)  # BN1 on running statistics: grad f = scale gu
        g_weight = g_bias = grad_w1 = None
        if ctx.training or any(ctx.needs_input_grad[6:9]):  # BN1's weight, bias, w1; not in an attack
            grad_w1k, sums = cpu_kernels.patchwise_backward_sums(xpad, offsets, h, w, scale, shift, w1k, grad_hid,
                                                                 ctx.needs_input_grad[8])
            g_bias, g_fsum = sums.to(x2.dtype)
            g_weight, c1, c0 = bn_backward_coefficients(scale, torch.rsqrt(var + ctx.eps), mean, g_bias, g_fsum,
                                                         n * h * w)
            if ctx.training:  # BN1 on batch statistics: grad f = scale gu + c1 f + c0 per channel (c, j)
                coef_f, coef_0 = c1.contiguous(), c0.contiguous()
            g_weight, g_bias = g_weight.flatten(), g_bias.flatten()
            if grad_w1k is not None:
                grad_w1 = grad_w1k.permute(1, 2, 0).reshape(groups, rel * area)
        grad_xpad = cpu_kernels.patchwise_backward_input(xpad, offsets, h, w, scale, shift, w1k, grad_hid, scale,
                                                         coef_f, coef_0)
        return (None, None, None, None, None, reflect_pad_backward(grad_xpad, x2, pad), g_weight, g_bias, grad_w1)


def _by_offset(w1: torch.Tensor, area: int) -> torch.Tensor:
    """gamma's first layer on the psi channels ``(G, C/r1 * k^2)`` regrouped as ``(k^2, G, C/r1)``."""
    return w1.view(w1.shape[0], -1, area).permute(2, 0, 1).contiguous()
