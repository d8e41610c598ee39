"""Attention-augmented convolution (Bello et al., ICCV 2019, "AA" below) with 2D relative
self-attention (AA section 3.1.1, equations 3-4) computed without any ``(HW)^2 x d`` tensor.

Shapes used throughout: ``N`` batch, ``Nh`` heads, ``h x w`` the map the attention runs on,
``L = h * w`` tokens, ``dkh = dk / Nh`` query/key depth per head, ``dvh = dv / Nh`` value
depth per head.

:class:`AugmentedConv2d` is ``Concat[Conv(X), MHA(X)]`` (AA section 3.2): a ``k x k``
convolution with ``out - dv`` filters beside multi-head attention with ``dv`` output channels.
Queries, keys and values come from one 1x1 convolution of ``X`` (``2 dk + dv`` filters,
AA Figure 8 ``self_attention_2d``), the heads are mixed by a 1x1 ``dv -> dv`` projection
(``W^O`` of equation 2). The BN that follows in the network (AA section 3.2) is not part of it.

Choices where the paper is vague (stated, not hidden):

* No bias in the qkv and projection 1x1 convolutions, nor in the ``k x k`` part: a key bias
  cancels in the softmax, a value/projection bias is absorbed by the following BN. (The
  paper's TensorFlow code uses ``tf.layers.conv2d``'s default bias; the difference is
  ``2 dk + 2 dv`` parameters per layer.)
* Stride 2 (the first block of a stage): the convolution part is strided; the attention part
  runs on the input average-pooled with a 3x3 / stride-2 window (``count_include_pad=False``,
  like TensorFlow's SAME pooling), so the attention output already has the output size. This
  is the paper's downsampling operator (AA section 3.2, "3x3 average pooling with stride 2").
* ``attn_pool=2`` additionally pools the attention input by 2 and bilinearly upsamples the
  projected attention output back (AA section 3.2 and Table 9, where the 28x28 stage of
  AA-ResNet-50 attends at 14x14).
* The relative embeddings ``r^H`` (``2h - 1`` rows) and ``r^W`` (``2w - 1`` rows) of ``dkh``
  dimensions are shared across heads, one pair per layer (AA section 3.1.1), and are sized by
  the map the layer is built for (``feature_size``). A different input size raises a
  ``ValueError`` naming the size to build for (the embeddings cannot cover larger offsets).
  They are initialized ``N(0, dkh^-1/2)`` (AA Figure 8 ``relative_logits``).

Implementations of equation 4 (``impl``):

* ``"einsum"`` (default): relative logits by :func:`relative_logits` -- the embeddings are
  first gathered into an absolute-indexed ``(w, w, dkh)`` table (``r^W_{x'-x}`` for every pair
  of columns, no ``(HW)^2`` factor), then contracted with the queries: ``O(L (h + w) dkh)``
  multiply-adds like the paper's rel-to-abs skewing (AA appendix A.3), no padding/reshape
  tricks and no in-place writes. Queries are processed in chunks of rows so that at most
  ``chunk_elements`` logits exist at a time (memory stays bounded for large maps; the full
  ``N x Nh x L x L`` logits of standard attention exist only if they fit the budget).
  ``checkpoint=True`` recomputes each chunk in the backward pass instead of storing its
  attention maps (bounded training memory, about one extra forward of the attention).
* ``"sdpa"``: folds the relative terms into a plain dot product and calls
  :func:`torch.nn.functional.scaled_dot_product_attention`: ``q~_i = [q_i, q_i.r^H_{.-y_i},
  q_i.r^W_{.-x_i}]`` (``dkh + h + w`` dims) and ``k~_j = [k_j, onehot(y_j), onehot(x_j)]``, so
  ``q~_i . k~_j = l_ij`` of equation 3 exactly. On GPUs the fused (flash / memory-efficient)
  kernels then never store an ``L x L`` matrix; the price is ``L^2 (h + w)`` extra multiply-adds
  per head, which counters such as ``FlopCounterMode`` see. On CPU, where SDPA falls back to
  its math backend, it is *not* lean: it materializes the ``L x L`` logits and their extended
  operands, several times the einsum path's peak memory (``benchmarks/bench_aa_ea_ops.py``; the
  figures and their source are in ``docs/performance.md``, "Why each path exists"). Its GPU
  behaviour is unknown.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _checkpoint

__all__ = ["aa_dims", "relative_index", "relative_logits", "AugmentedConv2d"]


def aa_dims(out_channels: int, kappa: float, upsilon: float, heads: int = 8,
            min_key_dims_per_head: int = 0) -> tuple[int, int]:
    """``(dk, dv)`` for an augmented conv with ``out_channels`` filters (AA section 3.2).

    ``dk = kappa * out`` and ``dv = upsilon * out``, each rounded to the nearest multiple of
    ``heads`` (at least ``heads``; the paper only says ``Nh`` divides both), ``dk`` raised to
    ``min_key_dims_per_head * heads`` (AA section 4.1: "a minimum of 20 dimensions per head for
    the keys") and ``dv`` capped at ``out_channels`` (``upsilon = 1``: fully attentional).
    """
    if not (0 < kappa and 0 < upsilon <= 1):
        raise ValueError(f"need kappa > 0 and 0 < upsilon <= 1, got kappa={kappa}, upsilon={upsilon}")

    def to_multiple(x: float) -> int:
        return max(heads, int(round(x / heads)) * heads)

    dk = max(to_multiple(kappa * out_channels), min_key_dims_per_head * heads)
    dv = min(to_multiple(upsilon * out_channels), out_channels // heads * heads)
    if dv < heads:
        raise ValueError(f"{out_channels} output channels cannot hold {heads} attention heads; "
                         f"use fewer heads or a larger width")
    return dk, dv


def relative_index(length: int, device: torch.device | None = None) -> torch.Tensor:
    """``idx[a, b] = b - a + length - 1``: the row of a ``(2 length - 1)``-row relative table
    holding offset ``b - a`` (key position ``b`` seen from query position ``a``)."""
    pos = torch.arange(length, device=device)
    return pos[None, :] - pos[:, None] + length - 1


def relative_logits(q: torch.Tensor, rel_h: torch.Tensor, rel_w: torch.Tensor,
                    row_offset: int = 0, height: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two relative terms of AA equation 3 for queries on a grid, without ``(HW)^2 x d``.

    ``q``: ``(..., hq, w, d)`` queries of rows ``row_offset .. row_offset + hq - 1`` of an
    ``height x w`` map (``height`` defaults to ``hq``); ``rel_h``: ``(2 height - 1, d)``,
    ``rel_w``: ``(2 w - 1, d)``. Returns ``(s_h, s_w)`` with
    ``s_h[..., y, x, y'] = q[..., y, x] . rel_h[y' - y + height - 1]`` (shape ``(..., hq, w, height)``)
    and ``s_w[..., y, x, x'] = q[..., y, x] . rel_w[x' - x + w - 1]`` (shape ``(..., hq, w, w)``);
    ``S^rel_H[i, j] = s_h[i, y_j]`` and ``S^rel_W[i, j] = s_w[i, x_j]`` (AA equation 4).
    """
    hq, w = q.shape[-3], q.shape[-2]
    height = hq if height is None else height
    if rel_w.shape[0] != 2 * w - 1 or rel_h.shape[0] != 2 * height - 1:
        raise ValueError(f"relative tables of {rel_h.shape[0]} and {rel_w.shape[0]} rows do not fit a "
                         f"{height}x{w} map (need {2 * height - 1} and {2 * w - 1})")
    table_w = rel_w[relative_index(w, q.device)]                                     # (w, w', d)
    table_h = rel_h[relative_index(height, q.device)[row_offset:row_offset + hq]]    # (hq, h', d)
    s_w = torch.einsum("...yxd,xvd->...yxv", q, table_w.to(q.dtype))
    s_h = torch.einsum("...yxd,yud->...yxu", q, table_h.to(q.dtype))
    return s_h, s_w


class AugmentedConv2d(nn.Module):
    """``Concat[Conv_kxk(X), MHA(X)]`` with 2D relative self-attention (AA equations 1-4).

    Args:
        in_channels: ``F_in``.
        out_channels: ``F_out``; the convolution part has ``F_out - dv`` filters.
        kernel_size, stride: of the convolution part (padding ``kernel_size // 2``).
        dk, dv: total query/key and value depth (divisible by ``heads``); see :func:`aa_dims`.
        heads: ``Nh`` (AA uses 8).
        feature_size: side of the square input map the layer is built for; sizes ``r^H, r^W``.
        attn_pool: 1, or 2 to attend on a 2x average-pooled map and upsample bilinearly.
        relative: add the relative logits (``False``: plain content attention, AA Table 7).
        impl: ``"einsum"`` or ``"sdpa"`` (see the module docstring).
        chunk_elements: ``"einsum"`` only: most logits held at once (``None``: no chunking).
        checkpoint: ``"einsum"`` only: recompute attention chunks in backward.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1, *,
                 dk: int, dv: int, heads: int = 8, feature_size: int, attn_pool: int = 1,
                 relative: bool = True, impl: str = "einsum", chunk_elements: int | None = 2 ** 24,
                 checkpoint: bool = False):
        super().__init__()
        if dk % heads or dv % heads or dk <= 0 or dv <= 0:
            raise ValueError(f"dk={dk} and dv={dv} must be positive multiples of heads={heads}")
        if dv > out_channels:
            raise ValueError(f"dv={dv} exceeds out_channels={out_channels}")
        if stride not in (1, 2) or attn_pool not in (1, 2):
            raise ValueError(f"stride and attn_pool must be 1 or 2, got {stride} and {attn_pool}")
        if impl not in ("einsum", "sdpa"):
            raise ValueError(f"impl must be 'einsum' or 'sdpa', got {impl!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.dk, self.dv, self.heads = dk, dv, heads
        self.dkh, self.dvh = dk // heads, dv // heads
        self.stride, self.attn_pool, self.feature_size = stride, attn_pool, feature_size
        self.out_size = self._pooled(feature_size, stride)
        self.attn_size = self._pooled(self.out_size, attn_pool)
        self.relative, self.impl = relative, impl
        self.chunk_elements, self.checkpoint = chunk_elements, checkpoint
        self.conv = (nn.Conv2d(in_channels, out_channels - dv, kernel_size, stride, kernel_size // 2, bias=False)
                     if out_channels > dv else None)
        self.qkv = nn.Conv2d(in_channels, 2 * dk + dv, 1, bias=False)
        self.proj = nn.Conv2d(dv, dv, 1, bias=False)
        if relative:
            self.rel_h = nn.Parameter(torch.empty(2 * self.attn_size - 1, self.dkh))
            self.rel_w = nn.Parameter(torch.empty(2 * self.attn_size - 1, self.dkh))
        else:
            self.register_parameter("rel_h", None)
            self.register_parameter("rel_w", None)
        self.reset_parameters()

    @staticmethod
    def _pooled(size: int, factor: int) -> int:
        # Output side of a 3x3 / stride-2 / pad-1 window (conv or pool): ceil(size / 2).
        return size if factor == 1 else (size - 1) // 2 + 1

    def reset_parameters(self) -> None:
        for conv in (self.conv, self.qkv, self.proj):
            if conv is not None:
                nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
        if self.relative:
            nn.init.normal_(self.rel_h, std=self.dkh ** -0.5)
            nn.init.normal_(self.rel_w, std=self.dkh ** -0.5)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, stride={self.stride}, dk={self.dk}, dv={self.dv}, "
                f"heads={self.heads}, feature_size={self.feature_size}, attn_size={self.attn_size}, "
                f"relative={self.relative}, impl={self.impl!r}")

    # -- attention -----------------------------------------------------------------------------
    def _chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_offset: int) -> torch.Tensor:
        """Equation 4 for query rows ``row_offset ..``: q ``(N, Nh, hq, w, dkh)`` (already scaled),
        k ``(N, Nh, L, dkh)``, v ``(N, Nh, L, dvh)`` -> ``(N, Nh, hq * w, dvh)``."""
        n, nh, hq, w, d = q.shape
        h = self.attn_size
        logits = torch.matmul(q.reshape(n, nh, hq * w, d), k.transpose(-1, -2))     # (N, Nh, hq*w, L)
        if self.relative:
            s_h, s_w = relative_logits(q, self.rel_h, self.rel_w, row_offset, h)
            logits = (logits.view(n, nh, hq, w, h, w) + s_h.unsqueeze(-1) + s_w.unsqueeze(-2)
                      ).reshape(n, nh, hq * w, h * w)
        weights = torch.softmax(logits, dim=-1)
        return torch.matmul(weights.to(v.dtype), v)

    def _attend_einsum(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, nh, h, w, _ = q.shape
        if self.chunk_elements is None:
            rows = h
        else:
            rows = max(1, min(h, self.chunk_elements // max(1, n * nh * w * h * w)))
        outs = []
        for start in range(0, h, rows):
            qc = q[:, :, start:start + rows]
            if self.checkpoint and torch.is_grad_enabled():
                outs.append(_checkpoint(self._chunk, qc, k, v, start, use_reentrant=False))
            else:
                outs.append(self._chunk(qc, k, v, start))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _attend_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, nh, h, w, d = q.shape
        q_flat = q.reshape(n, nh, h * w, d)
        if self.relative:
            s_h, s_w = relative_logits(q, self.rel_h, self.rel_w)
            eye_h = torch.eye(h, device=q.device, dtype=q.dtype)
            eye_w = torch.eye(w, device=q.device, dtype=q.dtype)
            key_pos = torch.cat([eye_h[:, None, :].expand(h, w, h), eye_w[None, :, :].expand(h, w, w)], dim=-1)
            q_flat = torch.cat([q_flat, s_h.reshape(n, nh, h * w, h), s_w.reshape(n, nh, h * w, w)], dim=-1)
            k = torch.cat([k, key_pos.reshape(1, 1, h * w, h + w).expand(n, nh, h * w, h + w)], dim=-1)
        return F.scaled_dot_product_attention(q_flat, k, v.to(q_flat.dtype), scale=1.0)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """Projected multi-head relative self-attention of ``x`` at the layer's output size."""
        a = x
        for _ in range(int(math.log2(self.stride * self.attn_pool))):
            a = F.avg_pool2d(a, 3, 2, 1, count_include_pad=False)
        n, _, h, w = a.shape
        q, k, v = self.qkv(a).split([self.dk, self.dk, self.dv], dim=1)
        q = q * self.dkh ** -0.5      # scaled dot product (a new tensor: no in-place write on a view)
        # (N, Nh * d, h, w) -> (N, Nh, h, w, d): channel c of a head-split is head c // d, dim c % d.
        q = q.reshape(n, self.heads, self.dkh, h, w).permute(0, 1, 3, 4, 2)
        k = k.reshape(n, self.heads, self.dkh, h * w).transpose(-1, -2)
        v = v.reshape(n, self.heads, self.dvh, h * w).transpose(-1, -2)
        out = self._attend_sdpa(q, k, v) if self.impl == "sdpa" else self._attend_einsum(q, k, v)
        out = out.transpose(-1, -2).reshape(n, self.dv, h, w)
        out = self.proj(out)
        if self.attn_pool != 1:
            out = F.interpolate(out, size=(self.out_size, self.out_size), mode="bilinear", align_corners=False)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (self.feature_size, self.feature_size):
            raise ValueError(
                f"AugmentedConv2d was built for {self.feature_size}x{self.feature_size} maps (its relative "
                f"embeddings cover offsets of a {self.attn_size}x{self.attn_size} attention map) but got "
                f"{tuple(x.shape[-2:])}; build the model with the image_size you feed it "
                f"(create_model(..., image_size=...)) or resize the input.")
        attn = self.attention(x)
        if self.conv is None:
            return attn
        return torch.cat([self.conv(x), attn], dim=1)
