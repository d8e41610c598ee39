"""The compiled CPU kernels (robust_attn/layers/csrc/) against their PyTorch counterparts: the window
kernels against their loops, SAN's fused pairwise operator against the chunked PyTorch path, and the
attention operators built on them with the kernels on and off."""
from __future__ import annotations

import copy

import pytest
import torch

from robust_attn.layers import cpu_kernels
from robust_attn.layers.local_aggregation import footprint_aggregate, footprint_aggregate_unfold, footprint_offsets
from robust_attn.layers import san_fused
from robust_attn.layers.san import SelfAttention2d
from robust_attn.layers.local_attention import local_attention, local_attention_reference

needs_kernel = pytest.mark.skipif(not cpu_kernels.kernel_available(),
                                  reason="no C++ compiler/ninja to build the CPU window kernels")


def _disable_kernels(monkeypatch):
    """Run the PyTorch loops, as on a machine where the kernel cannot be built."""
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_load_failed", True)


@pytest.fixture(params=["kernels on", "kernels off"])
def kernel_mode(request, monkeypatch):
    """Both paths: the compiled kernel (skipped without a compiler) and the PyTorch loops."""
    if request.param == "kernels off":
        _disable_kernels(monkeypatch)
    elif not cpu_kernels.kernel_available():
        pytest.skip("no C++ compiler/ninja to build the CPU window kernels")
    return request.param


def _operands(dtype, footprint=5, shape=(2, 3, 4, 6, 9), offsets=None):
    """Features, padded features and weights in the kernels' layouts, all non-contiguous views."""
    torch.manual_seed(0)
    b, g, d, h, w = shape
    pad = footprint - 1
    offsets = offsets or footprint_offsets(footprint)
    a = torch.randn(b, d, g, h, w, dtype=dtype).transpose(1, 2)
    bpad = torch.randn(b, d, g, h + pad, w + pad, dtype=dtype).transpose(1, 2)
    weight = torch.randn(b, g, len(offsets), h, w, dtype=dtype).permute(2, 0, 1, 3, 4)
    return a, bpad, weight, offsets


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("footprint,first,count", [(5, 0, 25), (7, 9, 12), (3, 4, 1)])
def test_kernels_equal_torch_loops(dtype, footprint, first, count):
    offsets = footprint_offsets(footprint)[first:first + count]
    a, bpad, weight, offsets = _operands(dtype, footprint, offsets=offsets)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    dot = cpu_kernels.window_dot(a, bpad, offsets, torch.empty(weight.shape, dtype=dtype))
    torch.testing.assert_close(dot, cpu_kernels.window_dot_torch(a, bpad, offsets, torch.empty_like(dot)), **tol)
    start = torch.randn(a.shape, dtype=dtype)
    for accumulate in (False, True):
        got = cpu_kernels.window_sum(weight, bpad, offsets, start.clone(), accumulate)
        want = cpu_kernels.window_sum_torch(weight, bpad, offsets, start.clone(), accumulate)
        torch.testing.assert_close(got, want, **tol)
    start = torch.randn(bpad.shape, dtype=dtype)
    got = cpu_kernels.window_scatter(weight, a, offsets, start.clone())
    torch.testing.assert_close(got, cpu_kernels.window_scatter_torch(weight, a, offsets, start.clone()), **tol)
    x = weight.permute(1, 2, 0, 3, 4)  # (B, C, K, H, W), non-contiguous
    start = torch.randn(bpad.shape[0], bpad.shape[1], *bpad.shape[3:], dtype=dtype)
    got = cpu_kernels.window_fold(x, offsets, start.clone())
    torch.testing.assert_close(got, cpu_kernels.window_fold_torch(x, offsets, start.clone()), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_window_dot_rel_adds_the_relative_term_per_offset(dtype, kernel_mode):
    """SASA's logits: sum_d a_d (bpad_d shifted by offset o + rel[g, d, o]), written out per offset."""
    a, bpad, weight, offsets = _operands(dtype, footprint=5, offsets=footprint_offsets(5)[3:17])
    rel = torch.randn(a.shape[1], a.shape[2], len(offsets), dtype=dtype)
    h, w = a.shape[-2:]
    want = torch.stack([(a * (bpad[..., dy:dy + h, dx:dx + w] + rel[:, :, o, None, None])).sum(2)
                        for o, (dy, dx) in enumerate(offsets)])
    got = cpu_kernels.window_dot_rel(a, bpad, rel, offsets, torch.full(weight.shape, float("nan"), dtype=dtype))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, **tol)


@needs_kernel
def test_window_dot_rel_rejects_a_mismatched_table():
    a, bpad, weight, offsets = _operands(torch.float32, footprint=3)
    with pytest.raises(RuntimeError, match="rel must be"):
        cpu_kernels.window_dot_rel(a, bpad, torch.randn(a.shape[1], a.shape[2], len(offsets) + 1), offsets,
                                   torch.empty(weight.shape))


@needs_kernel
def test_kernel_writes_into_strided_output_views():
    """SAN hands the kernels (N, S, G, ...) tensors viewed group-major: the results land in place."""
    a, bpad, weight, offsets = _operands(torch.float32)
    out = torch.zeros(a.shape[0], a.shape[2], a.shape[1], *a.shape[3:]).transpose(1, 2)  # non-contiguous
    cpu_kernels.window_sum(weight, bpad, offsets, out)
    want = cpu_kernels.window_sum_torch(weight, bpad, offsets, torch.zeros(a.shape))
    torch.testing.assert_close(out, want)


@needs_kernel
def test_kernel_rejects_offsets_outside_the_padded_map():
    a, bpad, weight, _ = _operands(torch.float32, footprint=3)
    with pytest.raises(RuntimeError, match="leaves the padded map"):
        cpu_kernels.window_dot(a, bpad, [(0, 0), (3, 0)], torch.empty(2, *weight.shape[1:]))


def test_other_dtypes_use_the_torch_loops():
    a, bpad, weight, offsets = _operands(torch.bfloat16, footprint=3)
    assert not cpu_kernels.uses_kernel(a, bpad)
    assert not cpu_kernels.uses_kernel(a.float(), bpad.double())
    out = cpu_kernels.window_dot(a, bpad, offsets, torch.empty(weight.shape, dtype=torch.bfloat16))
    want = cpu_kernels.window_dot_torch(a.float(), bpad.float(), offsets, torch.empty(weight.shape))
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def _aggregate_case():
    torch.manual_seed(1)
    v = torch.randn(2, 8, 6, 7, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 4, 9, 6, 7, dtype=torch.float64, requires_grad=True)
    return v, weight


def test_streaming_aggregation_equals_unfold_and_passes_gradcheck(kernel_mode):
    v, weight = _aggregate_case()
    out = footprint_aggregate(v, weight, 3, kernel="stream")
    torch.testing.assert_close(out, footprint_aggregate_unfold(v, weight, 3))
    assert torch.autograd.gradcheck(lambda a, b: footprint_aggregate(a, b, 3, kernel="stream"), (v, weight))


@needs_kernel
@pytest.mark.parametrize("attention", ["pairwise", "patchwise"])
def test_san_lean_same_with_and_without_kernels(attention, monkeypatch):
    torch.manual_seed(2)
    m = SelfAttention2d(32, attention=attention, footprint=5, chunk_size=7).double().train()
    x = torch.randn(2, 32, 9, 17, dtype=torch.float64)

    def run():
        xi = x.clone().requires_grad_()
        out = m(xi)
        out.square().sum().backward()
        grads = [xi.grad] + [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        return out, grads

    with_kernel = run()
    _disable_kernels(monkeypatch)
    torch.testing.assert_close(run(), with_kernel)


def _train_and_backward(m: SelfAttention2d, x: torch.Tensor):
    """Output, the input's and every parameter's gradient, and the buffers after one step of ``m``."""
    xi = x.clone().requires_grad_()
    out = m(xi)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = [xi.grad] + [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    return out, grads, [b.clone() for b in m.buffers()]


FUSED_CASES = [("pairwise", "subtraction", True), ("pairwise", "subtraction", False),
               ("pairwise", "summation", True), ("pairwise", "summation", False),
               ("patchwise", "concatenation", False)]
FUSED_OPERATORS = {"pairwise": san_fused.FusedPairwiseAttention, "patchwise": san_fused.FusedPatchwiseConcat}


@needs_kernel
@pytest.mark.parametrize("attention,relation,position_encoding", FUSED_CASES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("size,footprint", [((17, 16), 7), ((5, 6), 7), ((4, 3), 3)])
def test_fused_operators_equal_the_chunked_path(attention, relation, position_encoding, training, size, footprint,
                                                 monkeypatch):
    """csrc/pairwise_ops.cpp and csrc/patchwise_ops.cpp against the chunked PyTorch path (float64):
    output, every gradient, running statistics; 17x16 has padded tile rows (more than 256 pixels),
    5x6 is smaller than the footprint."""
    _check_fused_equals_chunked(monkeypatch, 32, attention, relation, position_encoding, training, size, footprint)


@needs_kernel
@pytest.mark.parametrize("attention,relation,position_encoding", FUSED_CASES[:1] + FUSED_CASES[-1:])
def test_fused_operators_equal_the_chunked_path_past_every_register_block(attention, relation, position_encoding,
                                                                          monkeypatch):
    """15 relation channels and 15 groups: csrc/small_gemm.h's products take their main row block,
    then the smaller ones (8 + 4 + 2 + 1 rows),
    and gemm_nt its column blocks and a remainder."""
    _check_fused_equals_chunked(monkeypatch, 240, attention, relation, position_encoding, True, (17, 16), 7,
                                share_planes=4)


def _check_fused_equals_chunked(monkeypatch, channels, attention, relation, position_encoding, training, size,
                                footprint, **layer_args):
    torch.manual_seed(4)
    m = SelfAttention2d(channels, attention=attention, relation=relation, position_encoding=position_encoding,
                        footprint=footprint, chunk_size=5, **layer_args).double()
    for bn in (m.gamma[0], m.gamma[3]):  # running statistics and affine away from their defaults
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.data.uniform_(0.5, 1.5)
        bn.bias.data.uniform_(-0.5, 0.5)
    m.train(training)
    x = torch.randn(3, channels, *size, dtype=torch.float64)
    fused_calls = []
    operator = FUSED_OPERATORS[attention]
    apply = operator.apply
    monkeypatch.setattr(operator, "apply", lambda *a: fused_calls.append(1) or apply(*a))
    state = {k: v.clone() for k, v in m.state_dict().items()}
    fused = _train_and_backward(m, x)
    assert fused_calls, "the fused operator did not run"
    m.load_state_dict(state)
    _disable_kernels(monkeypatch)
    chunked = _train_and_backward(m, x)
    assert len(fused_calls) == 1
    torch.testing.assert_close(fused, chunked)


@needs_kernel
@pytest.mark.parametrize("attention,relation,position_encoding", FUSED_CASES[::2] + FUSED_CASES[-1:])
def test_fused_operators_with_frozen_parameters_give_the_input_gradient(attention, relation, position_encoding,
                                                                         monkeypatch):
    """An attack's backward (eval mode, no parameter needs a gradient) skips the weights' gradients and,
    for pairwise, runs one pass: the input gradient still equals the chunked path's."""
    torch.manual_seed(6)
    m = SelfAttention2d(32, attention=attention, relation=relation, position_encoding=position_encoding,
                        footprint=5).double().eval()
    m.requires_grad_(False)
    x = torch.randn(2, 32, 9, 11, dtype=torch.float64)

    def input_gradient():
        xi = x.clone().requires_grad_()
        out = m(xi)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        return out, xi.grad

    fused = input_gradient()
    assert all(p.grad is None for p in m.parameters())
    _disable_kernels(monkeypatch)
    torch.testing.assert_close(fused, input_gradient())


@needs_kernel
@pytest.mark.parametrize("attention", ["pairwise", "patchwise"])
def test_fused_operators_in_float32_are_as_accurate_as_the_chunked_path(attention, monkeypatch):
    """float32 against the float64 result: the fused kernels' error in the output and every gradient is
    within a small factor of the chunked PyTorch path's (both share the float32 layers around them)."""
    torch.manual_seed(5)
    m = SelfAttention2d(32, attention=attention, footprint=7).train()
    x = torch.randn(4, 32, 16, 17)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    exact = _train_and_backward(copy.deepcopy(m).double(), x.double())
    fused = _train_and_backward(m, x)
    m.load_state_dict(state)
    _disable_kernels(monkeypatch)
    chunked = _train_and_backward(m, x)
    scale = max(g.abs().max().item() for g in exact[1])
    for f, c, e in zip([fused[0], *fused[1]], [chunked[0], *chunked[1]], [exact[0], *exact[1]]):
        error_fused, error_chunked = ((t.double() - e).abs().max().item() for t in (f, c))
        assert error_fused <= 4 * error_chunked + 1e-6 * scale


@needs_kernel
def test_fused_kernels_reject_mismatched_operands():
    n, r, hd, g, h, w = 2, 4, 4, 2, 5, 5
    offsets = footprint_offsets(3)
    center, nbpad = torch.randn(n, r, h, w), torch.randn(n, r, h + 2, w + 2)
    w1, w2, b2 = torch.randn(hd, r), torch.randn(g, hd), torch.randn(g)
    scale, shift = torch.ones(hd), torch.zeros(hd)
    vpad = torch.randn(n, 3, g, h + 2, w + 2)
    out, lse = cpu_kernels.pairwise_forward(center, nbpad, offsets, w1, None, None, scale, shift, w2, b2, vpad)
    assert out.shape == (n, 3, g, h, w) and lse.shape == (n, g, h, w)
    with pytest.raises(RuntimeError, match="vpad"):
        cpu_kernels.pairwise_forward(center, nbpad, offsets, w1, None, None, scale, shift, w2, b2, vpad[:, :, :1])
    with pytest.raises(RuntimeError, match="leaves the padded map"):
        cpu_kernels.pairwise_moments(center, nbpad, footprint_offsets(5), w1, None, None)
    with pytest.raises(RuntimeError, match="pos"):
        cpu_kernels.pairwise_moments(center, nbpad, offsets, w1, torch.randn(hd, 2), torch.randn(2, 9, 7))
    scale = torch.ones(r, 9)
    hid = cpu_kernels.patchwise_hidden(nbpad, offsets, h, w, scale, scale, torch.randn(9, g, r))
    assert hid.shape == (n, g, h, w)
    with pytest.raises(RuntimeError, match="w1 must be"):
        cpu_kernels.patchwise_hidden(nbpad, offsets, h, w, scale, scale, torch.randn(9, r, g + 1))
    with pytest.raises(RuntimeError, match="scale must be"):
        cpu_kernels.patchwise_hidden(nbpad, offsets, h, w, scale[:, :4], scale, torch.randn(9, g, r))


def test_sasa_streaming_equals_reference_both_ways(kernel_mode):
    torch.manual_seed(3)
    # 6 x 7 pixels with a 5 x 5 window: interior pixels and every border case, in a quarter of the
    # finite differences 2 x 9 x 10 took (gradcheck perturbs each input entry; 36 s with kernels off)
    q, k, v = (torch.randn(1, 2, 3, 6, 7, dtype=torch.float64, requires_grad=True) for _ in range(3))
    rel = torch.randn(2, 3, 25, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(local_attention(q, k, v, rel, 5, method="stream"),
                               local_attention_reference(q, k, v, rel, 5))
    assert torch.autograd.gradcheck(lambda *t: local_attention(*t, 5, method="stream"), (q, k, v, rel))
