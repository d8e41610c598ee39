"""SAN self-attention operator (Zhao, Jia, Koltun, CVPR 2020, section 3, Figure 1), one module.

:class:`SelfAttention2d` maps ``(N, C, H, W)`` to ``(N, C/r2, H, W)`` (the left and right streams
of Figure 1 up to the Hadamard product; the block adds BN-ReLU-linear back to ``C``):

* ``phi, psi``: 1x1 convs ``C -> C/r1`` (``r1 = rel_reduction = 16``), the relation inputs.
* ``beta``: 1x1 conv ``C -> C/r2`` (``r2 = out_reduction = 4``), the aggregated features.
* ``gamma`` (eq. 3/5) = BN-ReLU-1x1(no bias)-BN-ReLU-1x1, the authors' "L-R-L" of Table 5
  with BNs in front of each linear layer (their public code); ``G = (C/r2) / share_planes``
  weight groups (``share_planes = 8`` channels share one weight, section 5.1).

``attention="pairwise"`` (eq. 2-3), ``relation`` one of Table 4's pairwise relations
``summation``, ``subtraction`` (default), ``concatenation``, ``hadamard``, ``dot`` (dot product,
a scalar per pair). Position encoding (section 3.1): a ``linspace(-1, 1)`` grid of (x, y),
a trainable 1x1 conv 2->2, and the difference ``p_i - p_j`` concatenated to delta. gamma maps
``d -> C/r1 -> G`` (``d`` = relation width + 2) and a softmax over the footprint normalizes the
weights (the authors' code; the paper does not mention it).

``attention="patchwise"`` (eq. 4-5), ``relation`` one of ``star`` (phi(x_i)^T psi(x_j) for each
j: k^2 values), ``clique`` (phi(x_j)^T psi(x_l) for all j, l in the footprint: k^4 values,
ordered ``j * k^2 + l``), ``concatenation`` (default; [phi(x_i), psi(x_j) for all j], ordered
phi first, then psi channel-major ``c * k^2 + j`` as ``F.unfold`` orders it). gamma maps
``d -> G -> k^2 G``; no softmax and no position encoding (authors' code). Weight ``(g, j)`` is
gamma's output channel ``g * k^2 + j``.

Both: channel ``c`` of beta(x) is weighted by group ``c % G`` (the authors' aggregation kernel);
the footprint is ``k x k`` around ``i`` with reflection padding (extended by repeated mirroring
to maps smaller than the footprint, where the authors' ``ReflectionPad2d`` would fail).

Implementations (``implementation=``), which compute the same function, buffers included:

* ``"unfold"`` (:func:`san_attention_unfold`, the reference): unfold psi/beta/positions over the
  footprint and run gamma on the ``(N, d, k^2, H*W)`` tensor, as the authors' code does.
* ``"lean"`` (default, :func:`san_attention_lean`): the footprint is processed in chunks of
  ``chunk_size`` offsets (default ``k``, one row), each under activation checkpointing, so
  gamma's ``k^2``-expanded hidden activations exist for one chunk at a time and are recomputed
  in the backward pass; the aggregation streams over offsets (:mod:`.local_aggregation`).
  Pairwise gamma's BatchNorms take statistics over all footprint positions, so in training the
  lean path first accumulates per-channel sums and sums of squares over the chunks (one pass
  for each BN, differentiable, also checkpointed) and then normalizes every chunk with them; the
  running statistics are updated exactly as ``nn.BatchNorm2d`` would. Patchwise gamma's first
  BN has one channel per footprint position, so its statistics are per chunk already.
  Extra cost: pairwise training recomputes gamma's first layer once more in the forward pass,
  and both recompute the chunks in the backward pass.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from robust_attn.layers.local_aggregation import (footprint_aggregate,
                                                  footprint_offsets, reflect_pad, shifted)

__all__ = ["PAIRWISE_RELATIONS", "PATCHWISE_RELATIONS", "SelfAttention2d", "position_grid",
           "san_attention_unfold", "san_attention_lean"]

PAIRWISE_RELATIONS = ("summation", "subtraction", "concatenation", "hadamard", "dot")
PATCHWISE_RELATIONS = ("star", "clique", "concatenation")
IMPLEMENTATIONS = ("lean", "unfold")


def position_grid(height: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """``(1, 2, H, W)``: x then y coordinate, each ``linspace(-1, 1)`` (section 3.1)."""
    ys = torch.linspace(-1, 1, height, device=like.device, dtype=like.dtype)
    xs = torch.linspace(-1, 1, width, device=like.device, dtype=like.dtype)
    return torch.stack([xs.expand(height, width), ys[:, None].expand(height, width)])[None]


class SelfAttention2d(nn.Module):
    """SAN pairwise/patchwise self-attention, ``(N, C, H, W) -> (N, C / out_reduction, H, W)``.

    Args:
        in_channels: ``C``.
        attention: ``"pairwise"`` (eq. 2) or ``"patchwise"`` (eq. 4).
        relation: delta of Table 4; ``None`` picks the paper's choice (subtraction / concatenation).
        footprint: side ``k`` of the odd ``k x k`` footprint R(i).
        rel_reduction: ``r1``, phi and psi output ``C / r1`` channels.
        out_reduction: ``r2``, beta outputs ``C / r2`` channels (the operator's output).
        share_planes: channels sharing one attention weight; ``G = C / r2 / share_planes``.
        position_encoding: pairwise only; concatenate ``p_i - p_j`` to delta (section 3.1).
        implementation: ``"lean"`` (default) or ``"unfold"`` (reference), see the module doc.
        chunk_size: footprint offsets per chunk of the lean path (default ``footprint``).
    """

    def __init__(self, in_channels: int, *, attention: Literal["pairwise", "patchwise"] = "pairwise",
                 relation: str | None = None, footprint: int = 7, rel_reduction: int = 16,
                 out_reduction: int = 4, share_planes: int = 8, position_encoding: bool = True,
                 implementation: str = "lean", chunk_size: int | None = None):
        super().__init__()
        if attention not in ("pairwise", "patchwise"):
            raise ValueError(f"attention must be 'pairwise' or 'patchwise', got {attention!r}")
        relations = PAIRWISE_RELATIONS if attention == "pairwise" else PATCHWISE_RELATIONS
        relation = relation or ("subtraction" if attention == "pairwise" else "concatenation")
        if relation not in relations:
            raise ValueError(f"{attention} relation must be one of {relations}, got {relation!r}")
        if footprint < 1 or footprint % 2 == 0:
            raise ValueError(f"footprint must be a positive odd int, got {footprint}")
        if in_channels % rel_reduction or in_channels % out_reduction:
            raise ValueError(f"in_channels {in_channels} must be divisible by rel_reduction {rel_reduction} "
                             f"and out_reduction {out_reduction}; pick channels that are multiples of both")
        out_channels = in_channels // out_reduction
        if out_channels % share_planes:
            raise ValueError(f"output channels {out_channels} (= {in_channels}/{out_reduction}) must be divisible "
                             f"by share_planes {share_planes}; use share_planes={math.gcd(out_channels, share_planes)}")
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.rel_channels = rel = in_channels // rel_reduction
        self.groups = groups = out_channels // share_planes
        self.attention, self.relation, self.footprint = attention, relation, footprint
        self.share_planes = share_planes
        self.position_encoding = position_encoding and attention == "pairwise"
        self.implementation = implementation
        self.chunk_size = chunk_size or footprint
        area = footprint * footprint

        self.phi = nn.Conv2d(in_channels, rel, 1)
        self.psi = nn.Conv2d(in_channels, rel, 1)
        self.beta = nn.Conv2d(in_channels, out_channels, 1)
        if attention == "pairwise":
            delta = {"concatenation": 2 * rel, "dot": 1}.get(relation, rel)
            delta += 2 if self.position_encoding else 0
            hidden, gamma_out = rel, groups
            self.pos = nn.Conv2d(2, 2, 1) if self.position_encoding else None
        else:
            delta = {"star": area, "clique": area * area, "concatenation": rel * (area + 1)}[relation]
            hidden, gamma_out = groups, area * groups
            self.pos = None
        self.delta_channels = delta
        self.gamma = nn.Sequential(nn.BatchNorm2d(delta), nn.ReLU(inplace=True),
                                   nn.Conv2d(delta, hidden, 1, bias=False),
                                   nn.BatchNorm2d(hidden), nn.ReLU(inplace=True),
                                   nn.Conv2d(hidden, gamma_out, 1))

    def extra_repr(self) -> str:
        return (f"{self.in_channels} -> {self.out_channels}, {self.attention}, relation={self.relation}, "
                f"footprint={self.footprint}, groups={self.groups}, position_encoding={self.position_encoding}, "
                f"implementation={self.implementation}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"expected input (N, {self.in_channels}, H, W), got {tuple(x.shape)}")
        if self.implementation == "unfold":
            return san_attention_unfold(self, x)
        return san_attention_lean(self, x)


# ---------------------------------------------------------------------------------------------
# Pieces shared by both implementations


def _pair_relation(relation: str, center: torch.Tensor, neighbour: torch.Tensor) -> torch.Tensor:
    """delta(x_i, x_j) of section 3.1 on ``center (N, c, 1, ...)`` and ``neighbour (N, c, K, ...)``."""
    if relation == "summation":
        return center + neighbour
    if relation == "subtraction":
        return center - neighbour
    if relation == "hadamard":
        return center * neighbour
    if relation == "dot":
        return (center * neighbour).sum(1, keepdim=True)
    return torch.cat([center.expand_as(neighbour), neighbour], 1)  # concatenation


def _positions(m: SelfAttention2d, x: torch.Tensor) -> torch.Tensor:
    return m.pos(position_grid(x.shape[2], x.shape[3], x))


# ---------------------------------------------------------------------------------------------
# Reference: unfold the footprint


def _unfold(x: torch.Tensor, k: int) -> torch.Tensor:
    """``(N, C, H, W) -> (N, C, k*k, H*W)`` neighbours under reflection padding."""
    n, c, h, w = x.shape
    return F.unfold(reflect_pad(x, k // 2), k).view(n, c, k * k, h * w)


def san_attention_unfold(m: SelfAttention2d, x: torch.Tensor, neighbour_order: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """Reference forward of ``m`` (the authors' structure): every footprint tensor unfolded.

    ``neighbour_order`` (a permutation of ``range(k*k)``) reorders the footprint's features (phi
    and psi where unfolded, beta) while the position encodings stay at their footprint slots:
    pairwise attention without position encoding is a set operation and must not notice.
    """
    n, _, h, w = x.shape
    k, area = m.footprint, m.footprint ** 2
    x1, x2, v = m.phi(x), m.psi(x), m.beta(x)
    x2u, vu = _unfold(x2, k), _unfold(v, k)
    pu = None
    if m.position_encoding:
        p = _positions(m, x)
        pu = p.flatten(2)[:, :, None] - _unfold(p, k)  # p_i - p_j, (1, 2, K, HW)
    if neighbour_order is not None:
        x2u, vu = x2u[:, :, neighbour_order], vu[:, :, neighbour_order]
    if m.attention == "pairwise":
        delta = _pair_relation(m.relation, x1.flatten(2)[:, :, None], x2u)
        if pu is not None:
            delta = torch.cat([delta, pu.expand(n, -1, -1, -1).to(delta.dtype)], 1)
        weight = torch.softmax(m.gamma(delta), dim=2)  # (N, G, K, HW)
    else:
        if m.relation == "concatenation":
            delta = torch.cat([x1.flatten(2), x2u.reshape(n, -1, h * w)], 1)
        elif m.relation == "star":
            delta = (x1.flatten(2)[:, :, None] * x2u).sum(1)
        else:  # clique: phi(x_j)^T psi(x_l), index j * K + l
            x1u = _unfold(x1, k) if neighbour_order is None else _unfold(x1, k)[:, :, neighbour_order]
            delta = torch.einsum("ncjp,nclp->njlp", x1u, x2u).reshape(n, area * area, h * w)
        weight = m.gamma(delta[:, :, None]).view(n, m.groups, area, h * w)
    s = m.out_channels // m.groups
    out = (vu.view(n, s, m.groups, area, h * w) * weight.to(vu.dtype)[:, None]).sum(3)
    return out.reshape(n, m.out_channels, h, w)


# ---------------------------------------------------------------------------------------------
# Lean: chunks of footprint offsets, checkpointed, streaming aggregation


def _maybe_checkpoint(fn, *args):
    if torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def _affine_bn(x: torch.Tensor, bn: nn.BatchNorm2d, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """BatchNorm of channel dim 1 with given statistics."""
    scale = bn.weight * torch.rsqrt(var + bn.eps)
    shift = bn.bias - mean * scale
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return x * scale.view(shape) + shift.view(shape)


@torch.no_grad()
def _update_running(bn: nn.BatchNorm2d, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
    """Running-statistics update of ``nn.BatchNorm2d`` in training mode (unbiased variance)."""
    if not bn.track_running_stats or bn.running_mean is None:
        return
    bn.num_batches_tracked.add_(1)
    momentum = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
    bn.running_mean.mul_(1 - momentum).add_(mean.detach().to(bn.running_mean.dtype), alpha=momentum)
    unbiased = var.detach().to(bn.running_var.dtype) * (count / max(count - 1, 1))
    bn.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)


def _conv(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """1x1 conv on ``(N, C, K, H, W)``."""
    n, c, kk, h, w = x.shape
    return F.conv2d(x.reshape(n, c, kk, h * w), conv.weight, conv.bias).view(n, -1, kk, h, w)


def _chunks(area: int, size: int) -> list[list[int]]:
    return [list(range(start, min(start + size, area))) for start in range(0, area, size)]


def san_attention_lean(m: SelfAttention2d, x: torch.Tensor) -> torch.Tensor:
    """Memory-lean forward of ``m``, equal to :func:`san_attention_unfold` (see module doc)."""
    n, _, h, w = x.shape
    k = m.footprint
    offsets = footprint_offsets(k)
    chunks = [[offsets[j] for j in chunk] for chunk in _chunks(k * k, m.chunk_size)]
    index_chunks = _chunks(k * k, m.chunk_size)
    x1, x2, v = m.phi(x), m.psi(x), m.beta(x)
    x2p = reflect_pad(x2, k // 2)
    if m.attention == "pairwise":
        weight = _pairwise_weights(m, x, x1, x2p, chunks)
    else:
        weight = _patchwise_weights(m, x1, x2p, chunks, index_chunks)
    return footprint_aggregate(v, weight, k)


def _pairwise_weights(m: SelfAttention2d, x, x1, x2p, chunks) -> torch.Tensor:
    n, _, h, w = x1.shape
    k = m.footprint
    bn1, conv1, bn2, conv2 = m.gamma[0], m.gamma[2], m.gamma[3], m.gamma[5]
    center = x1[:, :, None]
    tensors = [x1, x2p]
    if m.position_encoding:
        p = _positions(m, x)
        tensors += [p, reflect_pad(p, k // 2)]

    def delta(chunk, x1_, x2p_, p_=None, pp_=None):
        d = _pair_relation(m.relation, x1_[:, :, None], shifted(x2p_, chunk, h, w))
        if p_ is not None:
            pd = p_[:, :, None] - shifted(pp_, chunk, h, w)
            d = torch.cat([d, pd.expand(n, -1, -1, -1, -1).to(d.dtype)], 1)
        return d

    def hidden(chunk, mean1, var1, *ts):
        return _conv(F.relu(_affine_bn(delta(chunk, *ts), bn1, mean1, var1)), conv1)

    def moments(t):  # per-channel sum and sum of squares over (N, K, H, W)
        t = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
        return torch.stack([t.sum((0, 2, 3, 4)), (t * t).sum((0, 2, 3, 4))])

    if m.training:
        count = n * k * k * h * w
        s1 = sum(_maybe_checkpoint(lambda *ts, c=c: moments(delta(c, *ts)), *tensors) for c in chunks)
        mean1 = s1[0] / count
        var1 = (s1[1] / count - mean1 * mean1).clamp_min(0)
        s2 = sum(_maybe_checkpoint(lambda a, b, *ts, c=c: moments(hidden(c, a, b, *ts)), mean1, var1, *tensors)
                 for c in chunks)
        mean2 = s2[0] / count
        var2 = (s2[1] / count - mean2 * mean2).clamp_min(0)
        _update_running(bn1, mean1, var1, count)
        _update_running(bn2, mean2, var2, count)
    else:
        mean1, var1, mean2, var2 = bn1.running_mean, bn1.running_var, bn2.running_mean, bn2.running_var

    def logits(chunk, a, b, c2, d2, *ts):
        return _conv(F.relu(_affine_bn(hidden(chunk, a, b, *ts), bn2, c2, d2)), conv2)

    parts = [_maybe_checkpoint(lambda *args, c=c: logits(c, *args), mean1, var1, mean2, var2, *tensors)
             for c in chunks]
    return torch.softmax(torch.cat(parts, 2), dim=2)  # (N, G, K, H, W)


def _patchwise_weights(m: SelfAttention2d, x1, x2p, chunks, index_chunks) -> torch.Tensor:
    n, rel, h, w = x1.shape
    area = m.footprint ** 2
    bn1, conv1, bn2, conv2 = m.gamma[0], m.gamma[2], m.gamma[3], m.gamma[5]
    w1 = conv1.weight[:, :, 0, 0]
    x1p = reflect_pad(x1, m.footprint // 2) if m.relation == "clique" else None
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
        if m.training:
            mean, var = f.mean((0, 3, 4)), f.var((0, 3, 4), unbiased=False)
        else:
            mean, var = bn1.running_mean[ch], bn1.running_var[ch]
        u = f - mean[None, :, :, None, None]
        u = u * (bn1.weight[ch] * torch.rsqrt(var + bn1.eps))[None, :, :, None, None] + bn1.bias[ch][None, :, :, None, None]
        hid = torch.einsum("gdk,ndkhw->nghw", w1[:, ch], F.relu(u))
        return hid, mean.detach(), var.detach()

    def run(chunk, idx, *ts):
        return block(*features(chunk, idx, *ts))

    outs = [_maybe_checkpoint(lambda *ts, c=c, i=i: run(c, i, *ts), x1, x2p, x1p)
            for c, i in zip(chunks, index_chunks)]
    if m.relation == "concatenation":  # phi(x_i) part of the concatenation
        outs.append(block(x1[:, :, None], torch.arange(rel, device=x1.device)[:, None]))
    if m.training:
        mean = torch.zeros_like(bn1.running_mean)
        var = torch.zeros_like(bn1.running_var)
        for (_, mu, sig), (c, i) in zip(outs, list(zip(chunks, index_chunks)) + [(None, None)]):
            ch = _channels_of(m, i, rel, area, x1.device)
            mean[ch.flatten()] = mu.flatten().to(mean.dtype)
            var[ch.flatten()] = sig.flatten().to(var.dtype)
        _update_running(bn1, mean, var, n * h * w)
    hid = sum(o[0] for o in outs)
    hid = F.relu(bn2(hid))
    return conv2(hid).view(n, m.groups, area, h, w)


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
