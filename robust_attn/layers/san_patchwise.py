"""SAN patchwise attention, lean path (eq. 4-5; the module docstring of :mod:`.san` says what
"lean" means): gamma up to its hidden layer chunk by chunk of footprint offsets
(:func:`patchwise_hidden_chunked`, or :class:`.san_fused.FusedPatchwiseConcat` on CPU for
``concatenation``), then gamma's last layer and the aggregation in one autograd function
(:class:`PatchwiseWeightsAggregate`), which recomputes the ``k^2``-sized weights in its backward.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from robust_attn.layers import cpu_kernels
from robust_attn.layers.lean_ops import (bn_affine, maybe_checkpoint, mean_var, matmul1x1, matmul1x1_weight_grad, channel_moments,
                                         update_running)
from robust_attn.layers.local_aggregation import (accumulate_aggregate_grads, aggregate_grad_buffer,
                                                  footprint_aggregate, footprint_offsets, grouped_padded,
                                                  reflect_pad, shifted, unpadded_gradient)
from robust_attn.layers.precision import autocast_off
from robust_attn.layers.san_fused import FusedPatchwiseConcat

if TYPE_CHECKING:
    from robust_attn.layers.san import SelfAttention2d


class PatchwiseWeightsAggregate(torch.autograd.Function):
    """Patchwise attention from gamma's hidden layer on (eq. 4-5): the weights ``W2 hidden + b2``
    (``G -> k^2 G`` per pixel, weight ``(g, j)`` in channel ``g k^2 + j``) and ``y_i = sum_j w_ij (.) v_j``.
    Saves ``hidden``, ``v`` and the layer; the backward pass recomputes the ``k^2``-sized weights once
    (activation checkpointing would also rerun the aggregation). Runs in ``v``'s dtype, autocast off."""

    @staticmethod
    def forward(ctx, hidden, w2, b2, v, footprint: int):
        n, _, h, w = hidden.shape
        with autocast_off(v.device):
            weights = matmul1x1(w2.to(v.dtype), hidden.to(v.dtype), b2.to(v.dtype)[:, None])
            out = footprint_aggregate(v, weights.view(n, w2.shape[0] // footprint ** 2, footprint ** 2, h, w),
                                      footprint)
        ctx.footprint = footprint
        ctx.save_for_backward(hidden, w2, b2, v)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        hidden, w2, b2, v = ctx.saved_tensors
        k, dt = ctx.footprint, v.dtype
        n, _, h, w = hidden.shape
        c, groups = v.shape[1], w2.shape[0] // (k * k)
        hid, w2c = hidden.to(dt), w2.to(dt)
        weights = matmul1x1(w2c, hid, b2.to(dt)[:, None]).view(n, groups, k * k, h, w)
        vpad = grouped_padded(v, k, groups)
        grad_buffer = aggregate_grad_buffer(vpad, k) if ctx.needs_input_grad[3] else None
        grad_y = grad_out.to(dt).reshape(n, c // groups, groups, h, w)
        grad_w = accumulate_aggregate_grads(vpad, weights, grad_y, k, 0, grad_buffer).reshape(n, groups * k * k, h, w)
        del weights
        grad_hidden = matmul1x1(w2c.t().contiguous(), grad_w)
        grad_w2 = matmul1x1_weight_grad(grad_w, hid)
        grad_b2 = grad_w.sum((0, 2, 3))
        grad_v = None if grad_buffer is None else unpadded_gradient(grad_buffer, v, k)
        return grad_hidden.to(hidden.dtype), grad_w2.to(w2.dtype), grad_b2.to(b2.dtype), grad_v, None


def patchwise_hidden_chunked(m: SelfAttention2d, x1, x2, chunks, index_chunks) -> torch.Tensor:
    """gamma of patchwise attention (eq. 5) up to its last layer: ``relu(BN2(W1 relu(BN1(delta))))``,
    ``(N, G, H, W)``; the first layer's input is built chunk by chunk of footprint offsets, each chunk
    under activation checkpointing (which keeps its inputs: the unpadded maps, padded per chunk)."""
    n, rel, h, w = x1.shape
    area = m.footprint ** 2
    bn1, conv1, bn2 = m.gamma[0], m.gamma[2], m.gamma[3]
    w1 = conv1.weight[:, :, 0, 0]
    pad = m.footprint // 2
    all_offsets = footprint_offsets(m.footprint)

    def features(chunk, idx, x1_, x2p_, x1p_):
        """(features (N, d, Kc, H, W), gamma input channel of each (d, Kc)) of one chunk."""
        ch = _channels_of(m, idx, rel, area, x1_.device)
        if m.relation == "concatenation":
            return shifted(x2p_, chunk, h, w), ch
        if m.relation == "star":
            return (x1_[:, :, None] * shifted(x2p_, chunk, h, w)).sum(1, keepdim=True), ch
        # clique: phi(x_j)^T psi(x_l) for j in the chunk and every l
        return torch.einsum("ncjhw,nclhw->nljhw", shifted(x1p_, chunk, h, w), shifted(x2p_, all_offsets, h, w)), ch

    def block(f, ch):
        d, kc = f.shape[1:3]
        if m.training:
            mean, var = mean_var(channel_moments(f, (0, 3, 4)), n * h * w)
        else:
            mean, var = bn1.running_mean[ch], bn1.running_var[ch]
        u = F.relu(bn_affine(f.reshape(n, d * kc, h, w), bn1.weight[ch].flatten(), bn1.bias[ch].flatten(), bn1.eps,
                           mean.flatten(), var.flatten()), True)
        return matmul1x1(w1[:, ch.flatten()], u), mean.detach(), var.detach()

    def run(chunk, idx, x1_, x2_):
        x1p = reflect_pad(x1_, pad) if m.relation == "clique" else None
        return block(*features(chunk, idx, x1_, reflect_pad(x2_, pad), x1p))

    if m.relation == "concatenation" and cpu_kernels.uses_kernel(x2, w1):  # all offsets, fused per tile
        parts = [list(range(area))]
        outs = [FusedPatchwiseConcat.apply(all_offsets, m.training, bn1.eps, bn1.running_mean[rel:],
                                            bn1.running_var[rel:], x2, bn1.weight[rel:], bn1.bias[rel:], w1[:, rel:])]
    else:
        parts = index_chunks
        outs = [maybe_checkpoint(lambda *ts, c=c, i=i: run(c, i, *ts), x1, x2)
                for c, i in zip(chunks, index_chunks)]
    if m.relation == "concatenation":  # phi(x_i) part of the concatenation
        outs.append(block(x1[:, :, None], torch.arange(rel, device=x1.device)[:, None]))
    if m.training:
        mean = torch.zeros_like(bn1.running_mean)
        var = torch.zeros_like(bn1.running_var)
        for (_, mu, sig), i in zip(outs, parts + [None]):
            ch = _channels_of(m, i, rel, area, x1.device)
            mean[ch.flatten()] = mu.flatten().to(mean.dtype)
            var[ch.flatten()] = sig.flatten().to(var.dtype)
        update_running(bn1, mean, var, n * h * w)
    hid = sum(o[0] for o in outs)
    return F.relu(bn2(hid))


def _channels_of(m: SelfAttention2d, idx, rel: int, area: int, device) -> torch.Tensor:
    """gamma input channels of a chunk's features (``idx=None``: the phi part of concatenation)."""
    if idx is None:
        return torch.arange(rel, device=device)[:, None]
    j = torch.tensor(idx, device=device)
    if m.relation == "concatenation":
        return rel + torch.arange(rel, device=device)[:, None] * area + j
    if m.relation == "star":
        return j[None]
    return j[None] * area + torch.arange(area, device=device)[:, None]
