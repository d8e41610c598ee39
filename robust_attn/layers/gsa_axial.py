"""GSA's axial positional attention (Shen et al., section 3.1.2, Eq. 2; appendix B, Eq. 5-7) in the
other order of its two contractions, for small heads.

The column layer is ``out[x, y] = sum_i (q_xy . P[x, i]) v[i, y]`` per head (no softmax).
:func:`robust_attn.layers.gsa.axial_positional_attention` (the reference) forms the weights
``q_xy . P[x, i]`` first: ``L`` numbers per position and head, then a batched matmul with one tiny
``(L x L) @ (L x d_v)`` product per column. Summing over ``i`` first gives the same function::

    out[v, x, y] = sum_k q[k, x, y] U[k, v, x, y],   U[k, v, x, y] = sum_i P[x, i, k] v[v, i, y]

``U`` is one matmul per head of ``P`` (``(L d_k) x L``) with all the head's values at once
(``L x (d_v W)``), and the result is ``d_k d_v`` multiply-adds per position. With few channels per
head (the width-0.25 zoo models have 2-4 on their 16x16 and 8x8 maps) that is less memory traffic
than the ``L`` weights per position and no per-column matmuls; with many channels on small maps the
reference order is the cheaper one (:func:`factored_is_cheaper`; timings in docs/performance.md).
The row layer is the column layer on the transposed maps. :class:`~robust_attn.layers.gsa.GlobalSelfAttention2d`
picks the order per shape on its lean path.
"""
from __future__ import annotations

import torch

__all__ = ["axial_positional_attention_factored", "factored_is_cheaper"]


def _column_factored(q: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    b, n, dk, length, width = q.shape
    dv = v.shape[2]
    p = pos.permute(0, 2, 1).reshape(length * dk, length)                       # (x k, i)
    u = torch.matmul(p, v.transpose(2, 3).reshape(b * n, length, dv * width))   # (bn, x k, v y)
    u = u.view(b, n, length, dk, dv, width)
    return (q.permute(0, 1, 3, 2, 4).unsqueeze(4) * u).sum(3).transpose(2, 3)   # (b, n, v, x, y)


def axial_positional_attention_factored(q: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                                        axis: str) -> torch.Tensor:
    """Same arguments and result as :func:`robust_attn.layers.gsa.axial_positional_attention`,
    computed as ``q . U`` (module docstring)."""
    if axis == "column":
        return _column_factored(q, v, pos)
    if axis == "row":
        return _column_factored(q.transpose(3, 4), v.transpose(3, 4), pos).transpose(3, 4)
    raise ValueError(f"axis must be 'column' or 'row', got {axis!r}")


def factored_is_cheaper(key_dim: int, value_dim: int, length: int) -> bool:
    """Whether the factored order moves less memory on a CPU: ``d_k d_v`` products per position
    against the reference's ``L`` weights per position, counted twice for its per-column matmuls."""
    return key_dim * value_dim <= 2 * length
