"""SAN operator and SAN10/15/19 (Zhao et al. 2020): paper numbers, invariances, lean == reference."""
import copy
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from robust_attn import create_model
from robust_attn.layers import local_aggregation
from robust_attn.models.complexity import count_params
from robust_attn.layers.local_aggregation import (footprint_aggregate, footprint_aggregate_unfold,
                                                  footprint_offsets, reflect_pad, shifted)
from robust_attn.layers.san import (PAIRWISE_RELATIONS, PATCHWISE_RELATIONS, SelfAttention2d, auto_chunk_size,
                                    conv1x1, san_attention_unfold)
from robust_attn.layers.san_pairwise import _difference_moments

SAN_MODELS = [f"san{d}_{a}" for a in ("pairwise", "patchwise") for d in (10, 15, 19)]
RELATIONS = [("pairwise", r) for r in PAIRWISE_RELATIONS] + [("patchwise", r) for r in PATCHWISE_RELATIONS]


def _randomize(module: nn.Module) -> nn.Module:
    """Random BN affine parameters and running statistics (so eval-mode BN is not the identity)."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return module


def _op(attention, relation, channels=16, footprint=3, **kw):
    return _randomize(SelfAttention2d(channels, attention=attention, relation=relation, footprint=footprint,
                                      share_planes=2, **kw)).double()


# --------------------------------------------------------------------------------------------
# A slow reference written from the paper's equations (2)-(5): explicit loops over positions i
# and footprint neighbours j, gamma in eval mode (BN with running statistics) as a per-pair MLP.

def _reflect(i, n):
    return -i if i < 0 else (2 * (n - 1) - i if i >= n else i)


def _bn_eval(z, bn):
    return (z - bn.running_mean) / torch.sqrt(bn.running_var + bn.eps) * bn.weight + bn.bias


def _gamma(m, delta):
    bn1, c1, bn2, c2 = m.gamma[0], m.gamma[2], m.gamma[3], m.gamma[5]
    h = c1.weight[:, :, 0, 0] @ torch.relu(_bn_eval(delta, bn1))
    return c2.weight[:, :, 0, 0] @ torch.relu(_bn_eval(h, bn2)) + c2.bias


def _conv1x1(conv, x):  # x: (C, H, W)
    return torch.einsum("oc,chw->ohw", conv.weight[:, :, 0, 0], x) + conv.bias[:, None, None]


def slow_san(m: SelfAttention2d, x: torch.Tensor) -> torch.Tensor:
    n, _, h, w = x.shape
    k, pad, groups = m.footprint, m.footprint // 2, m.groups
    out = []
    for b in range(n):
        x1, x2, v = _conv1x1(m.phi, x[b]), _conv1x1(m.psi, x[b]), _conv1x1(m.beta, x[b])
        if m.position_encoding:
            xs, ys = [-1 + 2 * c / max(w - 1, 1) for c in range(w)], [-1 + 2 * r / max(h - 1, 1) for r in range(h)]
            grid = torch.tensor([[[xs[c] for c in range(w)] for _ in range(h)],
                                 [[ys[r]] * w for r in range(h)]], dtype=x.dtype)
            pos = _conv1x1(m.pos, grid)
        rows = []
        for i in range(h):
            cols = []
            for j in range(w):
                nbrs = [(_reflect(i + dy - pad, h), _reflect(j + dx - pad, w)) for dy in range(k) for dx in range(k)]
                xi = x1[:, i, j]
                if m.attention == "pairwise":
                    logits = []
                    for (a, c) in nbrs:
                        xj = x2[:, a, c]
                        delta = {"summation": xi + xj, "subtraction": xi - xj, "hadamard": xi * xj,
                                 "dot": (xi @ xj)[None], "concatenation": torch.cat([xi, xj])}[m.relation]
                        if m.position_encoding:
                            delta = torch.cat([delta, pos[:, i, j] - pos[:, a, c]])
                        logits.append(_gamma(m, delta))
                    alpha = torch.softmax(torch.stack(logits), 0)  # (K, G), softmax over the footprint
                else:
                    if m.relation == "concatenation":  # [phi(x_i), psi(x_j) for all j], channel-major
                        delta = torch.cat([xi, torch.stack([x2[:, a, c] for a, c in nbrs], 1).flatten()])
                    elif m.relation == "star":
                        delta = torch.stack([xi @ x2[:, a, c] for a, c in nbrs])
                    else:  # clique
                        delta = torch.stack([x1[:, a, c] @ x2[:, e, f] for a, c in nbrs for e, f in nbrs])
                    alpha = _gamma(m, delta).view(groups, k * k).t()  # (K, G)
                y = sum(alpha[t].repeat(m.out_channels // groups) * v[:, a, c] for t, (a, c) in enumerate(nbrs))
                cols.append(y)
            rows.append(torch.stack(cols, -1))
        out.append(torch.stack(rows, -2))
    return torch.stack(out)


@pytest.mark.parametrize("attention,relation", RELATIONS)
def test_relation_matches_slow_reference_from_the_equations(attention, relation):
    m = _op(attention, relation).eval()
    x = torch.randn(2, 16, 5, 5, dtype=torch.float64, requires_grad=True)
    expected = slow_san(m, x)
    (grad_expected,) = torch.autograd.grad(expected.square().sum(), x)
    for impl in ("lean", "unfold"):
        m.implementation = impl
        y = m(x)
        assert y.shape == (2, 4, 5, 5)
        torch.testing.assert_close(y, expected, rtol=1e-9, atol=1e-10)
        (grad,) = torch.autograd.grad(y.square().sum(), x)
        torch.testing.assert_close(grad, grad_expected, rtol=1e-8, atol=1e-9)


def _assert_lean_equals_unfold(lean: SelfAttention2d, x: torch.Tensor, grad_rtol: float = 1e-8,
                               grad_atol: float = 1e-10) -> None:
    """``lean`` and a copy running the unfold reference agree (float64) in outputs, input and parameter
    gradients and buffers (BN running statistics, updated in training mode)."""
    ref = copy.deepcopy(lean)
    ref.implementation = "unfold"
    results = []
    for m in (lean, ref):
        y = m(x)
        results.append((y.detach(), torch.autograd.grad(y.square().sum(), [x, *m.parameters()])))
    (y_lean, g_lean), (y_ref, g_ref) = results
    torch.testing.assert_close(y_lean, y_ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(g_lean, g_ref):
        torch.testing.assert_close(a, b, rtol=grad_rtol, atol=grad_atol)
    for (name, b_lean), b_ref in zip(lean.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b_lean, b_ref, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("attention,relation", RELATIONS)
def test_lean_equals_unfold_in_training(attention, relation):
    """Outputs, input and parameter gradients and BN running statistics (BN on batch statistics)."""
    lean = _op(attention, relation, footprint=5, chunk_size=4).train()  # 25 offsets: a partial chunk
    _assert_lean_equals_unfold(lean, torch.randn(2, 16, 6, 7, dtype=torch.float64, requires_grad=True))


@pytest.mark.parametrize("flat_below", [1, 1000], ids=["rows", "flat"])
@pytest.mark.parametrize("relation", ["subtraction", "concatenation"])
def test_pairwise_lean_equals_unfold_in_eval_mode_with_chunks(relation, flat_below, monkeypatch):
    """Eval mode with gradients (as attacks run): running BN statistics, several chunks, every gradient,
    with both layouts of the chunk-wise aggregation backward."""
    monkeypatch.setattr(local_aggregation, "FLAT_ROWS_BELOW_WIDTH", flat_below)
    lean = _op("pairwise", relation, footprint=5, chunk_size=7).eval()  # 25 offsets: 4 chunks, one partial
    x = torch.randn(2, 16, 6, 5, dtype=torch.float64, requires_grad=True)
    _assert_lean_equals_unfold(lean, x, grad_rtol=1e-9, grad_atol=1e-11)
    assert torch.autograd.gradcheck(lean, (x,), atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("flat_below", [1, 1000], ids=["rows", "flat"])
def test_pairwise_gamma_gradients_reach_every_parameter_in_training(flat_below, monkeypatch):
    """The hand-written backward of pairwise attention: a gradient for gamma's layers, BN2's affine,
    the position encoding and beta, equal to the reference's (two-pass backward: several chunks)."""
    monkeypatch.setattr(local_aggregation, "FLAT_ROWS_BELOW_WIDTH", flat_below)
    lean = _op("pairwise", "subtraction", footprint=3, chunk_size=2).train()
    ref = copy.deepcopy(lean)
    ref.implementation = "unfold"
    x = torch.randn(3, 16, 4, 4, dtype=torch.float64)
    named = {}
    for m in (lean, ref):
        y = m(x)
        named[m.implementation] = dict(zip([n for n, _ in m.named_parameters()],
                                           torch.autograd.grad(y.square().sum(), list(m.parameters()))))
    for name in ("gamma.2.weight", "gamma.3.weight", "gamma.3.bias", "gamma.5.weight", "gamma.5.bias", "pos.weight",
                 "beta.weight", "phi.weight", "psi.weight"):
        assert named["lean"][name].abs().sum() > 0, name
        torch.testing.assert_close(named["lean"][name], named["unfold"][name], rtol=1e-8, atol=1e-10)


def test_lean_equals_unfold_in_float32():
    for attention in ("pairwise", "patchwise"):
        lean = _randomize(SelfAttention2d(32, attention=attention, footprint=7))
        ref = copy.deepcopy(lean)
        ref.implementation = "unfold"
        x = torch.randn(2, 32, 9, 9, requires_grad=True)
        y_lean, y_ref = lean(x), ref(x)
        torch.testing.assert_close(y_lean, y_ref, rtol=1e-4, atol=1e-5)
        g_lean = torch.autograd.grad(y_lean.square().sum(), [x, *lean.parameters()])
        g_ref = torch.autograd.grad(y_ref.square().sum(), [x, *ref.parameters()])
        scale = max(g.abs().max().item() for g in g_ref)  # e.g. pos.bias's gradient is 0 up to rounding
        for a, b in zip(g_lean, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5 * scale)


@pytest.mark.parametrize("kernel,flat_below", [("stream", 1), ("stream", 1000), ("unfold", None)],
                         ids=["stream-rows", "stream-flat", "unfold"])
def test_aggregation_gradcheck_and_unfold_agreement(kernel, flat_below, monkeypatch):
    if flat_below is not None:  # both layouts of the streaming kernel
        monkeypatch.setattr(local_aggregation, "FLAT_ROWS_BELOW_WIDTH", flat_below)

    def agg(a, b, k):
        return footprint_aggregate(a, b, k, kernel=kernel)

    v = torch.randn(2, 6, 4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, 9, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: agg(a, b, 3), (v, w))  # exhaustive
    torch.testing.assert_close(agg(v, w, 3), footprint_aggregate_unfold(v, w, 3))
    # Smaller than the footprint (2x2 map, 5x5 footprint): repeated mirroring.
    v2 = torch.randn(1, 2, 2, 2, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(1, 1, 25, 2, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: agg(a, b, 5), (v2, w2))


def _kernels_used(y):
    names, stack = set(), [y.grad_fn]
    while stack:
        fn = stack.pop()
        names.add(type(fn).__name__)
        stack += [nxt for nxt, _ in fn.next_functions if nxt is not None]
    return names


def test_aggregation_picks_the_unfold_kernel_only_for_maps_within_the_padding():
    w = torch.randn(1, 2, 25, 2, 2)
    assert "_UnfoldAggregateBackward" in _kernels_used(footprint_aggregate(torch.randn(1, 4, 2, 2, requires_grad=True), w, 5))
    w = torch.randn(1, 2, 25, 3, 3)
    assert "_StreamAggregateBackward" in _kernels_used(footprint_aggregate(torch.randn(1, 4, 3, 3, requires_grad=True), w, 5))
    with pytest.raises(ValueError, match="kernel must be"):
        footprint_aggregate(torch.randn(1, 4, 3, 3), w, 5, kernel="fast")


def test_shifted_backward_adds_every_offset_into_one_gradient():
    xpad = torch.randn(2, 3, 6, 7, dtype=torch.float64, requires_grad=True)
    offsets = [(0, 0), (1, 2), (2, 1), (1, 1)]
    assert torch.autograd.gradcheck(lambda t: shifted(t, offsets, 4, 5), (xpad,))
    g = torch.randn(2, 3, 4, 4, 5, dtype=torch.float64)
    (grad,) = torch.autograd.grad(shifted(xpad, offsets, 4, 5), xpad, g)
    expected = torch.zeros_like(xpad)
    for k, (dy, dx) in enumerate(offsets):
        expected[:, :, dy:dy + 4, dx:dx + 5] += g[:, :, k]
    torch.testing.assert_close(grad, expected)


def test_shifted_copies_runs_of_offsets_like_stacking_each_view():
    xpad = torch.randn(2, 3, 8, 9)
    for offsets in (footprint_offsets(3), footprint_offsets(5)[3:17], [(0, 1), (0, 2), (2, 0), (1, 3), (1, 4)]):
        expected = torch.stack([xpad[:, :, dy:dy + 4, dx:dx + 5] for dy, dx in offsets], 2)
        assert torch.equal(shifted(xpad, offsets, 4, 5), expected)


@pytest.mark.parametrize("size,footprint", [(6, 3), (5, 5), (2, 7)])
@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_difference_moments_equal_the_expanded_sums(size, footprint, sign):
    """Closed-form BN statistics of x1_i +- x2_j over all pairs == sums over the unfolded pairs."""
    x1 = torch.randn(2, 3, size, size, dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(2, 3, size, size, dtype=torch.float64, requires_grad=True)
    x2p = reflect_pad(x2, footprint // 2)
    got = _difference_moments(x1, x2, footprint, sign)
    pairs = x1.flatten(2)[:, :, None] + sign * F.unfold(x2p, footprint).view(2, 3, footprint ** 2, size * size)
    expected = torch.stack([pairs.sum((0, 2, 3)), pairs.square().sum((0, 2, 3))])
    torch.testing.assert_close(got, expected)
    g = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(got, [x1, x2], g, retain_graph=True),
                               torch.autograd.grad(expected, [x1, x2], g))
    assert torch.autograd.gradcheck(lambda a, b: _difference_moments(a, b, footprint, sign), (x1, x2))


def test_auto_chunk_size_follows_the_input_size_and_explicit_sizes_win():
    m = SelfAttention2d(64, attention="pairwise", footprint=7)
    # Small map: the whole footprint in one chunk.
    assert auto_chunk_size(m, 2, 8, 8) == 49
    # Large map: chunk's N * d * Kc * H * W is the most within half the input's N * C * H * W elements.
    kc = auto_chunk_size(m, 32, 64, 64)
    assert 1 <= kc < 49 and 32 * m.delta_channels * kc * 64 * 64 <= 32 * 64 * 64 * 64 // 2
    assert 32 * m.delta_channels * (kc + 1) * 64 * 64 > 32 * 64 * 64 * 64 // 2
    assert auto_chunk_size(SelfAttention2d(64, footprint=7, chunk_size=5), 32, 64, 64) == 5


def test_conv1x1_equals_the_convolution_on_small_and_large_maps():
    conv = nn.Conv2d(8, 5, 1)
    for size in (3, 16):  # F.conv2d below BMM_MIN_POSITIONS positions, a batched matmul from there
        x = torch.randn(2, 8, size, size + 1, requires_grad=True)
        y = conv1x1(x, conv)
        torch.testing.assert_close(y, conv(x))
        torch.testing.assert_close(torch.autograd.grad(y.sum(), x)[0], torch.autograd.grad(conv(x).sum(), x)[0])


@pytest.mark.parametrize("attention", ["pairwise", "patchwise"])
def test_lean_equals_unfold_in_training_on_maps_smaller_than_the_footprint(attention):
    """2x3 maps under a 5x5 footprint (the 2x2 last stage of the CPU recipe): repeated mirroring in
    every padded tensor, the backward passes included, with several chunks."""
    lean = _op(attention, None, footprint=5, chunk_size=6).train()
    _assert_lean_equals_unfold(lean, torch.randn(3, 16, 2, 3, dtype=torch.float64, requires_grad=True))


@pytest.mark.parametrize("attention", ["pairwise", "patchwise"])
def test_lean_operator_gradcheck_in_training_mode(attention):
    m = _op(attention, None, chunk_size=2).train()
    x = torch.randn(2, 16, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(m, (x,), atol=1e-6, fast_mode=True)


def test_reflect_pad_equals_torch_and_extends_to_tiny_maps():
    """Where torch's reflection padding stops (a pad as large as the map: a 7x7 footprint on a CIFAR
    model's 1x1 to 4x4 maps), the padding keeps reflecting without repeating the edge, as numpy's
    ``reflect`` mode does."""
    x = torch.randn(1, 2, 5, 6)
    torch.testing.assert_close(reflect_pad(x, 3), F.pad(x, (3, 3, 3, 3), mode="reflect"))
    for height, width, pad in [(1, 1, 3), (2, 2, 3), (3, 3, 3), (2, 4, 3), (4, 4, 5), (3, 2, 1)]:
        tiny = torch.randn(2, 3, height, width)
        expected = np.pad(tiny.numpy(), ((0, 0), (0, 0), (pad, pad), (pad, pad)), mode="reflect")
        torch.testing.assert_close(reflect_pad(tiny, pad), torch.from_numpy(expected))


def test_pairwise_without_position_encoding_is_a_set_operation():
    """Eq. 2: moving the neighbours' features to other footprint slots changes nothing without
    position encoding; with it (positions stay with the slots), or for patchwise attention, it does."""
    x = torch.randn(2, 16, 5, 5, dtype=torch.float64)
    perm = torch.randperm(25)
    for attention, pe, invariant in [("pairwise", False, True), ("pairwise", True, False),
                                     ("patchwise", True, False)]:
        m = _op(attention, None, footprint=5, position_encoding=pe).eval()
        same = torch.allclose(san_attention_unfold(m, x), san_attention_unfold(m, x, neighbour_order=perm))
        assert same == invariant, (attention, pe)


@pytest.mark.parametrize("attention", ["pairwise", "patchwise"])
def test_translation_equivariance_away_from_borders(attention):
    m = _op(attention, None, footprint=3).eval()  # with position encoding for pairwise
    x = torch.randn(1, 16, 14, 14, dtype=torch.float64)
    shift = 2
    y, y_shifted = m(x), m(torch.roll(x, (shift, shift), (2, 3)))
    # Output pixel i depends on input pixels within 1 of i: compare where no border is near.
    inner = slice(shift + 1, 14 - 1)
    torch.testing.assert_close(y_shifted[..., inner, inner],
                               y[..., 1:14 - 1 - shift, 1:14 - 1 - shift], rtol=1e-9, atol=1e-10)
    assert not torch.allclose(y_shifted, torch.roll(y, (shift, shift), (2, 3)))  # borders do differ


def test_patchwise_with_constant_weights_is_a_depthwise_convolution():
    """Content-independent gamma (last layer's weight zero, kernel in its bias) = grouped conv after beta."""
    m = _op("patchwise", "concatenation", footprint=3).train()
    kernel = torch.randn(m.groups, 9, dtype=torch.float64)
    with torch.no_grad():
        m.gamma[5].weight.zero_()
        m.gamma[5].bias.copy_(kernel.flatten())  # channel g * k^2 + j
    x = torch.randn(2, 16, 6, 6, dtype=torch.float64)
    v = m.beta(x)
    depthwise = kernel[torch.arange(m.out_channels) % m.groups].view(m.out_channels, 1, 3, 3)
    expected = F.conv2d(F.pad(v, (1, 1, 1, 1), mode="reflect"), depthwise, groups=m.out_channels)
    for impl in ("lean", "unfold"):
        m.implementation = impl
        torch.testing.assert_close(m(x), expected)


def test_bf16_autocast_runs_and_stays_close(monkeypatch):
    # The half-precision paths a GPU's autocast takes (a CPU's runs the operator in float32).
    monkeypatch.setattr("robust_attn.layers.precision.CPU_AUTOCAST_FLOAT32", False)
    for attention in ("pairwise", "patchwise"):
        m = _randomize(SelfAttention2d(32, attention=attention, footprint=3)).eval()
        x = torch.randn(2, 32, 6, 6, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        y.float().sum().backward()
        assert torch.isfinite(x.grad).all()
        assert (y.float() - m(x)).abs().max() < 0.1 * m(x).abs().max()


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="relation must be one of"):
        SelfAttention2d(64, attention="pairwise", relation="star")
    with pytest.raises(ValueError, match="odd"):
        SelfAttention2d(64, footprint=4)
    with pytest.raises(ValueError, match="divisible by rel_reduction"):
        SelfAttention2d(40)
    with pytest.raises(ValueError, match="share_planes=4"):
        SelfAttention2d(48)
    with pytest.raises(ValueError, match=r"expected input \(N, 64, H, W\)"):
        SelfAttention2d(64)(torch.zeros(1, 32, 4, 4))
    with pytest.raises(ValueError, match="does not take"):
        create_model("san10_pairwise", bogus=1)


# --------------------------------------------------------------------------------------------
# Architectures (tests/test_models.py checks counts against Table 3 and trains every model)

@pytest.mark.parametrize("relation,paper_params_m", [("summation", 10.5), ("concatenation", 10.6),
                                                     ("hadamard", 10.5), ("dot", 10.5)])
def test_pairwise_relations_match_table4_parameter_counts(relation, paper_params_m):
    with torch.device("meta"):
        model = create_model("san10_pairwise", relation=relation)
    assert abs(count_params(model) / 1e6 - paper_params_m) / paper_params_m < 0.02


@pytest.mark.parametrize("relation,paper_params_m", [("star", 10.9), ("clique", 11.5)])
def test_patchwise_relations_match_table4_parameter_counts(relation, paper_params_m):
    with torch.device("meta"):
        model = create_model("san10_patchwise", relation=relation)
    assert abs(count_params(model) / 1e6 - paper_params_m) / paper_params_m < 0.02


@pytest.mark.parametrize("resolution,overrides,sizes", [
    ("imagenet", {}, (112, 56, 28, 14, 7)),
    ("cifar", {}, (32, 32, 16, 8, 4)),
    ("cifar", {"stem_downsample": 2}, (32, 16, 8, 4, 2)),
])
def test_stage_map_sizes(resolution, overrides, sizes):
    with torch.device("meta"):
        model = create_model("san10_pairwise", 10, resolution, width=0.25, **overrides)
        image = 224 if resolution == "imagenet" else 32
        x = torch.zeros(1, 3, image, image)
        seen = []
        hooks = [stage.register_forward_hook(lambda mod, inp, out: seen.append(out.shape[-1]))
                 for stage in model.stages]
        model(x)
    for hook in hooks:
        hook.remove()
    assert tuple(seen) == sizes == model.feature_sizes


def test_width_multiplier_scales_every_stage():
    with torch.device("meta"):
        model = create_model("san10_patchwise", 10, "cifar", width=0.5)
    convs = [stage[1].out_channels for stage in model.stages]
    assert convs == [32, 128, 256, 512, 1024]
    attn = model.stages[0][2].attn
    assert (attn.rel_channels, attn.out_channels, attn.groups) == (2, 8, 1)
