"""SASA's local attention as a function (Ramachandran et al., NeurIPS 2019, section 2.2, Eq. 3)::

    y_ij^n = sum_{ab in N_k(ij)} softmax_ab( q_ij^n . (k_ab^n + r^n_{a-i,b-j}) ) v_ab^n

on ``q, k, v`` of shape ``(B, heads, d, H, W)`` and the relative embeddings ``rel (heads, d, k*k)``
(:func:`.sasa.relative_embedding`), zero padding; the layer around it is :class:`.sasa.SASAttention2d`.

Two implementations compute the same function (equal within float rounding):

* :func:`local_attention_reference`: the straightforward one. ``F.unfold`` copies keys and values
  ``k*k`` times (49x for a 7x7 footprint) and autograd stores those copies for backward.
* :func:`local_attention` (the default), with two exact forms picked per map size:

  - ``"stream"``: a ``torch.autograd.Function`` that streams over the ``k*k`` footprint offsets,
    accumulating into the output, over cache-sized chunks of the batch. It stores only q, k, v,
    the output and the attention weights (``heads * k*k`` numbers per pixel instead of
    ``2 * C * k*k``) and recomputes the shifted keys and values in backward.
    The offset loops (logits, aggregation and their gradients) are the window ops of
    :mod:`.cpu_kernels`: one compiled pass each on CPU (the logits' content and relative terms in
    the same pass), one PyTorch op per offset elsewhere.
  - ``"dense"``, for maps of at most ``1.5 k^2 - 1`` positions (up to 8x8 for 7x7): masked
    attention over all ``H W`` positions of the map with batched matmuls, the zero-padding
    neighbours folded into the softmax denominator. On late-stage 4x4 maps most of a 7x7
    footprint is padding; this form does not multiply it out offset by offset.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from robust_attn.layers.cpu_kernels import uses_kernel, window_dot, window_dot_rel, window_scatter, window_sum
from robust_attn.layers.precision import accumulation_dtype, autocast_off

__all__ = ["local_attention", "local_attention_reference"]


def _exp_floor(dtype: torch.dtype) -> float:
    """Largest ``x`` below which ``exp(x)`` leaves the normal range of ``dtype``.

    Shifted logits below it are raised to it before ``exp``: CPUs compute subnormal results on a
    slow path (docs/performance.md, "Why each path exists"), and such weights are below ``1e-37``
    of the largest (``exp(0) = 1``), so the softmax changes by less than float32 resolution.
    """
    return math.log(torch.finfo(dtype).tiny) + 1.0


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel: torch.Tensor, kernel_size: int) -> None:
    if q.dim() != 5 or q.shape != k.shape or v.shape[:2] != q.shape[:2] or v.shape[3:] != q.shape[3:]:
        raise ValueError(f"expected q, k of shape (B, heads, d, H, W) and v of shape (B, heads, d_v, H, W), "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if kernel_size % 2 != 1:
        raise ValueError(f"kernel_size must be odd (a centred footprint), got {kernel_size}")
    if rel.shape != (q.shape[1], q.shape[2], kernel_size * kernel_size):
        raise ValueError(f"rel must have shape (heads, d, kernel_size**2) = "
                         f"{(q.shape[1], q.shape[2], kernel_size * kernel_size)}, got {tuple(rel.shape)}")


def local_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel: torch.Tensor,
                              kernel_size: int) -> torch.Tensor:
    """Eq. 3 with ``F.unfold``: the straightforward implementation (``k*k`` copies of k and v).

    ``q, k``: ``(B, heads, d, H, W)``; ``v``: ``(B, heads, d_v, H, W)``; ``rel``:
    ``(heads, d, k*k)`` relative embeddings of the footprint offsets in row-major order.
    Returns ``(B, heads, d_v, H, W)``.
    """
    _check_qkv(q, k, v, rel, kernel_size)
    b, h, d, height, width = q.shape
    dv = v.shape[2]
    kk = kernel_size * kernel_size
    pad = kernel_size // 2
    k_unf = F.unfold(k.reshape(b, h * d, height, width), kernel_size, padding=pad)
    v_unf = F.unfold(v.reshape(b, h * dv, height, width), kernel_size, padding=pad)
    k_unf, v_unf = k_unf.view(b, h, d, kk, height * width), v_unf.view(b, h, dv, kk, height * width)
    q_flat = q.reshape(b, h, d, height * width)
    logits = torch.einsum("bhdp,bhdop->bhop", q_flat, k_unf) + torch.einsum("bhdp,hdo->bhop", q_flat, rel)
    attn = logits.softmax(dim=2, dtype=accumulation_dtype(logits.dtype)).to(v.dtype)
    out = torch.einsum("bhop,bhvop->bhvp", attn, v_unf)
    return out.reshape(b, h, dv, height, width)


def _offsets(kernel_size: int):
    return [(i, j) for i in range(kernel_size) for j in range(kernel_size)]


def _offset_last(t: torch.Tensor) -> torch.Tensor:
    """``(k*k, B, heads, H, W)`` -> ``(B, heads, k*k, HW)`` (a view)."""
    return t.flatten(3).permute(1, 2, 0, 3)


# Batch chunk of the streaming and dense Functions: about this many bytes of logits per chunk (the
# largest per-chunk buffers: logits, then their gradient), so that a chunk's q, padded k and v and
# logits stay in cache across the k*k offsets (whole-batch passes at batch 128 on 16x16 maps send
# every offset's pass to main memory; docs/performance.md) and the transient
# memory stays a few of these; but never fewer than _CHUNK_MIN_PIXELS (batch x heads x positions)
# per offset slice, so that each op still splits across threads. Chunks are whole samples, so
# chunking changes no number.
_CHUNK_BYTES = 4 * 1024 * 1024
_CHUNK_MIN_PIXELS = 16384


def _batch_chunks(q: torch.Tensor, logits_per_pixel: int) -> list[tuple[int, int]]:
    """``(start, stop)`` batch ranges; ``logits_per_pixel``: logits per position and head."""
    b, h, _, height, width = q.shape
    per_sample = max(1, h * height * width * logits_per_pixel * q.element_size())
    step = max(1, _CHUNK_BYTES // per_sample, -(-_CHUNK_MIN_PIXELS // (h * height * width)))
    return [(s, min(s + step, b)) for s in range(0, b, step)]


def _stream_logits(qc: torch.Tensor, kp: torch.Tensor, rel: torch.Tensor, offsets,
                   logits: torch.Tensor) -> torch.Tensor:
    """Logits ``q . (k_o + r_o)`` of every offset into ``logits`` ``(k*k, b, heads, H, W)``;
    ``kp``: the zero-padded keys."""
    if uses_kernel(qc, kp, rel, logits):    # both terms in the compiled pass
        return window_dot_rel(qc, kp, rel, offsets, logits)
    window_dot(qc, kp, offsets, logits)
    if qc.shape[2] > 4:
        _offset_last(logits).add_(torch.matmul(rel.transpose(1, 2), qc.flatten(3)))    # + q . r_o
        return logits
    # + q . r_o; with an inner dimension of at most 4 a batched matmul costs more on CPU than
    # these fused multiply-adds into the logits in their own layout (docs/performance.md)
    flat = logits.flatten(3)                                                            # (k*k, b, heads, HW)
    for c in range(qc.shape[2]):
        flat.addcmul_(qc[:, :, c].flatten(2), rel[:, c].t()[:, None, :, None])
    return logits


def _normalise_(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over dim 0 (the offsets), in place unless the dtype changes (half precision is
    normalised in float32); returns the weights and the log-normaliser ``log sum_o exp(l_o)``."""
    x = logits.to(accumulation_dtype(logits.dtype))
    top = x.amax(0)
    x.sub_(top).clamp_(min=_exp_floor(x.dtype)).exp_()
    norm = x.sum(0)
    return x.div_(norm).to(logits.dtype), norm.log_().add_(top)


def _renormalise_(logits: torch.Tensor, log_norm: torch.Tensor) -> torch.Tensor:
    """The softmax weights again from recomputed logits and the saved log-normaliser."""
    x = logits.to(log_norm.dtype)
    return x.sub_(log_norm).clamp_(min=_exp_floor(x.dtype)).exp_().to(logits.dtype)


class _LocalAttention(torch.autograd.Function):
    """Eq. 3 streamed over the footprint offsets; backward recomputes the shifted k and v and the
    attention weights.

    The logits are kept offset-major, ``(k*k, B, heads, H, W)``, so each offset's slice is
    contiguous (on CPU the faster layout than ``(B, heads, k*k, H, W)``: docs/performance.md). Forward and backward run over
    chunks of the batch (:func:`_batch_chunks`), so logits, padded copies and temporaries exist
    for one chunk at a time. Saved for backward: q, k, v, rel, the output and one log-normaliser
    per pixel and head; the ``heads * k*k`` attention weights per pixel (24.5x the feature map at
    2 channels per head) are recomputed from them, as in memory-efficient attention, for one more
    pass over the offsets.
    """

    @staticmethod
    def forward(ctx, q, k, v, rel, kernel_size):
        with autocast_off(q.device):
            b, h, d, height, width = q.shape
            pad = kernel_size // 2
            offsets = _offsets(kernel_size)
            out = q.new_zeros(b, h, v.shape[2], height, width)
            log_norm = q.new_empty(b, h, height, width, dtype=accumulation_dtype(q.dtype))
            for b0, b1 in _batch_chunks(q, len(offsets)):
                qc, out_c = q[b0:b1], out[b0:b1]
                kp = F.pad(k[b0:b1], (pad, pad, pad, pad))
                logits = _stream_logits(qc, kp, rel, offsets, qc.new_empty(len(offsets), *qc.shape[:2], height, width))
                del kp
                attn_c, log_norm[b0:b1] = _normalise_(logits)
                vp = F.pad(v[b0:b1], (pad, pad, pad, pad))
                window_sum(attn_c, vp, offsets, out_c)
        ctx.save_for_backward(q, k, v, rel, log_norm, out)
        ctx.kernel_size = kernel_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, rel, log_norm, out = ctx.saved_tensors
        kernel_size = ctx.kernel_size
        need_q, need_k, need_v, need_rel = ctx.needs_input_grad[:4]
        with autocast_off(q.device):
            grad_out = grad_out.to(q.dtype)
            height, width = q.shape[-2:]
            pad = kernel_size // 2
            offsets = _offsets(kernel_size)
            grad_q = torch.empty_like(q) if need_q else None
            grad_k = torch.empty_like(k) if need_k else None
            grad_v = torch.empty_like(v) if need_v else None
            grad_rel = torch.zeros_like(rel) if need_rel else None
            for b0, b1 in _batch_chunks(q, len(offsets)):
                qc, go = q[b0:b1], grad_out[b0:b1]
                kp = F.pad(k[b0:b1], (pad, pad, pad, pad))
                ac = _renormalise_(_stream_logits(qc, kp, rel, offsets, qc.new_empty(len(offsets), *qc.shape[:2],
                                                                                    height, width)), log_norm[b0:b1])
                vp = F.pad(v[b0:b1], (pad, pad, pad, pad))
                grad_attn = torch.empty_like(ac)
                # sum_o a_o da_o = sum_o a_o (dy . v_o) = dy . y: one product instead of k*k
                dot = (go * out[b0:b1]).sum(2)
                window_dot(go, vp, offsets, grad_attn)
                if need_v:
                    grad_vp = window_scatter(ac, go, offsets, torch.zeros_like(vp))
                del vp
                if need_v:
                    grad_v[b0:b1] = grad_vp[..., pad:pad + height, pad:pad + width]
                    del grad_vp
                # softmax backward, in place: dlogits = a * (da - sum_o a_o da_o)
                grad_logits = grad_attn.sub_(dot).mul_(ac)
                del dot
                if need_q or need_k:
                    grad_qc = torch.matmul(rel, _offset_last(grad_logits)).view(qc.shape) if need_q else None
                    if need_q:
                        window_sum(grad_logits, kp, offsets, grad_qc, accumulate=True)
                    if need_k:
                        grad_kp = window_scatter(grad_logits, qc, offsets, torch.zeros_like(kp))
                    if need_q:
                        grad_q[b0:b1] = grad_qc
                    if need_k:
                        grad_k[b0:b1] = grad_kp[..., pad:pad + height, pad:pad + width]
                if need_rel:
                    grad_rel += torch.matmul(qc.flatten(3), _offset_last(grad_logits).transpose(2, 3)).sum(0)
        return grad_q, grad_k, grad_v, grad_rel, None


@functools.lru_cache(maxsize=64)
def _dense_tables(height: int, width: int, kernel_size: int, device: torch.device):
    """Index tables of the dense form on an ``H x W`` map (``N = H W`` positions).

    ``offset[p, p']``: the footprint offset (row-major, as :func:`relative_embedding`) at which key
    ``p'`` lies from query ``p`` (0 where it lies outside the footprint); ``not_footprint[p, p']``:
    ``p'`` is outside ``p``'s footprint; ``not_padding[p, o]``: offset ``o`` of ``p`` lands inside
    the map (so it is not a zero-padding position).
    """
    pad = kernel_size // 2
    ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    ys, xs = ys.flatten(), xs.flatten()
    dy = ys[None, :] - ys[:, None] + pad
    dx = xs[None, :] - xs[:, None] + pad
    inside = (dy >= 0) & (dy < kernel_size) & (dx >= 0) & (dx < kernel_size)
    offset = torch.where(inside, dy * kernel_size + dx, 0)
    oy = torch.arange(kernel_size).repeat_interleave(kernel_size) - pad
    ox = torch.arange(kernel_size).repeat(kernel_size) - pad
    ty, tx = ys[:, None] + oy[None, :], xs[:, None] + ox[None, :]
    in_map = (ty >= 0) & (ty < height) & (tx >= 0) & (tx < width)
    return offset.to(device), (~inside).to(device), in_map.to(device)


class _DenseLocalAttention(torch.autograd.Function):
    """Eq. 3 on a small map as masked dense attention over its ``N = H W`` positions.

    Exact, not an approximation: query ``p`` gets logits ``q_p . k_p' + q_p . r_{p'-p}`` for
    every key ``p'`` of the map inside its footprint (batched matmuls; the other keys are masked
    out), and its zero-padding neighbours, whose logits are ``q_p . r_o`` alone and whose values
    are zero, only add their ``exp`` to the softmax denominator. On a ``4 x 4`` map with a
    ``7 x 7`` footprint every key of the map is attended and 33 of the 49 offsets are padding,
    which the streaming form would multiply out one by one. Saves q, k, v, rel, the ``N x N``
    attention and one log-normaliser per query; runs over chunks of the batch like the
    streaming Function.
    """

    @staticmethod
    def forward(ctx, q, k, v, rel, kernel_size):
        with autocast_off(q.device):
            b, h, d, height, width = q.shape
            dv, n = v.shape[2], height * width
            offset, not_footprint, in_map = _dense_tables(height, width, kernel_size, q.device)
            sdt = accumulation_dtype(q.dtype)
            floor = _exp_floor(sdt)
            attn = q.new_empty(b, h, n, n)
            log_norm = q.new_empty(b, h, n, 1, dtype=sdt)
            out = q.new_empty(b, h, dv, n)
            for b0, b1 in _batch_chunks(q, n):
                qc, kc = q[b0:b1].flatten(3), k[b0:b1].flatten(3)                  # (bc, h, d, N)
                qr = torch.matmul(qc.transpose(2, 3), rel)                          # (bc, h, N, k*k)
                logits = torch.matmul(qc.transpose(2, 3), kc).add_(qr.gather(3, offset.expand(*qr.shape[:2], n, n)))
                logits = logits.to(sdt).masked_fill_(not_footprint, float("-inf"))
                pad_logits = qr.to(sdt).masked_fill_(in_map, float("-inf"))
                top = torch.maximum(logits.amax(3, keepdim=True), pad_logits.amax(3, keepdim=True))
                weights = logits.sub_(top).clamp_(min=floor).exp_().masked_fill_(not_footprint, 0.0)
                pad_mass = pad_logits.sub_(top).clamp_(min=floor).exp_().masked_fill_(in_map, 0.0).sum(3, keepdim=True)
                norm = weights.sum(3, keepdim=True).add_(pad_mass)
                attn[b0:b1] = weights.div_(norm)
                log_norm[b0:b1] = norm.log_().add_(top)
                torch.matmul(v[b0:b1].flatten(3), attn[b0:b1].transpose(2, 3), out=out[b0:b1])
        out = out.view(b, h, dv, height, width)
        ctx.save_for_backward(q, k, v, rel, attn, log_norm, out)
        ctx.kernel_size = kernel_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, rel, attn, log_norm, out = ctx.saved_tensors
        with autocast_off(q.device):
            b, h, d, height, width = q.shape
            n = height * width
            offset, _, in_map = _dense_tables(height, width, ctx.kernel_size, q.device)
            grad_out = grad_out.to(q.dtype).flatten(3)
            grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            grad_rel = torch.zeros_like(rel)
            for b0, b1 in _batch_chunks(q, n):
                qc, kc, vc, go, ac = (q[b0:b1].flatten(3), k[b0:b1].flatten(3), v[b0:b1].flatten(3),
                                      grad_out[b0:b1], attn[b0:b1])
                grad_v[b0:b1] = torch.matmul(go, ac).view(grad_v[b0:b1].shape)
                grad_attn = torch.matmul(go.transpose(2, 3), vc)                    # (bc, h, N, N)
                dot = (go * out[b0:b1].flatten(3)).sum(2).unsqueeze(3)              # sum_p' a da = dy . y
                grad_logits = grad_attn.sub_(dot).mul_(ac)                          # softmax backward
                # padding neighbours: weight exp(q.r_o - log_norm), upstream gradient 0
                qr = torch.matmul(qc.transpose(2, 3), rel)
                pad_w = qr.to(log_norm.dtype).sub_(log_norm[b0:b1]).exp_().masked_fill_(in_map, 0.0)
                grad_qr = pad_w.mul_(dot.neg_()).to(q.dtype)
                grad_qr.scatter_add_(3, offset.expand(*grad_logits.shape), grad_logits)
                grad_q[b0:b1] = (torch.matmul(kc, grad_logits.transpose(2, 3))
                                 + torch.matmul(rel, grad_qr.transpose(2, 3))).view(grad_q[b0:b1].shape)
                grad_k[b0:b1] = torch.matmul(qc, grad_logits).view(grad_k[b0:b1].shape)
                grad_rel += torch.matmul(qc, grad_qr).sum(0)
        return grad_q, grad_k, grad_v, grad_rel, None


def _use_dense(height: int, width: int, kernel_size: int) -> bool:
    # Dense attends to N + 1 columns per query instead of k*k offsets, in batched matmuls: on CPU
    # it wins while N + 1 <= 1.5 k*k (maps up to 8x8 for a 7x7 footprint; the timings are in
    # docs/performance.md). Its autograd-saved tensors are a few N x N per head, small on such maps.
    return height * width + 1 <= 1.5 * kernel_size * kernel_size


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel: torch.Tensor,
                    kernel_size: int, method: str = "auto") -> torch.Tensor:
    """Eq. 3, memory-lean: same arguments and result as :func:`local_attention_reference`.

    ``method``: ``"stream"`` (the custom Function streaming over the offsets), ``"dense"``
    (masked dense attention, for small maps) or ``"auto"``: dense where ``H W + 1 <= 1.5 k^2``
    (maps up to 8x8 for a 7x7 footprint), else stream. All three compute the same function.
    Works in any floating dtype; under autocast q, k, v and rel are cast to one dtype (v's) first
    and the softmax runs in float32 for half precision.
    """
    _check_qkv(q, k, v, rel, kernel_size)
    if method not in ("auto", "stream", "dense"):
        raise ValueError(f"method must be 'auto', 'stream' or 'dense', got {method!r}")
    dtype = v.dtype
    q, k, rel = q.to(dtype), k.to(dtype), rel.to(dtype)
    if method == "dense" or (method == "auto" and _use_dense(q.shape[3], q.shape[4], kernel_size)):
        return _DenseLocalAttention.apply(q, k, v, rel, kernel_size)
    return _LocalAttention.apply(q, k, v, rel, kernel_size)
