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
    function, :class:`_PairwiseAttention`, with a hand-written backward (BN2 differentiated in
    closed form, the softmax weights recomputed from the logits and their per-pixel log-sum-exp;
    each chunk recomputed once, or twice with batch statistics and several chunks) that saves
    nothing ``k^2``-sized: besides its inputs only the output and the log-sum-exp. gamma's
    BatchNorms take statistics over all footprint positions: BN1's come in closed form from
    k x k window sums for ``subtraction``/``summation`` (:func:`_difference_moments`, its affine
    then applied before expanding) and from a checkpointed pass over the chunks otherwise; BN2's
    from a first pass over the chunks. Running statistics are updated as ``nn.BatchNorm2d`` would.
    The position channels ``p_i - p_j`` (image-independent) go through gamma's first layer once at
    batch 1.
  - Patchwise: gamma's first BN has one channel per footprint position, so its statistics are per
    chunk; each chunk runs under activation checkpointing up to gamma's hidden layer (``G``
    channels); gamma's last layer (``G -> k^2 G``) and the aggregation are one autograd function
    (:class:`_PatchwiseWeightsAggregate`), so the weights are recomputed in the backward pass
    instead of kept.
  - All 1x1 layers of the operator (phi/psi/beta stacked into one, gamma's) are matmuls
    (:func:`_mm`), faster on CPU than oneDNN convolutions with so few channels on large maps.
  - On CPU in float32/float64 (:func:`.cpu_kernels.uses_kernel`), two pieces run as compiled
    kernels fused per tile of one image and one footprint offset, so their ``k^2``-expanded
    tensors stay in cache: pairwise attention with a linear relation (``subtraction``,
    ``summation``) from gamma's first ReLU on (:class:`_FusedPairwiseAttention`, the same passes
    and closed-form BN2 backward as :class:`_PairwiseAttention`, over the whole footprint), and
    patchwise ``concatenation``'s psi part of gamma's first layer (:class:`_FusedPatchwiseConcat`,
    BN1's per-(channel, offset) moments in one pass, BN1 differentiated in closed form). The
    chunked PyTorch path above stays for the other relations, dtypes and devices, and is what the
    tests check the kernels against.

  Each step keeps the function: the tests check outputs, all gradients and running statistics
  against ``"unfold"`` and run ``gradcheck`` in float64.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from robust_attn.layers import cpu_kernels
from robust_attn.layers.local_aggregation import (accumulate_aggregate_grads, aggregate_grad_buffer,
                                                  footprint_aggregate, footprint_offsets, grouped_padded,
                                                  reflect_pad, reflect_pad_backward, shifted, unpadded_gradient)
from robust_attn.layers.precision import accumulation_dtype, autocast_off

__all__ = ["PAIRWISE_RELATIONS", "PATCHWISE_RELATIONS", "SelfAttention2d", "position_grid",
           "san_attention_unfold", "san_attention_lean", "auto_chunk_size", "conv1x1"]

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


def _bn_scale_shift(weight, bias, mean: torch.Tensor, var: torch.Tensor, eps: float):
    """BatchNorm with given statistics as ``y = scale x + shift``: ``(scale, shift)``, contiguous, of
    ``mean``'s shape."""
    scale = weight.view(mean.shape) * torch.rsqrt(var + eps)
    return scale.contiguous(), (bias.view(mean.shape) - mean * scale).contiguous()


def _bn_backward_coefficients(scale, rstd, mean, g_bias, g_xsum, count: int):
    """BatchNorm on batch statistics differentiated in closed form, from the per-channel sums of the
    output's gradient ``g_bias = sum g`` and ``g_xsum = sum g x`` over ``count`` values: the weight's
    gradient and ``(c1, c0)`` with ``grad x = scale g + c1 x + c0``."""
    g_weight = rstd * (g_xsum - mean * g_bias)
    c1 = -scale * rstd * g_weight / count
    return g_weight, c1, -scale * g_bias / count - c1 * mean


def _affine(x: torch.Tensor, weight, bias, eps: float, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """BatchNorm of channel dim 1 with given statistics and affine parameters."""
    scale, shift = _bn_scale_shift(weight, bias, mean, var, eps)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return torch.addcmul(shift.view(shape), x, scale.view(shape))


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


#: Positions per image from which :func:`_mm` uses a batched matmul rather than ``F.conv2d``.
BMM_MIN_POSITIONS = 256


def _mm(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """1x1 layer ``weight (O, C)`` on ``x (N, C, ...)`` as a matmul, plus ``bias`` (anything that
    broadcasts to ``(N, O, prod(...))``, e.g. ``(O, 1)``).

    With the few channels of gamma (C/16 and C/32) and many positions a batched matmul is several
    times faster on CPU than ``F.conv2d`` (oneDNN), forward and backward; on maps of fewer than
    :data:`BMM_MIN_POSITIONS` positions (8x8 and smaller stages) oneDNN is faster (up to 4x for
    2048 -> 384 channels at 4x4, batch 16), so those go to ``F.conv2d``."""
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
    # transposed copies, about 5x slower here (forward + backward).
    wt, xm = weight.expand(n, *weight.shape), x.reshape(n, c, -1)
    out = torch.bmm(wt, xm) if bias is None else torch.baddbmm(bias, wt, xm)
    return out.view(n, -1, *x.shape[2:])


def _mm_weight_grad(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`_mm`'s ``weight (O, C)`` from ``grad_out (N, O, ...)`` and its input ``x (N, C, ...)``:
    ``sum_n grad_out[n] x[n]^T``."""
    n = x.shape[0]
    return torch.bmm(grad_out.reshape(n, grad_out.shape[1], -1), x.reshape(n, x.shape[1], -1).transpose(1, 2)).sum(0)


def _moments(t: torch.Tensor, dims) -> torch.Tensor:
    """Per-channel sum and sum of squares over ``dims`` (two plain reductions: several times
    faster on CPU than ``Tensor.var`` over non-adjacent dims)."""
    t = t.to(accumulation_dtype(t.dtype))
    return torch.stack([t.sum(dims), (t * t).sum(dims)])


def _mean_var(s: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    mean = s[0] / count
    return mean, (s[1] / count - mean * mean).clamp_min(0)


def _chunks(area: int, size: int) -> list[list[int]]:
    return [list(range(start, min(start + size, area))) for start in range(0, area, size)]


#: Default element budget of one chunk's expanded gamma tensor: half the operator input's size, but at
#: least this many elements (small maps run the whole footprint at once; per-chunk overhead dominates).
MIN_CHUNK_ELEMENTS = 1 << 20


def conv1x1(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """``conv(x)`` for a 1x1, stride-1, ungrouped ``conv``, computed as a batched matmul (faster on CPU
    than oneDNN's convolution for the narrow layers of SAN, forward and backward)."""
    return _mm(conv.weight.flatten(1), x, None if conv.bias is None else conv.bias[:, None])


def _projections(m: SelfAttention2d, x: torch.Tensor):
    """phi(x), psi(x), beta(x) as one matmul with the three 1x1 layers' weights stacked."""
    weight = torch.cat([m.phi.weight, m.psi.weight, m.beta.weight]).flatten(1)
    bias = torch.cat([m.phi.bias, m.psi.bias, m.beta.bias])
    return _mm(weight, x, bias[:, None]).split([m.rel_channels, m.rel_channels, m.out_channels], 1)


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
    index_chunks = _chunks(k * k, auto_chunk_size(m, n, h, w))
    chunks = [[offsets[j] for j in chunk] for chunk in index_chunks]
    x1, x2, v = _projections(m, x)
    if m.attention == "pairwise":
        return _pairwise_attention(m, x, x1, x2, v, chunks, index_chunks)
    # gamma's last layer (G -> k^2 G per pixel) and the aggregation in one autograd function: its
    # k^2-sized output is recomputed in the backward pass rather than kept until then.
    hidden = _patchwise_hidden(m, x1, x2, chunks, index_chunks)
    conv2 = m.gamma[5]
    return _PatchwiseWeightsAggregate.apply(hidden, conv2.weight.flatten(1), conv2.bias, v, k)


def _window_counts(n: int, k: int, like: torch.Tensor) -> torch.Tensor:
    """How many of the ``n`` windows of length ``k`` (stride 1) cover each of the ``n + k - 1``
    positions of a padded axis."""
    idx = torch.arange(n + k - 1, device=like.device)
    return (torch.minimum(idx, torch.full_like(idx, n - 1)) - torch.clamp(idx - k + 1, min=0) + 1).to(like.dtype)


def _window_sum(x: torch.Tensor, k: int) -> torch.Tensor:
    """Sum over every k x k window (stride 1, no padding) of ``x``'s last two dims, as k shifted adds
    along rows, then k along columns (measured 3-8x faster on CPU than ``avg_pool2d`` times ``k^2``)."""
    h, w = x.shape[-2] - k + 1, x.shape[-1] - k + 1
    rows = x[..., :, :w].clone()
    for d in range(1, k):
        rows += x[..., :, d:d + w]
    out = rows[..., :h, :].clone()
    for d in range(1, k):
        out += rows[..., d:d + h, :]
    return out


class _DifferenceMoments(torch.autograd.Function):
    """Per-channel sum and sum of squares of ``x1_i + sign * x2_j`` over all pairs ``(i, j in R(i))``
    and the batch, ``(2, C)``, without expanding the footprint. With ``x2p`` the reflection-padded
    ``x2`` and ``B`` the k x k window sum (:func:`_window_sum`): ``sum = k^2 sum x1 + sign sum B(x2p)``
    and ``sum of squares = k^2 sum x1^2 + 2 sign sum x1 B(x2p) + sum B(x2p^2)``, where ``sum B(t)`` is
    ``sum_j c_j t_j`` with ``c_j`` the number of windows covering padded position ``j`` (separable in
    rows and columns), so only ``B(x2p)`` needs the pooling. Exact up to rounding. The backward pass
    (BN's gradient through its batch statistics) is written out: ``d/dx1 = k^2 g0 + 2 g1 (k^2 x1 +
    sign B(x2p))``, ``d/dx2p = c (sign g0 + 2 g1 x2p) + 2 sign g1 B*(x1)`` with ``B*`` the adjoint of
    ``B`` (window sums of the zero-padded ``x1``); only ``x1`` and ``x2`` are saved. Statistics in
    float32 at least."""

    @staticmethod
    def forward(ctx, x1: torch.Tensor, x2: torch.Tensor, k: int, sign: float) -> torch.Tensor:
        ctx.k, ctx.sign = k, sign
        ctx.save_for_backward(x1, x2)
        x1, x2p, counts = _DifferenceMoments._prepare(x1, x2, k)
        dims, area = (0, 2, 3), k * k
        total = area * x1.sum(dims) + sign * (x2p * counts).sum(dims)
        squares = (area * (x1 * x1).sum(dims) + 2 * sign * (x1 * _window_sum(x2p, k)).sum(dims)
                   + (x2p * x2p * counts).sum(dims))
        return torch.stack([total, squares])

    @staticmethod
    def _prepare(x1, x2, k):
        """``x1`` and the padded ``x2`` in the statistics dtype, and the window counts ``c``."""
        t = accumulation_dtype(x1.dtype)
        x1, x2p = x1.to(t), reflect_pad(x2.to(t), k // 2)
        h, w = x1.shape[-2:]
        return x1, x2p, _window_counts(h, k, x2p)[:, None] * _window_counts(w, k, x2p)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x1_in, x2_in = ctx.saved_tensors
        k, sign = ctx.k, ctx.sign
        x1, x2p, counts = _DifferenceMoments._prepare(x1_in, x2_in, k)
        g0, g1 = (g.to(x1.dtype).view(1, -1, 1, 1) for g in grad)
        grad_x1 = grad_x2 = None
        if ctx.needs_input_grad[0]:
            grad_x1 = (g0 * (k * k) + 2 * g1 * (x1 * (k * k) + sign * _window_sum(x2p, k))).to(x1_in.dtype)
        if ctx.needs_input_grad[1]:
            grad_x2p = counts * (sign * g0 + 2 * g1 * x2p) + 2 * sign * g1 * _window_sum(F.pad(x1, (k - 1,) * 4), k)
            grad_x2 = reflect_pad_backward(grad_x2p.to(x2_in.dtype), x2_in, k // 2)
        return grad_x1, grad_x2, None, None


def _difference_moments(x1: torch.Tensor, x2: torch.Tensor, k: int, sign: float) -> torch.Tensor:
    """:class:`_DifferenceMoments` (``x2`` unpadded)."""
    return _DifferenceMoments.apply(x1, x2, k, sign)


class _GammaPlan:
    """What :class:`_PairwiseAttention` needs besides tensors: ``first(chunk, *inputs)`` (the relation
    channels of gamma's first BN-ReLU for one chunk of offsets, ``(N, d, Kc, H, W)``), the chunks,
    their slices of the footprint, the footprint side ``k``, BN2's mode and ``eps``, and its running
    statistics (eval mode)."""

    def __init__(self, first, chunks, slices, footprint: int, training: bool, eps: float, running_mean, running_var):
        self.first, self.chunks, self.slices, self.footprint = first, chunks, slices, footprint
        self.training, self.eps = training, eps
        self.running_mean, self.running_var = running_mean, running_var


def _chunk_bias(w1p: torch.Tensor | None, pos: torch.Tensor | None, sl: slice, scale=None, shift=None):
    """Per-chunk additive term of gamma's hidden layer: the position part ``w1p pos[:, :, sl]``
    (``(1, hidden, Kc*H*W)``), optionally through BN2's affine, or BN2's shift alone."""
    if pos is None:
        return None if shift is None else shift[:, None]
    p = _mm(w1p, pos[:, :, sl]).flatten(2)
    return p if scale is None else torch.addcmul(shift[:, None], p, scale[:, None])


def _pairwise_logits(plan: _GammaPlan, w1, w1p, pos, w2, b2, bn2_weight, bn2_bias, inputs):
    """gamma after its first BN-ReLU, chunk by chunk (no autograd): ``logits = W2 relu(BN2(W1 u + pos)) + b2``,
    ``(N, G, K, H, W)``, and BN2's mean and variance (the batch's in training: a first pass over the chunks
    sums the moments of the hidden layer; the running ones in eval). With one chunk in training the hidden
    layer of the first pass is reused; otherwise BN2 is folded into the first layer."""
    u = plan.first(plan.chunks[0], *inputs)
    dt = u.dtype
    st = accumulation_dtype(dt)
    n, _, _, h, w = u.shape
    area = sum(len(c) for c in plan.chunks)
    w1c, w2c, b2c = w1.to(dt), w2.to(dt), b2.to(dt)[:, None]
    posc = None if pos is None else pos.to(dt)
    w1pc = None if w1p is None else w1p.to(dt)
    single = len(plan.chunks) == 1
    hidden = None
    if plan.training:
        sums = 0
        for i, (chunk, sl) in enumerate(zip(plan.chunks, plan.slices)):
            u = u if i == 0 else plan.first(chunk, *inputs)
            hid = _mm(w1c, u, _chunk_bias(w1pc, posc, sl))
            sums = sums + _moments(hid, (0, 2, 3, 4))
            hidden = hid if single else None
        mean, var = _mean_var(sums, n * area * h * w)
    else:
        mean, var = plan.running_mean.to(st), plan.running_var.to(st)
    scale, shift = _bn_scale_shift(bn2_weight.to(st), bn2_bias.to(st), mean, var, plan.eps)
    scale_c, shift_c = scale.to(dt), shift.to(dt)
    logits = None if single else u.new_empty(n, w2.shape[0], area, h, w)
    for i, (chunk, sl) in enumerate(zip(plan.chunks, plan.slices)):
        if hidden is not None:  # one chunk in training: h is at hand
            y = torch.addcmul(shift_c.view(1, -1, 1, 1, 1), hidden, scale_c.view(1, -1, 1, 1, 1))
            del hidden
        else:  # BN2 folded into the first layer: s (W1 u + pos) + t
            u = u if i == 0 and not plan.training else plan.first(chunk, *inputs)
            y = _mm(w1c * scale_c[:, None], u, _chunk_bias(w1pc, posc, sl, scale_c, shift_c))
        del u
        part = _mm(w2c, y.relu_(), b2c)
        del y
        if single:
            logits = part
        else:
            logits[:, :, sl] = part
    return logits, mean, var


class _PairwiseAttention(torch.autograd.Function):
    """Pairwise attention (eq. 2-3) from gamma's first BN-ReLU on: ``logits = W2 relu(BN2(W1 u + pos)) + b2``
    chunk by chunk over the footprint, ``w = softmax_j(logits)``, ``y_i = sum_j w_ij v_j``, with a
    hand-written backward that saves nothing ``k^2``-sized: only the per-pixel log-sum-exp of the logits
    (``(N, G, H, W)``), ``v`` and the output.

    The backward recomputes each chunk's ``u`` (with autograd, through ``plan.first``), hidden layer and
    logits, and from them the softmax weights ``w_j = exp(logit_j - lse)``; the aggregation's weight
    gradient ``gw_j = <grad_y, v_j>`` (per group) gives the logits' gradient ``w_j (gw_j - D)`` with
    ``D = sum_j w_j gw_j = <grad_y, y>`` (softmax backward without the weights of other chunks); BN2 is
    differentiated in closed form (batch statistics in training, the running ones in eval). Each chunk
    is recomputed once; with several chunks and batch statistics twice, as BN2's gradient needs sums
    over the whole footprint first (the logits' gradients of the first pass are kept for the second).
    Compared with activation checkpointing, which replays the forward's autograd graph per chunk, this
    measured 1.9x faster forward+backward on a 256-channel 32x32 stage.

    Inputs: ``w1`` ``(hidden, d)`` and ``w1p`` ``(hidden, 2)`` (the relation and position columns of
    gamma's first 1x1 layer), ``pos`` ``(1, 2, K, H, W)`` or None (the position channels after BN1-ReLU,
    batch-independent; ``w1p pos`` is added per chunk), ``w2, b2`` (gamma's last layer),
    ``bn2_weight, bn2_bias``, ``v`` ``(N, C', H, W)`` (beta(x)), then ``plan.first``'s tensors. Returns the
    output ``(N, C', H, W)`` (dtype of ``v``) and BN2's batch mean and variance (not differentiable; for the
    running statistics). gamma runs in the dtype of ``u``, softmax and BN2's statistics in float32 at
    least; autocast is off inside."""

    @staticmethod
    def forward(ctx, plan: _GammaPlan, w1, w1p, pos, w2, b2, bn2_weight, bn2_bias, v, *inputs):
        with autocast_off(w1.device):
            logits, mean, var = _pairwise_logits(plan, w1, w1p, pos, w2, b2, bn2_weight, bn2_bias, inputs)
            ctx.compute_dtype = logits.dtype
            logits = logits.to(accumulation_dtype(logits.dtype))
            peak = logits.amax(2, keepdim=True)
            weights = logits.sub_(peak).exp_()
            total = weights.sum(2, keepdim=True)
            weights.div_(total)
            lse = (peak + total.log_()).squeeze(2)  # log-sum-exp of the logits
            del logits, peak, total
            out = footprint_aggregate(v, weights, plan.footprint)
            del weights
        ctx.plan = plan
        ctx.save_for_backward(w1, w1p, pos, w2, b2, bn2_weight, bn2_bias, mean, var, v, lse, out, *inputs)
        ctx.mark_non_differentiable(mean, var)
        return out, mean, var

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_mean, _grad_var):
        plan = ctx.plan
        w1, w1p, pos, w2, b2, bn2_weight, bn2_bias, mean, var, v, lse, out, *inputs = ctx.saved_tensors
        dt, st, k = ctx.compute_dtype, mean.dtype, plan.footprint
        n, c, h, w = v.shape
        groups, area = w2.shape[0], k * k
        count = n * area * h * w
        grad_y = grad_out.to(v.dtype).reshape(n, c // groups, groups, h, w)
        d_dot = (grad_y * out.reshape(grad_y.shape)).to(st).sum(1)[:, :, None]  # D, (N, G, 1, H, W)
        vpad = grouped_padded(v, k, groups)
        grad_buffer = aggregate_grad_buffer(vpad, k) if ctx.needs_input_grad[8] else None
        w1c, w2c, b2c = w1.to(dt), w2.to(dt), b2.to(dt)[:, None]
        w1t, w2t = w1c.t().contiguous(), w2c.t().contiguous()
        posc = None if pos is None else pos.to(dt)
        w1pc = None if w1p is None else w1p.to(dt)
        rstd = torch.rsqrt(var + plan.eps)
        scale, shift = _bn_scale_shift(bn2_weight.to(st), bn2_bias.to(st), mean, var, plan.eps)
        view = (1, -1, 1, 1, 1)
        scale_c, shift_c = scale.to(dt).view(view), shift.to(dt).view(view)
        lse = lse[:, :, None]

        def logit_grads(sl, z):
            """The chunk's logits' gradient ``w (gw - D)``, its ``v`` gradient added to ``grad_buffer``."""
            weights = _mm(w2c, z, b2c).to(st).sub_(lse).exp_()
            gw = accumulate_aggregate_grads(vpad, weights.to(vpad.dtype), grad_y, k, sl.start, grad_buffer)
            return weights.mul_(gw.to(st).sub_(d_dot)).to(dt)

        def chunk_grads(u, sl, g_logits):
            """h, the gradient at BN2's output (through relu), relu(BN2(h)) and the logits' gradient."""
            hid = _mm(w1c, u, _chunk_bias(w1pc, posc, sl))
            z = torch.addcmul(shift_c, hid, scale_c).relu_()
            if g_logits is None:
                g_logits = logit_grads(sl, z)
            gz = torch.ops.aten.threshold_backward(_mm(w2t, g_logits), z, 0)
            return hid, gz, z, g_logits

        def accumulate(sums, hid, gz, z, g_logits):
            """grad W2, per hidden channel sum(gz) and sum(gz * h) (BN2's parameter gradients), grad b2."""
            gw2 = _mm_weight_grad(g_logits, z)
            dims = (0, 2, 3, 4)
            s = torch.stack([gz.to(st).sum(dims), (gz * hid).to(st).sum(dims)])
            return (sums[0] + gw2.to(st), sums[1] + s, sums[2] + g_logits.to(st).sum(dims))

        two_pass = plan.training and len(plan.chunks) > 1
        sums = (0, 0, 0)
        kept = [None] * len(plan.chunks)  # the logits' gradients of the first pass
        if two_pass:
            for i, (chunk, sl) in enumerate(zip(plan.chunks, plan.slices)):
                hid, gz, z, kept[i] = chunk_grads(plan.first(chunk, *inputs), sl, None)
                sums = accumulate(sums, hid, gz, z, kept[i])
                del hid, gz, z

        needs = ctx.needs_input_grad[9:]
        wanted = [i for i, t in enumerate(inputs) if needs[i]]
        grad_inputs: list = [None] * len(inputs)
        grad_w1 = torch.zeros_like(w1, dtype=st)
        grad_pos = None if pos is None else torch.zeros_like(pos, dtype=dt)
        grad_w1p = None if pos is None else torch.zeros_like(w1p, dtype=st)
        for i, (chunk, sl) in enumerate(zip(plan.chunks, plan.slices)):
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_(needs[j]) for j, t in enumerate(inputs)]
                u = plan.first(chunk, *leaves)
            hid, gz, z, g_logits = chunk_grads(u.detach(), sl, kept[i])
            kept[i] = None
            if not two_pass:
                sums = accumulate(sums, hid, gz, z, g_logits)
            del z, g_logits
            if plan.training:  # BN2 on batch statistics: gh = scale gz + c1 h + c0 per channel
                _, c1, c0 = _bn_backward_coefficients(scale, rstd, mean, *sums[1], count)
                gh = gz.mul_(scale_c).addcmul_(hid, c1.to(dt).view(view)).add_(c0.to(dt).view(view))
            else:
                gh = gz.mul_(scale_c)
            del hid
            grad_w1 += _mm_weight_grad(gh, u.detach()).to(st)
            if grad_pos is not None:  # pos enters as w1p pos, the same for every image
                g_pos = gh.sum(0, keepdim=True)
                grad_w1p += (g_pos.flatten(2)[0] @ posc[:, :, sl].flatten(2)[0].t()).to(st)
                grad_pos[:, :, sl] = _mm(w1pc.t().contiguous(), g_pos)
                del g_pos
            grad_u = _mm(w1t, gh)
            del gh
            if wanted:
                grads = torch.autograd.grad(u, [leaves[j] for j in wanted], grad_u)
                for j, g in zip(wanted, grads):
                    grad_inputs[j] = g if grad_inputs[j] is None else grad_inputs[j] + g
            del u, grad_u

        grad_w2, (g_bias, g_hsum), grad_b2 = sums
        g_weight = _bn_backward_coefficients(scale, rstd, mean, g_bias, g_hsum, count)[0]
        grad_v = None if grad_buffer is None else unpadded_gradient(grad_buffer, v, k)
        return (None, grad_w1.to(w1.dtype), None if grad_w1p is None else grad_w1p.to(w1p.dtype),
                None if grad_pos is None else grad_pos.to(pos.dtype),
                grad_w2.to(w2.dtype), grad_b2.to(b2.dtype), g_weight.to(bn2_weight.dtype),
                g_bias.to(bn2_bias.dtype), grad_v, *grad_inputs)


def _position_operands(w1p, pos, area: int, positions: int):
    """The position channels as :mod:`.cpu_kernels`' pairwise operator takes them: ``w1p (Hd, 2)`` and
    ``pos (2, K, H*W)`` (batch 1), or two Nones."""
    if pos is None:
        return None, None
    return w1p.contiguous(), pos.reshape(pos.shape[1], area, positions).contiguous()


class _FusedPairwiseAttention(torch.autograd.Function):
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
            mean, var = _mean_var(moments, n * area * h * w)
            mean, var = mean.to(v.dtype), var.to(v.dtype)
        else:
            mean, var = running_mean.to(v.dtype), running_var.to(v.dtype)
        scale, shift = _bn_scale_shift(bn2_weight, bn2_bias, mean, var, eps)
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
        scale, shift = _bn_scale_shift(bn2_weight, bn2_bias, mean, var, ctx.eps)
        vpad = grouped_padded(v, k, groups).contiguous()
        grad_y = grad_out.to(v.dtype).reshape(out.shape).contiguous()
        weight_grads = any(ctx.needs_input_grad[5:10])  # w1, w1p, pos, w2, b2; not in an attack
        one_pass = not ctx.training  # BN2 on running statistics: its gradient is known per tile
        first = cpu_kernels.pairwise_backward(center, neighbour, offsets, w1, *positions, scale, shift, w2, b2, vpad,
                                              out, lse, grad_y, weight_grads, one_pass)
        keep, grad_w2, grad_b2, sums, grad_vpad = first[:5]
        g_bias, g_hsum = sums.to(v.dtype)
        g_weight, coef_h, coef_0 = _bn_backward_coefficients(scale, rstd, mean, g_bias, g_hsum, count)
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


def _pairwise_attention(m: SelfAttention2d, x, x1, x2, v, chunks, index_chunks) -> torch.Tensor:
    """Pairwise attention ``y_i = sum_j softmax_j gamma(delta(x_i, x_j)) v_j`` (eq. 2-3), ``(N, C', H, W)``.

    gamma's first BN and 1x1 layer are split into the relation channels and the two position
    channels: ``p_i - p_j`` does not depend on the image, so its BN1-ReLU (BN statistics over N
    identical copies equal those of one copy) is computed once at batch 1 for the whole footprint
    (2 channels) and :class:`_PairwiseAttention` adds its part of the first layer chunk by chunk. BN1's
    statistics of the relation channels come in closed form for ``subtraction``/``summation``
    (:class:`_DifferenceMoments`), whose BN affine ``s (x1_i +- x2_j) + t = (s x1_i + t) +- s x2_j`` is then applied to
    the unexpanded maps (a chunk costs one add); other relations take them in a checkpointed pass over
    the chunks."""
    n, _, h, w = x1.shape
    k, area = m.footprint, m.footprint ** 2
    bn1, conv1, bn2, conv2 = m.gamma[0], m.gamma[2], m.gamma[3], m.gamma[5]
    w1 = conv1.weight.flatten(1)
    dr = m.delta_channels - (2 if m.position_encoding else 0)
    slices = [slice(c[0], c[-1] + 1) for c in index_chunks]
    training = m.training
    count = n * area * h * w

    def delta(chunk, x1_, x2p_):
        return _pair_relation(m.relation, x1_[:, :, None], shifted(x2p_, chunk, h, w))

    linear = m.relation in ("subtraction", "summation")
    sign = -1.0 if m.relation == "subtraction" else 1.0
    x2p = None if linear else reflect_pad(x2, k // 2)
    if training:
        if linear:
            s1 = _difference_moments(x1, x2, k, sign)
        else:
            s1 = sum(_maybe_checkpoint(lambda a, b, c=c: _moments(delta(c, a, b), (0, 2, 3, 4)), x1, x2p)
                     for c in chunks)
        mean1, var1 = _mean_var(s1, count)
    else:
        mean1, var1 = bn1.running_mean[:dr], bn1.running_var[:dr]

    pos = None
    if m.position_encoding:
        p = _positions(m, x)
        pd = (p[:, :, None] - shifted(reflect_pad(p, k // 2), footprint_offsets(k), h, w)).to(x1.dtype)
        if training:
            mean_p, var_p = _mean_var(_moments(pd, (0, 2, 3, 4)), area * h * w)
        else:
            mean_p, var_p = bn1.running_mean[dr:], bn1.running_var[dr:]
        pos = F.relu(_affine(pd, bn1.weight[dr:], bn1.bias[dr:], bn1.eps, mean_p, var_p))
        if training:
            _update_running(bn1, torch.cat([mean1, mean_p]), torch.cat([var1, var_p]), count)
    elif training:
        _update_running(bn1, mean1, var1, count)

    if linear:
        scale1 = bn1.weight[:dr] * torch.rsqrt(var1 + bn1.eps)
        center = torch.addcmul((bn1.bias[:dr] - mean1 * scale1).view(1, -1, 1, 1), x1, scale1.view(1, -1, 1, 1))
        neighbour = reflect_pad(x2 * (sign * scale1).view(1, -1, 1, 1), k // 2)

        def first(chunk, center_, neighbour_):
            return shifted(neighbour_, chunk, h, w).add_(center_[:, :, None]).relu_()
        inputs = (center, neighbour)
    else:
        def first(chunk, x1_, x2p_, mean1_, var1_, weight1_, bias1_):
            return F.relu(_affine(delta(chunk, x1_, x2p_), weight1_, bias1_, bn1.eps, mean1_, var1_), True)
        inputs = (x1, x2p, mean1, var1, bn1.weight[:dr], bn1.bias[:dr])

    w1p = w1[:, dr:] if m.position_encoding else None
    w2 = conv2.weight.flatten(1)
    if linear and cpu_kernels.uses_kernel(v, w1, w2, *inputs):  # whole footprint, fused per tile
        out, mean2, var2 = _FusedPairwiseAttention.apply(footprint_offsets(k), training, bn2.eps, bn2.running_mean,
                                                         bn2.running_var, w1[:, :dr], w1p, pos, w2, conv2.bias,
                                                         bn2.weight, bn2.bias, v, *inputs)
    else:
        plan = _GammaPlan(first, chunks, slices, k, training, bn2.eps, bn2.running_mean, bn2.running_var)
        out, mean2, var2 = _PairwiseAttention.apply(plan, w1[:, :dr], w1p, pos, w2, conv2.bias, bn2.weight,
                                                    bn2.bias, v, *inputs)
    if training:
        _update_running(bn2, mean2, var2, count)
    return out


class _PatchwiseWeightsAggregate(torch.autograd.Function):
    """Patchwise attention from gamma's hidden layer on (eq. 4-5): the weights ``W2 hidden + b2``
    (``G -> k^2 G`` per pixel, weight ``(g, j)`` in channel ``g k^2 + j``) and ``y_i = sum_j w_ij (.) v_j``.
    Saves ``hidden``, ``v`` and the layer; the backward pass recomputes the ``k^2``-sized weights once
    (activation checkpointing would also rerun the aggregation). Runs in ``v``'s dtype, autocast off."""

    @staticmethod
    def forward(ctx, hidden, w2, b2, v, footprint: int):
        n, _, h, w = hidden.shape
        with autocast_off(v.device):
            weights = _mm(w2.to(v.dtype), hidden.to(v.dtype), b2.to(v.dtype)[:, None])
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
        weights = _mm(w2c, hid, b2.to(dt)[:, None]).view(n, groups, k * k, h, w)
        vpad = grouped_padded(v, k, groups)
        grad_buffer = aggregate_grad_buffer(vpad, k) if ctx.needs_input_grad[3] else None
        grad_y = grad_out.to(dt).reshape(n, c // groups, groups, h, w)
        grad_w = accumulate_aggregate_grads(vpad, weights, grad_y, k, 0, grad_buffer).reshape(n, groups * k * k, h, w)
        del weights
        grad_hidden = _mm(w2c.t().contiguous(), grad_w)
        grad_w2 = _mm_weight_grad(grad_w, hid)
        grad_b2 = grad_w.sum((0, 2, 3))
        grad_v = None if grad_buffer is None else unpadded_gradient(grad_buffer, v, k)
        return grad_hidden.to(hidden.dtype), grad_w2.to(w2.dtype), grad_b2.to(b2.dtype), grad_v, None


class _FusedPatchwiseConcat(torch.autograd.Function):
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
            mean, var = _mean_var(cpu_kernels.patchwise_moments(xpad, offsets, h, w), n * h * w)
            mean, var = mean.to(x2.dtype), var.to(x2.dtype)
        else:
            mean, var = running_mean.view(rel, area).to(x2.dtype), running_var.view(rel, area).to(x2.dtype)
        scale, shift = _bn_scale_shift(bn_weight, bn_bias, mean, var, eps)
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
        scale, shift = _bn_scale_shift(bn_weight, bn_bias, mean, var, ctx.eps)
        w1k = _by_offset(w1, area)
        grad_hid = grad_hid.to(x2.dtype).contiguous()
        coef_f = coef_0 = torch.zeros_like(scale)  # BN1 on running statistics: grad f = scale gu
        g_weight = g_bias = grad_w1 = None
        if ctx.training or any(ctx.needs_input_grad[6:9]):  # BN1's weight, bias, w1; not in an attack
            grad_w1k, sums = cpu_kernels.patchwise_backward_sums(xpad, offsets, h, w, scale, shift, w1k, grad_hid,
                                                                 ctx.needs_input_grad[8])
            g_bias, g_fsum = sums.to(x2.dtype)
            g_weight, c1, c0 = _bn_backward_coefficients(scale, torch.rsqrt(var + ctx.eps), mean, g_bias, g_fsum,
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


def _patchwise_hidden(m: SelfAttention2d, x1, x2, chunks, index_chunks) -> torch.Tensor:
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
            mean, var = _mean_var(_moments(f, (0, 3, 4)), n * h * w)
        else:
            mean, var = bn1.running_mean[ch], bn1.running_var[ch]
        u = F.relu(_affine(f.reshape(n, d * kc, h, w), bn1.weight[ch].flatten(), bn1.bias[ch].flatten(), bn1.eps,
                           mean.flatten(), var.flatten()), True)
        return _mm(w1[:, ch.flatten()], u), mean.detach(), var.detach()

    def run(chunk, idx, x1_, x2_):
        x1p = reflect_pad(x1_, pad) if m.relation == "clique" else None
        return block(*features(chunk, idx, x1_, reflect_pad(x2_, pad), x1p))

    if m.relation == "concatenation" and cpu_kernels.uses_kernel(x2, w1):  # all offsets, fused per tile
        parts = [list(range(area))]
        outs = [_FusedPatchwiseConcat.apply(all_offsets, m.training, bn1.eps, bn1.running_mean[rel:],
                                            bn1.running_var[rel:], x2, bn1.weight[rel:], bn1.bias[rel:], w1[:, rel:])]
    else:
        parts = index_chunks
        outs = [_maybe_checkpoint(lambda *ts, c=c, i=i: run(c, i, *ts), x1, x2)
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
        _update_running(bn1, mean, var, n * h * w)
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
