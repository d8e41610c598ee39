"""SAN pairwise attention, lean path (eq. 2-3; the module docstring of :mod:`.san` says what
"lean" means): gamma's BatchNorm statistics (BN1's in closed form from k x k window sums for the
linear relations, :func:`_difference_moments`), the chunked logits and :class:`_PairwiseAttention`,
the autograd function that runs gamma from its first ReLU, the softmax and the aggregation with a
hand-written backward. On CPU with a linear relation the compiled kernels of
:class:`.san_fused.FusedPairwiseAttention` take the whole footprint instead.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from robust_attn.layers import cpu_kernels
from robust_attn.layers.lean_ops import (bn_affine, bn_backward_coefficients, bn_scale_shift, maybe_checkpoint,
                                         mean_var, matmul1x1, matmul1x1_weight_grad, channel_moments, update_running)
from robust_attn.layers.local_aggregation import (accumulate_aggregate_grads, aggregate_grad_buffer,
                                                  footprint_aggregate, footprint_offsets, grouped_padded,
                                                  reflect_pad, reflect_pad_backward, shifted, unpadded_gradient)
from robust_attn.layers.precision import accumulation_dtype, autocast_off
from robust_attn.layers.san_relations import pair_relation, positions
from robust_attn.layers.san_fused import FusedPairwiseAttention

if TYPE_CHECKING:
    from robust_attn.layers.san import SelfAttention2d


def _window_counts(n: int, k: int, like: torch.Tensor) -> torch.Tensor:
    """How many of the ``n`` windows of length ``k`` (stride 1) cover each of the ``n + k - 1``
    positions of a padded axis."""
    idx = torch.arange(n + k - 1, device=like.device)
    return (torch.minimum(idx, torch.full_like(idx, n - 1)) - torch.clamp(idx - k + 1, min=0) + 1).to(like.dtype)


def _window_sum(x: torch.Tensor, k: int) -> torch.Tensor:
    """Sum over every k x k window (stride 1, no padding) of ``x``'s last two dims, as k shifted adds
    along rows, then k along columns (on CPU the faster form than ``avg_pool2d`` times ``k^2``:
    docs/performance.md)."""
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
    p = matmul1x1(w1p, pos[:, :, sl]).flatten(2)
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
            hid = matmul1x1(w1c, u, _chunk_bias(w1pc, posc, sl))
            sums = sums + channel_moments(hid, (0, 2, 3, 4))
            hidden = hid if single else None
        mean, var = mean_var(sums, n * area * h * w)
    else:
        mean, var = plan.running_mean.to(st), plan.running_var.to(st)
    scale, shift = bn_scale_shift(bn2_weight.to(st), bn2_bias.to(st), mean, var, plan.eps)
    scale_c, shift_c = scale.to(dt), shift.to(dt)
    logits = None if single else u.new_empty(n, w2.shape[0], area, h, w)
    for i, (chunk, sl) in enumerate(zip(plan.chunks, plan.slices)):
        if hidden is not None:  # one chunk in training: h is at hand
            y = torch.addcmul(shift_c.view(1, -1, 1, 1, 1), hidden, scale_c.view(1, -1, 1, 1, 1))
            del hidden
        else:  # BN2 folded into the first layer: s (W1 u + pos) + t
            u = u if i == 0 and not plan.training else plan.first(chunk, *inputs)
            y = matmul1x1(w1c * scale_c[:, None], u, _chunk_bias(w1pc, posc, sl, scale_c, shift_c))
        del u
        part = matmul1x1(w2c, y.relu_(), b2c)
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
    Activation checkpointing would replay the forward's autograd graph per chunk instead; this is
    the cheaper of the two (docs/performance.md, "Why each path exists").

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
        scale, shift = bn_scale_shift(bn2_weight.to(st), bn2_bias.to(st), mean, var, plan.eps)
        view = (1, -1, 1, 1, 1)
        scale_c, shift_c = scale.to(dt).view(view), shift.to(dt).view(view)
        lse = lse[:, :, None]

        def logit_grads(sl, z):
            """The chunk's logits' gradient ``w (gw - D)``, its ``v`` gradient added to ``grad_buffer``."""
            weights = matmul1x1(w2c, z, b2c).to(st).sub_(lse).exp_()
            gw = accumulate_aggregate_grads(vpad, weights.to(vpad.dtype), grad_y, k, sl.start, grad_buffer)
            return weights.mul_(gw.to(st).sub_(d_dot)).to(dt)

        def chunk_grads(u, sl, g_logits):
            """h, the gradient at BN2's output (through relu), relu(BN2(h)) and the logits' gradient."""
            hid = matmul1x1(w1c, u, _chunk_bias(w1pc, posc, sl))
            z = torch.addcmul(shift_c, hid, scale_c).relu_()
            if g_logits is None:
                g_logits = logit_grads(sl, z)
            gz = torch.ops.aten.threshold_backward(matmul1x1(w2t, g_logits), z, 0)
            return hid, gz, z, g_logits

        def accumulate(sums, hid, gz, z, g_logits):
            """grad W2, per hidden channel sum(gz) and sum(gz * h) (BN2's parameter gradients), grad b2."""
            gw2 = matmul1x1_weight_grad(g_logits, z)
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
                _, c1, c0 = bn_backward_coefficients(scale, rstd, mean, *sums[1], count)
                gh = gz.mul_(scale_c).addcmul_(hid, c1.to(dt).view(view)).add_(c0.to(dt).view(view))
            else:
                gh = gz.mul_(scale_c)
            del hid
            grad_w1 += matmul1x1_weight_grad(gh, u.detach()).to(st)
            if grad_pos is not None:  # pos enters as w1p pos, the same for every image
                g_pos = gh.sum(0, keepdim=True)
                grad_w1p += (g_pos.flatten(2)[0] @ posc[:, :, sl].flatten(2)[0].t()).to(st)
                grad_pos[:, :, sl] = matmul1x1(w1pc.t().contiguous(), g_pos)
                del g_pos
            grad_u = matmul1x1(w1t, gh)
            del gh
            if wanted:
                grads = torch.autograd.grad(u, [leaves[j] for j in wanted], grad_u)
                for j, g in zip(wanted, grads):
                    grad_inputs[j] = g if grad_inputs[j] is None else grad_inputs[j] + g
            del u, grad_u

        grad_w2, (g_bias, g_hsum), grad_b2 = sums
        g_weight = bn_backward_coefficients(scale, rstd, mean, g_bias, g_hsum, count)[0]
        grad_v = None if grad_buffer is None else unpadded_gradient(grad_buffer, v, k)
        return (None, grad_w1.to(w1.dtype), None if grad_w1p is None else grad_w1p.to(w1p.dtype),
                None if grad_pos is None else grad_pos.to(pos.dtype),
                grad_w2.to(w2.dtype), grad_b2.to(b2.dtype), g_weight.to(bn2_weight.dtype),
                g_bias.to(bn2_bias.dtype), grad_v, *grad_inputs)


def pairwise_attention(m: SelfAttention2d, x, x1, x2, v, chunks, index_chunks) -> torch.Tensor:
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
        return pair_relation(m.relation, x1_[:, :, None], shifted(x2p_, chunk, h, w))

    linear = m.relation in ("subtraction", "summation")
    sign = -1.0 if m.relation == "subtraction" else 1.0
    x2p = None if linear else reflect_pad(x2, k // 2)
    if training:
        if linear:
            s1 = _difference_moments(x1, x2, k, sign)
        else:
            s1 = sum(maybe_checkpoint(lambda a, b, c=c: channel_moments(delta(c, a, b), (0, 2, 3, 4)), x1, x2p)
                     for c in chunks)
        mean1, var1 = mean_var(s1, count)
    else:
        mean1, var1 = bn1.running_mean[:dr], bn1.running_var[:dr]

    pos = None
    if m.position_encoding:
        p = positions(m, x)
        pd = (p[:, :, None] - shifted(reflect_pad(p, k // 2), footprint_offsets(k), h, w)).to(x1.dtype)
        if training:
            mean_p, var_p = mean_var(channel_moments(pd, (0, 2, 3, 4)), area * h * w)
        else:
            mean_p, var_p = bn1.running_mean[dr:], bn1.running_var[dr:]
        pos = F.relu(bn_affine(pd, bn1.weight[dr:], bn1.bias[dr:], bn1.eps, mean_p, var_p))
        if training:
            update_running(bn1, torch.cat([mean1, mean_p]), torch.cat([var1, var_p]), count)
    elif training:
        update_running(bn1, mean1, var1, count)

    if linear:
        scale1 = bn1.weight[:dr] * torch.rsqrt(var1 + bn1.eps)
        center = torch.addcmul((bn1.bias[:dr] - mean1 * scale1).view(1, -1, 1, 1), x1, scale1.view(1, -1, 1, 1))
        neighbour = reflect_pad(x2 * (sign * scale1).view(1, -1, 1, 1), k // 2)

        def first(chunk, center_, neighbour_):
            return shifted(neighbour_, chunk, h, w).add_(center_[:, :, None]).relu_()
        inputs = (center, neighbour)
    else:
        def first(chunk, x1_, x2p_, mean1_, var1_, weight1_, bias1_):
            return F.relu(bn_affine(delta(chunk, x1_, x2p_), weight1_, bias1_, bn1.eps, mean1_, var1_), True)
        inputs = (x1, x2p, mean1, var1, bn1.weight[:dr], bn1.bias[:dr])

    w1p = w1[:, dr:] if m.position_encoding else None
    w2 = conv2.weight.flatten(1)
    if linear and cpu_kernels.uses_kernel(v, w1, w2, *inputs):  # whole footprint, fused per tile
        out, mean2, var2 = FusedPairwiseAttention.apply(footprint_offsets(k), training, bn2.eps, bn2.running_mean,
                                                         bn2.running_var, w1[:, :dr], w1p, pos, w2, conv2.bias,
                                                         bn2.weight, bn2.bias, v, *inputs)
    else:
        plan = _GammaPlan(first, chunks, slices, k, training, bn2.eps, bn2.running_mean, bn2.running_var)
        out, mean2, var2 = _PairwiseAttention.apply(plan, w1[:, :dr], w1p, pos, w2, conv2.bias, bn2.weight,
                                                    bn2.bias, v, *inputs)
    if training:
        update_running(bn2, mean2, var2, count)
    return out
