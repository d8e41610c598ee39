"""The global self-attention (GSA) module (Shen et al., "Global Self-Attention Networks for Image
Recognition", section 3.1 and appendix B).

Keys, queries and values come from 1x1 convolutions without bias (appendix B, Eq. 3) and are split
into ``heads`` heads of ``d_k = key_channels / heads`` and ``d_v = out_channels / heads``
channels. Two parallel layers, whose outputs are summed (Eq. 8):

* **Content attention** (section 3.1.1, Eq. 1; appendix B, Eq. 4):
  ``F^c = Q (rho(K^T) V)`` per head, with ``rho`` a softmax of every key channel over the spatial
  positions and no normalisation of the queries. :func:`content_attention` first forms the
  ``d_k x d_v`` context ``softmax(K)^T V`` per head, then ``Q @ context``: memory and time are
  linear in the number of positions ``N``; no ``N x N`` tensor is ever formed.
* **Positional attention** (section 3.1.2, Eq. 2; appendix B, Eq. 5-7): a column-only layer,
  batch normalization, then a row-only layer. The column layer at pixel ``(x, y)`` weights the
  values of its column by ``q_xy . r_{i-x}`` (no softmax, Eq. 2 and 7) with learned relative
  embeddings ``R^c`` of shape ``(2L - 1) x d_k``, shared across heads (section 4). The row layer
  does the same along the row with its own ``R^r``, the same queries, and the batch-normalised
  column output as its values (appendix B). :func:`axial_positional_attention` implements one
  such layer with einsums; its cost is ``O(N sqrt(N))``.

``L`` is the feature size the module is built for (``feature_size``: the side of the map at that
layer, so the positional attention is global, appendix B ``L = max(h, w)``). The embedding tables
hold the offsets ``-(L-1) .. L-1``. An input with a side up to ``L`` uses the central part of the
tables (its offsets are all there; nothing is interpolated); a larger input raises a
``ValueError`` that says to build the model for that image size.

``stride=2`` appends the 2x2/2 average pooling that the GSA networks put after the first GSA
module of residual groups 2-4 (section 4, "Model").

There is no output projection after the module (the bottleneck's 1x1 expansion follows it);
with one the parameter counts would overshoot GSA Table 6.

The paper gives no initialization. The 1x1 convolutions use He's (fan out) as the zoo's other
layers do; the relative embeddings start at ``N(0, d_k^-1/2)``, Attention Augmentation's scale for
its relative embeddings (AA Figure 8), so that ``q . r`` starts at the scale of ``q . k``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from robust_attn.layers.gsa_axial import axial_positional_attention_factored, factored_is_cheaper
from robust_attn.layers.precision import accumulation_dtype

__all__ = ["content_attention", "relative_to_absolute", "axial_positional_attention", "GlobalSelfAttention2d"]


def content_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """GSA Eq. 1 / Eq. 4: ``Q (softmax_N(K)^T V)`` per head, linear in the number of positions.

    ``q, k``: ``(B, heads, d_k, N)``; ``v``: ``(B, heads, d_v, N)``; returns ``(B, heads, d_v, N)``.
    The largest intermediate is ``softmax(K)`` (same size as ``K``); the context is
    ``(B, heads, d_k, d_v)``.
    """
    if q.shape != k.shape or v.shape[:2] != q.shape[:2] or v.shape[-1] != q.shape[-1] or q.dim() != 4:
        raise ValueError(f"expected q, k (B, heads, d_k, N) and v (B, heads, d_v, N), "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    k_hat = k.softmax(dim=-1, dtype=accumulation_dtype(k.dtype)).to(v.dtype)
    context = torch.einsum("bnkp,bnvp->bnkv", k_hat, v)
    return torch.einsum("bnkp,bnkv->bnvp", q, context)


def relative_to_absolute(rel: torch.Tensor, size: int) -> torch.Tensor:
    """Appendix B, Eq. 5-6: ``P[x, i] = R[i - x + L - 1]`` for ``x, i < size``; ``(size, size, d_k)``.

    ``rel``: ``(2L - 1, d_k)``, row ``r`` holding offset ``r - (L - 1)``. Needs ``size <= L``.
    """
    max_len = (rel.shape[0] + 1) // 2
    if size > max_len:
        raise ValueError(f"relative embeddings cover offsets up to {max_len - 1} (feature size {max_len}); "
                         f"got a map of side {size}")
    pos = torch.arange(size, device=rel.device)
    return rel[pos[None, :] - pos[:, None] + max_len - 1]


def axial_positional_attention(q: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, axis: str) -> torch.Tensor:
    """GSA Eq. 2 / Eq. 7: one column-only (``axis="column"``) or row-only (``"row"``) layer.

    ``q``: ``(B, heads, d_k, H, W)``; ``v``: ``(B, heads, d_v, H, W)``; ``pos``: ``P`` of
    :func:`relative_to_absolute` for the axis' length. Output ``(B, heads, d_v, H, W)`` with
    ``out[x, y] = sum_i (q_xy . P[x, i]) v[i, y]`` (column) or
    ``out[x, y] = sum_j (q_xy . P[y, j]) v[x, j]`` (row).
    """
    if axis == "column":
        weights = torch.einsum("bnkxy,xik->bnxyi", q, pos)
        return torch.einsum("bnxyi,bnviy->bnvxy", weights, v)
    if axis == "row":
        weights = torch.einsum("bnkxy,yjk->bnxyj", q, pos)
        return torch.einsum("bnxyj,bnvxj->bnvxy", weights, v)
    raise ValueError(f"axis must be 'column' or 'row', got {axis!r}")


class GlobalSelfAttention2d(nn.Module):
    """The GSA module: content attention + (column, BN, row) positional attention, summed.

    Args:
        in_channels: channels of the input.
        out_channels: value and output channels (``d_out``); divisible by ``heads``.
        feature_size: ``L``, the largest map side the module accepts (the side of the map at this
            layer); the relative embedding tables have ``2L - 1`` rows.
        heads: attention heads (8 in the paper).
        key_channels: total query/key channels; default ``in_channels`` (section 4: "the number
            of channels for K, Q, V ... the same as the corresponding input features").
        stride: 1, or 2 for 2x2/2 average pooling after the module.
    """

    def __init__(self, in_channels: int, out_channels: int, feature_size: int, heads: int = 8,
                 key_channels: int | None = None, stride: int = 1):
        super().__init__()
        key_channels = key_channels or in_channels
        if key_channels % heads or out_channels % heads:
            raise ValueError(f"key_channels ({key_channels}) and out_channels ({out_channels}) must be "
                             f"divisible by heads ({heads}); change heads or the width multiplier")
        if feature_size < 1:
            raise ValueError(f"feature_size must be positive, got {feature_size}")
        if stride not in (1, 2):
            raise ValueError(f"stride must be 1 or 2 (2x2 average pooling), got {stride}")
        self.in_channels, self.out_channels, self.key_channels = in_channels, out_channels, key_channels
        self.heads, self.feature_size, self.stride = heads, feature_size, stride
        self.key_dim, self.value_dim = key_channels // heads, out_channels // heads
        self.query = nn.Conv2d(in_channels, key_channels, 1, bias=False)
        self.key = nn.Conv2d(in_channels, key_channels, 1, bias=False)
        self.value = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.rel_column = nn.Parameter(torch.empty(2 * feature_size - 1, self.key_dim))
        self.rel_row = nn.Parameter(torch.empty(2 * feature_size - 1, self.key_dim))
        self.norm = nn.BatchNorm2d(out_channels)       # between the column and row layers
        self.pool = nn.AvgPool2d(2, 2) if stride == 2 else nn.Identity()
        self.impl = "lean"     # or "reference": the axial layers' einsums alone (robust_attn.layers.paths)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for conv in (self.query, self.key, self.value):
            nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
        nn.init.normal_(self.rel_column, std=self.key_dim ** -0.5)
        nn.init.normal_(self.rel_row, std=self.key_dim ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"expected input (B, {self.in_channels}, H, W), got {tuple(x.shape)}")
        b, _, height, width = x.shape
        if max(height, width) > self.feature_size:
            raise ValueError(f"GSA module built for maps up to {self.feature_size}x{self.feature_size} "
                             f"(its relative position embeddings are tied to that size) got {height}x{width}; "
                             f"build the model with image_size= the input size you feed it")
        n, dk, dv = self.heads, self.key_dim, self.value_dim
        q = self.query(x).reshape(b, n, dk, height, width)
        k = self.key(x).reshape(b, n, dk, height, width)
        v = self.value(x).reshape(b, n, dv, height, width)
        content = content_attention(q.flatten(3), k.flatten(3), v.flatten(3)).view(b, n, dv, height, width)
        pos_col = relative_to_absolute(self.rel_column, height).to(q.dtype)
        pos_row = relative_to_absolute(self.rel_row, width).to(q.dtype)
        column = self._axial(q, v, pos_col, "column")
        column = self.norm(column.reshape(b, self.out_channels, height, width)).reshape(b, n, dv, height, width)
        row = self._axial(q, column.to(q.dtype), pos_row, "row")
        out = (content + row).reshape(b, self.out_channels, height, width)
        return self.pool(out)

    def _axial(self, q: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, axis: str) -> torch.Tensor:
        """One axial layer; on the lean path on CPU in the factored order where it is the cheaper
        (:mod:`.gsa_axial`; the same function)."""
        length = q.shape[3] if axis == "column" else q.shape[4]
        if self.impl == "lean" and q.device.type == "cpu" and factored_is_cheaper(q.shape[2], v.shape[2], length):
            return axial_positional_attention_factored(q, v, pos, axis)
        return axial_positional_attention(q, v, pos, axis)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, feature_size={self.feature_size}, heads={self.heads}, "
                f"key_channels={self.key_channels}, stride={self.stride}")
