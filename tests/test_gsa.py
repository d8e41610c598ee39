"""GSA: the module against a slow reference written from the paper's equations, linear-memory
content attention, feature-size handling, models and parameter counts."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from robust_attn import create_model
from robust_attn.models.complexity import count_params, model_complexity
from robust_attn.layers.gsa import GlobalSelfAttention2d, content_attention
from robust_attn.models.resnet import RESNET_LAYERS

GSA_MODELS = ["gsa_resnet101", "gsa_resnet26", "gsa_resnet38", "gsa_resnet50"]


def slow_gsa(module: GlobalSelfAttention2d, x: torch.Tensor) -> torch.Tensor:
    """GSA Eq. 1, 2, 8 and appendix B with explicit loops (module in eval mode, stride 1).

    Content: pixel p receives sum_{p'} (sum_c q_pc softmax_{p''}(k_{p''c})|_{p'}) v_{p'} per head, the
    N x N form of Q (softmax(K)^T V). Column layer: out[x, y] = sum_i (q_xy . Rc[i - x + L - 1]) v[i, y];
    then BN with running statistics; row layer: out[x, y] = sum_j (q_xy . Rr[j - y + L - 1]) bn[x, j].
    """
    wq, wk, wv = (conv.weight[:, :, 0, 0] for conv in (module.query, module.key, module.value))
    q, k, v = (torch.einsum("oc,bchw->bohw", w, x) for w in (wq, wk, wv))
    batch, _, height, width = x.shape
    n_pix, dk, dv, L = height * width, module.key_dim, module.value_dim, module.feature_size
    content = torch.zeros(batch, module.out_channels, n_pix, dtype=x.dtype)
    column = torch.zeros(batch, module.out_channels, height, width, dtype=x.dtype)
    row = torch.zeros_like(column)
    for b in range(batch):
        for n in range(module.heads):
            kc, vc = slice(n * dk, (n + 1) * dk), slice(n * dv, (n + 1) * dv)
            qf, kf, vf = q[b, kc].reshape(dk, n_pix), k[b, kc].reshape(dk, n_pix), v[b, vc].reshape(dv, n_pix)
            k_soft = torch.exp(kf) / torch.exp(kf).sum(1, keepdim=True)
            for p in range(n_pix):
                for p2 in range(n_pix):
                    content[b, vc, p] += sum(qf[c, p] * k_soft[c, p2] for c in range(dk)) * vf[:, p2]
            for xx in range(height):
                for yy in range(width):
                    for i in range(height):
                        weight = q[b, kc, xx, yy] @ module.rel_column[i - xx + L - 1]
                        column[b, vc, xx, yy] += weight * v[b, vc, i, yy]
    bn = module.norm
    normed = ((column - bn.running_mean[:, None, None]) / torch.sqrt(bn.running_var[:, None, None] + bn.eps)
              * bn.weight[:, None, None] + bn.bias[:, None, None])
    for b in range(batch):
        for n in range(module.heads):
            kc, vc = slice(n * dk, (n + 1) * dk), slice(n * dv, (n + 1) * dv)
            for xx in range(height):
                for yy in range(width):
                    for j in range(width):
                        weight = q[b, kc, xx, yy] @ module.rel_row[j - yy + L - 1]
                        row[b, vc, xx, yy] += weight * normed[b, vc, xx, j]
    return content.view_as(row) + row


def _randomize_norm(module: GlobalSelfAttention2d) -> None:
    bn = module.norm
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
        bn.bias.normal_()


def test_module_matches_slow_reference_of_the_paper_equations():
    module = GlobalSelfAttention2d(8, 12, feature_size=6, heads=2).double().eval()
    _randomize_norm(module)
    x = torch.randn(2, 8, 4, 5, dtype=torch.float64)         # H != W catches swapped axes
    with torch.no_grad():
        torch.testing.assert_close(module(x), slow_gsa(module, x))


def test_content_attention_normalizes_keys_over_space_but_not_queries():
    q, k, v = torch.randn(1, 1, 3, 10), torch.randn(1, 1, 3, 10), torch.randn(1, 1, 2, 10)
    base = content_attention(q, k, v)
    # softmax over space: adding a constant to one key channel everywhere changes nothing
    k2 = k.clone()
    k2[:, :, 1] += 5.0
    torch.testing.assert_close(content_attention(q, k2, v), base)
    # no softmax on queries: the output is linear in q
    torch.testing.assert_close(content_attention(3 * q, k, v), 3 * base)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_content_attention_never_forms_an_n_by_n_tensor():
    # N = 256 x 256 = 65536 positions: an N x N float32 attention map would need 16 GiB.
    n_pix = 256 * 256
    q, k, v = (torch.randn(1, 2, 4, n_pix, requires_grad=True) for _ in range(3))
    with _LargestTensor() as mode:
        out = content_attention(q, k, v)
        out.square().sum().backward()
    assert out.shape == (1, 2, 4, n_pix) and torch.isfinite(out).all()
    assert mode.largest <= 2 * 4 * n_pix                          # no tensor beyond a copy of q
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # a few positions against the explicit N-long attention weights w_pp' = sum_c q_pc softmax(k)_cp'
    k_soft = k.detach()[0, 0].softmax(-1)
    for p in (0, 12345, n_pix - 1):
        weights = q.detach()[0, 0, :, p] @ k_soft
        torch.testing.assert_close(out.detach()[0, 0, :, p], v.detach()[0, 0] @ weights, rtol=1e-4, atol=1e-5)


def test_smaller_maps_use_the_central_embeddings_and_larger_maps_are_refused():
    big = GlobalSelfAttention2d(8, 8, feature_size=8, heads=2).eval()
    small = GlobalSelfAttention2d(8, 8, feature_size=5, heads=2).eval()
    state = big.state_dict()
    state["rel_column"], state["rel_row"] = state["rel_column"][3:12], state["rel_row"][3:12]
    small.load_state_dict(state)
    x = torch.randn(2, 8, 5, 4)
    with torch.no_grad():
        torch.testing.assert_close(big(x), small(x))
    with pytest.raises(ValueError, match="image_size"):
        big(torch.randn(1, 8, 9, 9))
    model = create_model("gsa_resnet26", num_classes=10, resolution="cifar", width=0.25)
    with pytest.raises(ValueError, match="image_size"):
        model(torch.rand(1, 3, 64, 64))
    assert model.eval()(torch.rand(1, 3, 16, 16)).shape == (1, 10)


def test_stride_two_pools_after_the_module():
    module = GlobalSelfAttention2d(16, 16, feature_size=8, stride=2).eval()
    plain = GlobalSelfAttention2d(16, 16, feature_size=8).eval()
    plain.load_state_dict(module.state_dict())
    x = torch.randn(2, 16, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(module(x), torch.nn.functional.avg_pool2d(plain(x), 2))


def test_positional_attention_breaks_permutation_equivariance():
    module = GlobalSelfAttention2d(16, 16, feature_size=6).eval()
    x = torch.randn(1, 16, 6, 6)
    perm = torch.randperm(36)
    with torch.no_grad():
        y = module(x).flatten(2)[..., perm]
        y_perm = module(x.flatten(2)[..., perm].view_as(x)).flatten(2)
    assert not torch.allclose(y, y_perm, atol=1e-3)


def test_bfloat16_autocast_runs():
    module = GlobalSelfAttention2d(16, 16, feature_size=8)
    x = torch.randn(2, 16, 8, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = module(x)
    y.float().sum().backward()
    assert torch.isfinite(y.float()).all() and torch.isfinite(x.grad).all()


def test_bad_configurations_raise_clear_errors():
    with pytest.raises(ValueError, match="divisible by heads"):
        GlobalSelfAttention2d(12, 12, feature_size=4, heads=8)
    with pytest.raises(ValueError, match=r"expected input \(B, 16"):
        GlobalSelfAttention2d(16, 16, feature_size=4)(torch.randn(1, 8, 4, 4))


def test_gsa_resnet26_parameter_count_matches_derivation():
    # ResNet-26 with each 3x3 conv (9 C^2) swapped for q, k, v 1x1 convs (3 C^2), two relative
    # embedding tables (2 (2L - 1) C/8) and the BN between column and row layers (2 C).
    with torch.device("meta"):
        expected = count_params(create_model("resnet26"))
    size = 224 // 4
    for stage, (blocks, channels) in enumerate(zip(RESNET_LAYERS[26], (64, 128, 256, 512))):
        for index in range(blocks):
            expected += -9 * channels ** 2 + 3 * channels ** 2 + 2 * (2 * size - 1) * channels // 8 + 2 * channels
            if stage > 0 and index == 0:
                size //= 2
    assert model_complexity("gsa_resnet26")["params"] == expected


def test_registered_in_the_gsa_family():
    from robust_attn.models.registry import list_models
    assert list_models(family="gsa") == GSA_MODELS


def test_checkpoint_round_trip_keeps_outputs(tmp_path):
    from robust_attn.models.checkpoint import load_checkpoint, save_checkpoint
    from robust_attn.models.wrapper import NormalizedModel
    model = create_model("gsa_resnet26", num_classes=10, resolution="cifar", width=0.25)
    wrapped = NormalizedModel(model, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)).eval()
    save_checkpoint(tmp_path / "gsa.safetensors", wrapped)
    loaded = load_checkpoint(tmp_path / "gsa.safetensors")
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), wrapped(x))


def test_relative_embeddings_start_at_the_documented_scale():
    """The paper gives no initialization; the module's docstring chooses AA's N(0, d_k^-1/2)."""
    torch.manual_seed(0)
    layer = GlobalSelfAttention2d(8, 64, feature_size=32, heads=1, key_channels=64)   # d_k 64: std 1/8
    for table in (layer.rel_column, layer.rel_row):
        assert table.shape == (63, 64)
        assert table.std().item() == pytest.approx(64 ** -0.5, rel=0.05)
