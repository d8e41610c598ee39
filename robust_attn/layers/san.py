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
  offsets (``chunk_size``, default :func:`auto_chunk_size`: a chunk's expanded gamma tensor is
  at most half the input's size, the whole footprint on small maps), so gamma's ``k^2``-expanded
  activations exist for one chunk at a time and are recomputed in the backward pass; the
  aggregation streams over offsets (:mod:`.local_aggregation`).

  - Pairwise: gamma after its first BN-ReLU, the softmax and the aggregation are one autograd
    function, :class:`.san_pairwise._PairwiseAttention`, with a hand-written backward (BN2
    differentiated in closed form, the softmax weights recomputed from the logits and their
    per-pixel log-sum-exp; each chunk recomputed once, or twice with batch statistics and several
    chunks) that saves nothing ``k^2``-sized: besides its inputs only the output and the
    log-sum-exp. gamma's BatchNorms take statistics over all footprint positions: BN1's come in
    closed form from k x k window sums for ``subtraction``/``summation``
    (:func:`.san_pairwise._difference_moments`, its affine then applied before expanding) and from a
    checkpointed pass over the chunks otherwise; BN2's from a first pass over the chunks. Running
    statistics are updated as ``nn.BatchNorm2d`` would. The position channels ``p_i - p_j``
    (image-independent) go through gamma's first layer once at batch 1.
  - Patchwise: gamma's first BN has one channel per footprint position, so its statistics are per
    chunk; each chunk runs under activation checkpointing up to gamma's hidden layer (``G``
    channels); gamma's last layer (``G -> k^2 G``) and the aggregation are one autograd function
    (:class:`.san_patchwise.PatchwiseWeightsAggregate`), so the weights are recomputed in the
    backward pass instead of kept.
  - All 1x1 layers of the operator (phi/psi/beta stacked into one, gamma's) are matmuls
    (:func:`.lean_ops.matmul1x1`), faster on CPU than oneDNN convolutions with so few channels on large
    maps.
  - On CPU in float32/float64 (:func:`.cpu_kernels.uses_kernel`), two pieces run as compiled
    kernels fused per tile of one image and one footprint offset, so their ``k^2``-expanded
    tensors stay in cache (:mod:`.san_fused`): pairwise attention with a linear relation
    (``subtraction``, ``summation``) from gamma's first ReLU on (the same passes and closed-form BN2
    backward as :class:`.san_pairwise._PairwiseAttention`, over the whole footprint), and
    patchwise ``concatenation``'s psi part of gamma's first layer (BN1's per-(channel, offset)
    moments in one pass, BN1 differentiated in closed form). The chunked PyTorch path above stays
    for the other relations, dtypes and devices, and is what the tests check the kernels against.

  Files: this one holds the module, the reference and the lean path's chunking;
  :mod:`.san_pairwise` and :mod:`.san_patchwise` the lean halves, :mod:`.san_fused` the compiled
  kernels' autograd functions, :mod:`.lean_ops` the matmul and BatchNorm pieces they share.

  Under CPU autocast the operator runs in float32 (:func:`.precision.float32_under_cpu_autocast`).

  Each step keeps the function: the tests check outputs, all gradients and running statistics
  against ``"unfold"`` and run ``gradcheck`` in float64.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from robust_attn.layers.lean_ops import position_chunks, matmul1x1, conv1x1
from robust_attn.layers.local_aggregation import footprint_offsets, reflect_pad
from robust_attn.layers.precision import float32_under_cpu_autocast
from robust_attn.layers.san_relations import pair_relation, position_grid, positions

__all__ = ["PAIRWISE_RELATIONS", "PATCHWISE_RELATIONS", "SelfAttention2d", "position_grid",
           "san_attention_unfold", "san_attention_lean", "auto_chunk_size", "conv1x1"]

PAIRWISE_RELATIONS = ("summation", "subtraction", "concatenation", "hadamard", "dot")
PATCHWISE_RELATIONS = ("star", "clique", "concatenation")
IMPLEMENTATIONS = ("lean", "unfold")


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
        chunk_size: footprint offsets per chunk of the lean path (default: :func:`auto_chunk_size`).
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
        self.chunk_size = chunk_size
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

    @float32_under_cpu_autocast
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"expected input (N, {self.in_channels}, H, W), got {tuple(x.shape)}")
        if self.implementation == "unfold":
            return san_attention_unfold(self, x)
        return san_attention_lean(self, x)


# ---------------------------------------------------------------------------------------------
# Pieces shared by both implementations


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
        p = positions(m, x)
        pu = p.flatten(2)[:, :, None] - _unfold(p, k)  # p_i - p_j, (1, 2, K, HW)
    if neighbour_order is not None:
        x2u, vu = x2u[:, :, neighbour_order], vu[:, :, neighbour_order]
    if m.attention == "pairwise":
        delta = pair_relation(m.relation, x1.flatten(2)[:, :, None], x2u)
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
# Lean: chunks of footprint offsets (the pairwise and patchwise halves in .san_pairwise and
# .san_patchwise, their compiled kernels in .san_fused)


#: Default element budget of one chunk's expanded gamma tensor: half the operator input's size, but at
#: least this many elements (small maps run the whole footprint at once; per-chunk overhead dominates).
MIN_CHUNK_ELEMENTS = 1 << 20


def _projections(m: SelfAttention2d, x: torch.Tensor):
    """phi(x), psi(x), beta(x) as one matmul with the three 1x1 layers' weights stacked."""
    weight = torch.cat([m.phi.weight, m.psi.weight, m.beta.weight]).flatten(1)
    bias = torch.cat([m.phi.bias, m.psi.bias, m.beta.bias])
    return matmul1x1(weight, x, bias[:, None]).split([m.rel_channels, m.rel_channels, m.out_channels], 1)


def auto_chunk_size(m: SelfAttention2d, batch: int, height: int, width: int) -> int:
    """Offsets per chunk of the lean path: ``m.chunk_size`` if set, else as many as keep one chunk's
    expanded gamma tensor (``N x channels-per-offset x chunk x H x W``) within half the input's size
    ``N x C x H x W`` (at least :data:`MIN_CHUNK_ELEMENTS`): about 7 offsets of a 7x7 pairwise
    footprint (C/16 + 2 channels each) on large maps, the whole footprint on small ones. Measured:
    the chunk size barely changes the time (7, 14 and auto within 10%), while 14 offsets brought
    the pairwise operator's peak memory (2 x 256 x 56 x 56) to 0.23 of the unfold reference's, 7 to 0.18."""
    area = m.footprint ** 2
    if m.chunk_size:
        return m.chunk_size
    if m.attention == "pairwise":
        per_offset = m.delta_channels
    else:
        per_offset = {"star": 1, "clique": area, "concatenation": m.rel_channels}[m.relation]
    budget = max(batch * m.in_channels * height * width // 2, MIN_CHUNK_ELEMENTS)
    return max(1, min(area, budget // (batch * per_offset * height * width)))


def san_attention_lean(m: SelfAttention2d, x: torch.Tensor) -> torch.Tensor:
    """Memory-lean forward of ``m``, equal to :func:`san_attention_unfold` (see module doc)."""
    n, _, h, w = x.shape
    k = m.footprint
    offsets = footprint_offsets(k)
    index_chunks = position_chunks(k * k, auto_chunk_size(m, n, h, w))
    chunks = [[offsets[j] for j in chunk] for chunk in index_chunks]
    x1, x2, v = _projections(m, x)
    if m.attention == "pairwise":
        from robust_attn.layers.san_pairwise import pairwise_attention

        return pairwise_attention(m, x, x1, x2, v, chunks, index_chunks)
    from robust_attn.layers.san_patchwise import PatchwiseWeightsAggregate, patchwise_hidden_chunked

    # gamma's last layer (G -> k^2 G per pixel) and the aggregation in one autograd function: its
    # k^2-sized output is recomputed in the backward pass rather than kept until then.
    hidden = patchwise_hidden_chunked(m, x1, x2, chunks, index_chunks)
    conv2 = m.gamma[5]
    return PatchwiseWeightsAggregate.apply(hidden, conv2.weight.flatten(1), conv2.bias, v, k)
