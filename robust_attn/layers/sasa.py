"""Stand-alone local self-attention (SASA; Ramachandran et al., NeurIPS 2019).

The layer of SASA section 2.2, Eq. 3, with multi-head attention::

    y_ij^n = sum_{ab in N_k(ij)} softmax_ab( q_ij^n . (k_ab^n + r^n_{a-i,b-j}) ) v_ab^n

* ``q = W_Q x``, ``k = W_K x``, ``v = W_V x``: 1x1 convolutions without bias (Eq. 4-6).
* ``n`` indexes the ``heads`` heads; each head owns ``C / heads`` consecutive channels of q, k, v
  and its logit is the dot product **summed over its channels** (one softmax weight per head and
  neighbour, not per channel).
* ``r_{a-i,b-j}`` (Eq. 3): a row-offset embedding and a column-offset embedding, each ``C / 2``
  channels in all, concatenated. The paper does not say how the concatenation meets the heads;
  we give every head both kinds: head ``n`` gets ``d/2`` row channels then ``d - d/2`` column
  channels (``d = C / heads``), so the two layer-wide tables are ``(C/2) x k`` each
  (``rel_row`` and ``rel_col``, shape ``(heads, d_half, k)``). A plain concatenation would give
  the first half of the heads row offsets only and the second half column offsets only.
* No ``1/sqrt(d)`` scaling of the logits: Eq. 2-3 have none.
* Zero padding (as a zero-padded convolution): positions outside the map have ``k = v = 0``, so
  their logit is ``q . r`` and they contribute nothing to the output but still take softmax mass.
* ``stride=2`` is 2x2 average pooling with stride 2 after the attention (SASA section 3.1).

The attention itself, ``q, k, v, r -> y`` (its reference and its memory-lean implementations),
is :mod:`.local_attention`. On the ``meta`` device (parameter and multiply-add counting) the layer
runs the reference, whose einsums ``FlopCounterMode`` sees; the streaming path uses element-wise
products it cannot count. Under CPU autocast the layer runs in float32
(:func:`.precision.float32_under_cpu_autocast`).

:class:`AttentionStem` is the spatially-aware attention stem of appendix A.1.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from robust_attn.layers.local_attention import local_attention, local_attention_reference
from robust_attn.layers.precision import float32_under_cpu_autocast

__all__ = ["local_attention", "local_attention_reference", "relative_embedding", "SASAttention2d",
           "AttentionStem"]


def relative_embedding(rel_row: torch.Tensor, rel_col: torch.Tensor) -> torch.Tensor:
    """``r_{a-i,b-j}`` of Eq. 3 for every footprint offset: ``(heads, d, k*k)``.

    ``rel_row``: ``(heads, d_row, k)`` indexed by the row offset ``a - i + k//2``; ``rel_col``:
    ``(heads, d_col, k)`` by the column offset. Offset ``o = (a-i+k//2) * k + (b-j+k//2)``, the
    row-major order of ``F.unfold``.
    """
    h, d_row, ks = rel_row.shape
    d_col = rel_col.shape[1]
    row = rel_row[:, :, :, None].expand(h, d_row, ks, ks)
    col = rel_col[:, :, None, :].expand(h, d_col, ks, ks)
    return torch.cat([row, col], dim=1).reshape(h, d_row + d_col, ks * ks)


class SASAttention2d(nn.Module):
    """Multi-head local self-attention with 2D relative embeddings (SASA Eq. 3), a drop-in
    replacement for a ``kernel_size x kernel_size`` convolution.

    Args:
        in_channels: channels of the input ``x`` (``d_in``).
        out_channels: channels of q, k, v and of the output (``d_out``); divisible by ``heads``.
        kernel_size: spatial extent ``k`` of the footprint (7 in the paper, section 4.1).
        heads: attention heads (8 in the paper).
        stride: 1, or 2 for 2x2/2 average pooling after the attention (section 3.1).
        impl: ``"lean"`` (default: :func:`local_attention`, streaming on large maps, dense on
            small ones) or ``"reference"`` (unfold).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 7, heads: int = 8,
                 stride: int = 1, impl: str = "lean"):
        super().__init__()
        if out_channels % heads:
            raise ValueError(f"out_channels ({out_channels}) must be divisible by heads ({heads}); "
                             f"change heads or the width multiplier")
        if kernel_size % 2 != 1:
            raise ValueError(f"kernel_size must be odd, got {kernel_size}")
        if stride not in (1, 2):
            raise ValueError(f"stride must be 1 or 2 (2x2 average pooling), got {stride}")
        if impl not in ("lean", "reference"):
            raise ValueError(f"impl must be 'lean' or 'reference', got {impl!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.heads, self.stride, self.impl = kernel_size, heads, stride, impl
        self.head_dim = out_channels // heads
        d_row = self.head_dim // 2
        self.query = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.key = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.value = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.rel_row = nn.Parameter(torch.empty(heads, d_row, kernel_size))
        self.rel_col = nn.Parameter(torch.empty(heads, self.head_dim - d_row, kernel_size))
        self.pool = nn.AvgPool2d(2, 2) if stride == 2 else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for conv in (self.query, self.key, self.value):
            nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
        nn.init.normal_(self.rel_row, std=1.0)
        nn.init.normal_(self.rel_col, std=1.0)

    @float32_under_cpu_autocast
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"expected input (B, {self.in_channels}, H, W), got {tuple(x.shape)}")
        b, _, height, width = x.shape
        shape = (b, self.heads, self.head_dim, height, width)
        q, k, v = self.query(x).reshape(shape), self.key(x).reshape(shape), self.value(x).reshape(shape)
        rel = relative_embedding(self.rel_row, self.rel_col)
        attend = local_attention_reference if (self.impl == "reference" or x.device.type == "meta") \
            else local_attention
        out = attend(q, k, v, rel, self.kernel_size).reshape(b, self.out_channels, height, width)
        return self.pool(out)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, heads={self.heads}, "
                f"stride={self.stride}, impl={self.impl!r}")


class AttentionStem(nn.Module):
    """The spatially-aware attention stem of SASA section 3.2 and appendix A.1 (Eq. 4-9).

    Self-attention within each non-overlapping ``block x block`` window (4x4, aligned with the
    max-pooling window), with plain ``q . k`` logits (Eq. 7), values from a convex combination of
    ``mixtures`` value matrices whose weights depend on the pixel's absolute position in the
    window (Eq. 8-9, shared across the heads), then batch normalization, ReLU and
    ``pool x pool`` max pooling.

    Choices where appendix A.1 is silent: 4 heads (as the appendix says for the mixture stem
    layer), 4 value mixtures, 16-dim position and mixture embeddings, a ReLU after the BN (as in the
    convolutional stem), and for ``stem_downsample`` 1 or 2 (CIFAR inputs) the 4x4 attention
    windows are kept but the max pool shrinks to ``stem_downsample``.
    """

    def __init__(self, out_channels: int, stem_downsample: int = 4, in_channels: int = 3, heads: int = 4,
                 mixtures: int = 4, block: int = 4, embed_dim: int = 16):
        super().__init__()
        if out_channels % heads:
            raise ValueError(f"out_channels ({out_channels}) must be divisible by heads ({heads})")
        self.out_channels, self.heads, self.mixtures, self.block = out_channels, heads, mixtures, block
        self.query = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.key = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.value = nn.Conv2d(in_channels, out_channels * mixtures, 1, bias=False)   # W_V^m, m = 1..M
        self.emb_row = nn.Parameter(torch.randn(block, embed_dim))
        self.emb_col = nn.Parameter(torch.randn(block, embed_dim))
        self.emb_mix = nn.Parameter(torch.randn(mixtures, embed_dim))                 # nu^m
        self.bn = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(stem_downsample, stem_downsample) if stem_downsample > 1 else nn.Identity()

    def mixture_weights(self) -> torch.Tensor:
        """``p(a, b, m)`` of Eq. 9: ``(block, block, mixtures)``, a softmax over ``m``."""
        emb = self.emb_row[:, None, :] + self.emb_col[None, :, :]
        return torch.einsum("abe,me->abm", emb, self.emb_mix).softmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, height, width = x.shape
        s = self.block
        if height % s or width % s:
            raise ValueError(f"attention stem needs H and W divisible by {s}, got {height}x{width}")
        gh, gw, c, h, m = height // s, width // s, self.out_channels, self.heads, self.mixtures

        def windows(t: torch.Tensor, channels: int) -> torch.Tensor:
            # (B, channels, H, W) -> (B, gh, gw, s, s, channels)
            return t.reshape(b, channels, gh, s, gw, s).permute(0, 2, 4, 3, 5, 1)

        q = windows(self.query(x), c).reshape(b, gh, gw, s * s, h, c // h)
        k = windows(self.key(x), c).reshape(b, gh, gw, s * s, h, c // h)
        v_all = windows(self.value(x), c * m).reshape(b, gh, gw, s, s, m, c)
        v = torch.einsum("nxyabmc,abm->nxyabc", v_all, self.mixture_weights().to(v_all.dtype))
        v = v.reshape(b, gh, gw, s * s, h, c // h)
        attn = torch.einsum("nxyphd,nxyqhd->nxyhpq", q, k).softmax(-1).to(v.dtype)
        out = torch.einsum("nxyhpq,nxyqhd->nxyphd", attn, v)                        # Eq. 7
        out = out.reshape(b, gh, gw, s, s, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, height, width)
        return self.pool(self.relu(self.bn(out)))
