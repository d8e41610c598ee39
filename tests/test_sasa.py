"""SASA: the local attention operator against a slow loop reference of Eq. 2-3, the lean
(streaming) operator against the unfold reference, equivariance, models and parameter counts."""
import itertools
import math

import pytest
import torch
from model_checks import check_trains_evaluates_and_round_trips

from robust_attn import create_model
from robust_attn.layers.local_attention import local_attention, local_attention_reference
from robust_attn.layers.sasa import AttentionStem, SASAttention2d, relative_embedding
from robust_attn.models.reference import imagenet_reference

SASA_MODELS = ["sasa_resnet26", "sasa_resnet38", "sasa_resnet50"]


def slow_sasa(layer: SASAttention2d, x: torch.Tensor) -> torch.Tensor:
    """SASA Eq. 3 with explicit loops over batch, heads, positions and neighbours (stride 1).

    q = W_Q x, k = W_K x, v = W_V x; head n owns channels [n d, (n+1) d); its logit for neighbour
    (a, b) of (i, j) is sum over the head's channels of q_ij . (k_ab + r_{a-i, b-j}) with
    r = [row embedding of a-i, column embedding of b-j]; positions outside the map are zero
    padding (k = v = 0).
    """
    wq, wk, wv = (conv.weight[:, :, 0, 0] for conv in (layer.query, layer.key, layer.value))
    q, k, v = (torch.einsum("oc,bchw->bohw", w, x) for w in (wq, wk, wv))
    batch, _, height, width = x.shape
    d, p = layer.head_dim, layer.kernel_size // 2
    out = torch.zeros(batch, layer.out_channels, height, width, dtype=x.dtype)
    for bi, n, i, j in itertools.product(range(batch), range(layer.heads), range(height), range(width)):
        ch = slice(n * d, (n + 1) * d)
        logits, values = [], []
        for a in range(i - p, i + p + 1):
            for b in range(j - p, j + p + 1):
                r = torch.cat([layer.rel_row[n, :, a - i + p], layer.rel_col[n, :, b - j + p]])
                inside = 0 <= a < height and 0 <= b < width
                key = k[bi, ch, a, b] if inside else torch.zeros(d, dtype=x.dtype)
                values.append(v[bi, ch, a, b] if inside else torch.zeros(d, dtype=x.dtype))
                logits.append(sum(q[bi, n * d + c, i, j] * (key[c] + r[c]) for c in range(d)))
        weights = torch.softmax(torch.stack(logits), 0)
        out[bi, ch, i, j] = sum(w * val for w, val in zip(weights, values))
    return out


@pytest.mark.parametrize("kernel_size", [3, 5])
@pytest.mark.parametrize("impl", ["lean", "reference"])
@pytest.mark.parametrize("channels", [16, 12], ids=["head_dim4", "head_dim3"])   # 3: rows 1 channel, columns 2
def test_layer_matches_slow_loop_reference_of_eq3(kernel_size, impl, channels):
    layer = SASAttention2d(16, channels, kernel_size=kernel_size, heads=4, impl=impl).double()
    x = torch.randn(1, 16, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), slow_sasa(layer, x))


def test_attention_is_one_softmax_per_head_not_per_channel():
    # Per-channel attention (a known bug: no sum over the head's channels) gives another result.
    layer = SASAttention2d(16, 16, kernel_size=3, heads=2).double()
    x = torch.randn(1, 16, 5, 5, dtype=torch.float64)
    b, h, d = 1, layer.heads, layer.head_dim
    q, k, v = (conv(x).view(b, h, d, 5, 5) for conv in (layer.query, layer.key, layer.value))
    rel = relative_embedding(layer.rel_row, layer.rel_col)
    per_channel = local_attention_reference(q.reshape(b, h * d, 1, 5, 5), k.reshape(b, h * d, 1, 5, 5),
                                            v.reshape(b, h * d, 1, 5, 5), rel.reshape(h * d, 1, 9), 3)
    with torch.no_grad():
        ours = layer(x)
        assert not torch.allclose(ours, per_channel.reshape(b, h * d, 5, 5), atol=1e-3)
        torch.testing.assert_close(ours, slow_sasa(layer, x))


def test_translation_equivariance_away_from_borders():
    layer = SASAttention2d(16, 16, kernel_size=5, heads=4).eval()
    x = torch.randn(2, 16, 16, 16)
    s1, s2, p, size = 2, 3, 2, 16
    shifted = torch.zeros_like(x)
    shifted[..., s1:, s2:] = x[..., :size - s1, :size - s2]
    with torch.no_grad():
        y, y_shifted = layer(x), layer(shifted)
    torch.testing.assert_close(y_shifted[..., p + s1:size - p, p + s2:size - p],
                               y[..., p:size - p - s1, p:size - p - s2], rtol=1e-4, atol=1e-5)
    # The relative embeddings make the layer position-aware: flipping the map is not a symmetry.
    flipped = layer(x.flip(-1)).flip(-1)
    assert not torch.allclose(flipped[..., p:-p, p:-p], y[..., p:-p, p:-p], atol=1e-3)


def _qkv_rel(shape, ks, dtype, dv=None):
    b, h, d, height, width = shape
    q, k = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    v = torch.randn(b, h, dv or d, height, width, dtype=dtype)
    rel = torch.randn(h, d, ks * ks, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, rel)]


@pytest.mark.parametrize("kernel_size", [3, 7])
def test_lean_operator_equals_unfold_reference_in_outputs_and_gradients(kernel_size):
    inputs = _qkv_rel((2, 4, 4, 9, 7), kernel_size, torch.float32, dv=6)
    lean, ref = local_attention(*inputs, kernel_size), local_attention_reference(*inputs, kernel_size)
    torch.testing.assert_close(lean, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(lean)
    for g_lean, g_ref in zip(torch.autograd.grad(lean, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(g_lean, g_ref, rtol=1e-4, atol=1e-4)


def test_lean_operator_passes_gradcheck_in_float64():
    inputs = _qkv_rel((1, 2, 3, 4, 5), 3, torch.float64, dv=2)
    assert torch.autograd.gradcheck(lambda *t: local_attention(*t, 3), inputs)


# 4x4 with 7x7: every pixel has padding neighbours and sees the whole map; 8x8: the central
# pixels have none; 9x7 and 3x5: non-square, the 3x3 footprint covering part of the map.
FORM_CASES = [((2, 2, 4, 4, 4), 7), ((2, 2, 2, 8, 8), 7), ((2, 3, 2, 9, 7), 3), ((3, 1, 3, 3, 5), 5)]


@pytest.mark.parametrize("method", ["stream", "dense"])
@pytest.mark.parametrize("shape,kernel_size", FORM_CASES)
def test_stream_and_dense_forms_equal_the_unfold_reference(method, shape, kernel_size):
    inputs = _qkv_rel(shape, kernel_size, torch.float64, dv=3)
    ours = local_attention(*inputs, kernel_size, method=method)
    ref = local_attention_reference(*inputs, kernel_size)
    torch.testing.assert_close(ours, ref)
    grad = torch.randn_like(ours)
    for g_ours, g_ref in zip(torch.autograd.grad(ours, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(g_ours, g_ref)


def test_dense_form_passes_gradcheck_in_float64():
    inputs = _qkv_rel((1, 2, 2, 3, 4), 5, torch.float64, dv=2)      # 5x5 footprint on a 3x4 map
    assert torch.autograd.gradcheck(lambda *t: local_attention(*t, 5, method="dense"), inputs)


@pytest.mark.parametrize("method", ["stream", "dense"])
def test_batch_chunking_and_partial_gradients_change_nothing(method, monkeypatch):
    import robust_attn.layers.local_attention as attention_module
    q, k, v, rel = _qkv_rel((3, 2, 2, 4, 5), 5, torch.float64)
    k.requires_grad_(False)
    rel.requires_grad_(False)
    ref = local_attention_reference(q, k, v, rel, 5)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, v), grad)
    monkeypatch.setattr(attention_module, "_CHUNK_BYTES", 1)          # one sample per chunk
    monkeypatch.setattr(attention_module, "_CHUNK_MIN_PIXELS", 1)
    assert len(attention_module._batch_chunks(q, 25)) == 3
    ours = local_attention(q, k, v, rel, 5, method=method)
    torch.testing.assert_close(ours, ref)
    for g_ours, g_ref in zip(torch.autograd.grad(ours, (q, v), grad), ref_grads):
        torch.testing.assert_close(g_ours, g_ref)


@pytest.mark.parametrize("method", ["stream", "dense"])
def test_widely_spread_logits_stay_finite_and_exact(method):
    # logits spread over thousands: most softmax weights underflow (the forms raise them to the
    # smallest normal float before exp, for speed); results must still match the reference.
    q, k, v, rel = _qkv_rel((2, 2, 4, 6, 6), 7, torch.float32)
    with torch.no_grad():
        q.mul_(40.0)
        k.mul_(40.0)
    ours = local_attention(q, k, v, rel, 7, method=method)
    ref = local_attention_reference(q, k, v, rel, 7)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(ours.square().sum(), (q, k, v, rel))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v, rel))
    for g_ours, g_ref in zip(grads, ref_grads):
        assert torch.isfinite(g_ours).all()
        torch.testing.assert_close(g_ours, g_ref, rtol=1e-4, atol=1e-3)


def test_auto_picks_dense_on_small_maps_and_rejects_unknown_methods():
    small = _qkv_rel((1, 2, 2, 4, 4), 7, torch.float32)
    large = _qkv_rel((1, 2, 2, 9, 9), 7, torch.float32)
    assert "Dense" in type(local_attention(*small, 7).grad_fn).__name__
    assert "Dense" not in type(local_attention(*large, 7).grad_fn).__name__
    with pytest.raises(ValueError, match="method must be"):
        local_attention(*small, 7, method="fast")


def test_layer_gradients_agree_between_lean_and_reference():
    layer = SASAttention2d(16, 16, kernel_size=7, heads=8)
    x = torch.randn(2, 16, 9, 9, requires_grad=True)
    grads = {}
    for impl in ("lean", "reference"):
        layer.impl = impl
        layer.zero_grad()
        x.grad = None
        layer(x).square().sum().backward()
        grads[impl] = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    for g_lean, g_ref in zip(grads["lean"], grads["reference"]):
        torch.testing.assert_close(g_lean, g_ref, rtol=1e-4, atol=1e-4)


def _saved_bytes(fn) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


@pytest.mark.parametrize("size", [14, 8])       # 14x14 streams, 8x8 runs the dense form
def test_lean_operator_saves_under_a_quarter_of_the_unfold_reference(size):
    # 7x7 footprint, 64 channels, 8 heads: the unfold path keeps 49 copies of k and v for backward.
    inputs = _qkv_rel((1, 8, 8, size, size), 7, torch.float32)
    lean = _saved_bytes(lambda: local_attention(*inputs, 7))
    ref = _saved_bytes(lambda: local_attention_reference(*inputs, 7))
    assert lean * 4 <= ref, (lean, ref)


@pytest.mark.parametrize("impl,size", [("lean", 8), ("lean", 5), ("reference", 8)])   # lean 5x5: dense
def test_bfloat16_autocast_runs_and_stays_close(impl, size, monkeypatch):
    # The half-precision paths a GPU's autocast takes (a CPU's runs the layer in float32).
    monkeypatch.setattr("robust_attn.layers.precision.CPU_AUTOCAST_FLOAT32", False)
    layer = SASAttention2d(16, 16, kernel_size=5, heads=4, impl=impl)
    x = torch.randn(2, 16, size, size, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(y.float(), layer(x).detach(), rtol=0.1, atol=0.1)


def test_stride_two_is_attention_then_2x2_average_pooling():
    layer = SASAttention2d(16, 32, kernel_size=3, heads=4, stride=2)
    x = torch.randn(2, 16, 8, 8)
    full = SASAttention2d(16, 32, kernel_size=3, heads=4)
    full.load_state_dict(layer.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.avg_pool2d(full(x), 2))
    assert layer(x).shape == (2, 32, 4, 4)


def test_bad_configurations_raise_clear_errors():
    with pytest.raises(ValueError, match="divisible by heads"):
        SASAttention2d(16, 20, heads=8)
    with pytest.raises(ValueError, match="odd"):
        SASAttention2d(16, 16, kernel_size=4)
    with pytest.raises(ValueError, match="stem must be"):
        create_model("sasa_resnet26", stem="transformer")
    with pytest.raises(ValueError, match=r"expected input \(B, 16"):
        SASAttention2d(16, 16)(torch.randn(1, 8, 5, 5))


def test_attention_stem_mixture_weights_and_shapes():
    stem = AttentionStem(16, stem_downsample=4)
    p = stem.mixture_weights()
    assert p.shape == (4, 4, 4)
    torch.testing.assert_close(p.sum(-1), torch.ones(4, 4))
    assert stem(torch.rand(2, 3, 32, 32)).shape == (2, 16, 8, 8)
    assert AttentionStem(16, stem_downsample=1)(torch.rand(2, 3, 32, 32)).shape == (2, 16, 32, 32)
    with pytest.raises(ValueError, match="divisible by 4"):
        stem(torch.rand(1, 3, 30, 30))


def test_attention_stem_attends_only_within_its_4x4_window():
    stem = AttentionStem(16, stem_downsample=1).eval()
    x = torch.rand(1, 3, 16, 16)
    y = stem(x)
    x2 = x.clone()
    x2[..., 4:8, 8:12] = torch.rand(3, 4, 4)          # change one window
    y2 = stem(x2)
    changed = (y - y2).abs().amax(1)[0] > 1e-6
    assert changed[4:8, 8:12].any()
    changed[4:8, 8:12] = False
    assert not changed.any()


def test_attention_stem_model_matches_full_attention_parameter_count():
    with torch.device("meta"):
        model = create_model("sasa_resnet50", stem="attention")
    assert isinstance(model.stem, AttentionStem)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    assert abs(params - 18.0) / 18.0 < 0.02          # SASA Table 1, "Full Attention" ResNet-50


@pytest.mark.parametrize("resolution", ["cifar", "imagenet"])
def test_attention_stem_architecture_trains_and_round_trips(resolution):
    check_trains_evaluates_and_round_trips("sasa_resnet26", resolution, stem="attention")


def test_registered_in_the_sasa_family():
    from robust_attn.models.registry import list_models
    assert list_models(family="sasa") == SASA_MODELS
    assert math.isclose(imagenet_reference()["sasa_resnet50"]["params_M"], 18.0)


def test_checkpoint_round_trip_keeps_overrides_and_outputs(tmp_path):
    from robust_attn.models.checkpoint import load_checkpoint, save_checkpoint
    from robust_attn.models.wrapper import NormalizedModel
    model = create_model("sasa_resnet26", num_classes=10, resolution="cifar", width=0.25, stem="attention",
                         kernel_size=5)
    wrapped = NormalizedModel(model, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)).eval()
    save_checkpoint(tmp_path / "sasa.safetensors", wrapped)
    loaded = load_checkpoint(tmp_path / "sasa.safetensors")
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), wrapped(x))
