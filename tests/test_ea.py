"""External attention (EA, Guo et al. 2021) and the EA-ResNet zoo entries."""

import pytest
import torch
import torch.nn as nn

from robust_attn import create_model
from robust_attn.models.complexity import count_params
from robust_attn.layers.external_attention import ExternalAttention, double_normalize
from robust_attn.models.resnet import RESNET_LAYERS, build_resnet


def slow_external_attention(m: ExternalAttention, x: torch.Tensor) -> torch.Tensor:
    """EA sections 3.2-3.4 with explicit per-pixel / per-slot loops (eval-mode BN)."""
    n, c, h, w = x.shape
    out = torch.empty_like(x)
    Wi, bi = m.conv_in.weight[:, :, 0, 0], m.conv_in.bias
    Wo = m.conv_out.weight[:, :, 0, 0]
    bn = m.bn
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    for b in range(n):
        F_ = Wi @ x[b].reshape(c, h * w) + bi[:, None]                    # (C * expansion, N)
        heads = []
        for hd in range(m.heads):
            f = F_[hd * m.head_dim:(hd + 1) * m.head_dim]                 # (d, N)
            logits = m.memory_key @ f                                     # (S, N): alpha~_{s,i}
            A = torch.empty_like(logits)
            for s in range(m.slots):                                      # softmax over pixels
                e = torch.exp(logits[s] - logits[s].max())
                A[s] = e / e.sum()
            for i in range(h * w):                                        # L1 over slots
                A[:, i] = A[:, i] / (m.eps + A[:, i].sum())
            heads.append(m.memory_value @ A)                              # (d, N)
        y = Wo @ torch.cat(heads, 0)                                      # (C, N)
        y = (y - bn.running_mean[:, None]) * scale[:, None] + bn.bias[:, None]
        out[b] = torch.relu(x[b] + y.reshape(c, h, w))
    return out


def _randomize_bn(m: nn.Module) -> None:
    for bn in m.modules():
        if isinstance(bn, nn.BatchNorm2d):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(bn.weight, 0.5, 1.5)
            nn.init.uniform_(bn.bias, -0.2, 0.2)


@pytest.mark.parametrize("heads,expansion", [(1, 1), (4, 2)])
def test_module_matches_slow_reference(heads, expansion):
    m = ExternalAttention(16, slots=8, heads=heads, expansion=expansion).eval()
    with torch.no_grad():
        _randomize_bn(m)
        nn.init.normal_(m.conv_in.bias)
    x = torch.randn(2, 16, 5, 4)
    with torch.no_grad():
        torch.testing.assert_close(m(x), slow_external_attention(m, x), rtol=1e-4, atol=1e-5)


def test_double_normalization_sums():
    m = ExternalAttention(16, slots=8)
    x = torch.randn(2, 16, 6, 6)
    attn = m.attention_map(x)                                             # (N, heads, S, HW)
    assert attn.shape == (2, 1, 8, 36)
    # First softmax over the 36 pixels of each slot, then L1 over the 8 slots of each pixel:
    logits = torch.einsum("sc,nchw->nshw", m.memory_key, m.conv_in(x)).reshape(2, 1, 8, 36)
    soft = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(attn, soft / (m.eps + soft.sum(dim=2, keepdim=True)))
    # so every pixel's column sums to one (up to eps, negligible at these magnitudes) ...
    torch.testing.assert_close(attn.sum(dim=2), torch.ones(2, 1, 36))
    # ... and it is the softmax over pixels, rescaled per pixel: rows are no longer normalized
    logits = torch.randn(3, 8, 36)
    soft = torch.softmax(logits, -1)
    torch.testing.assert_close(soft.sum(-1), torch.ones(3, 8))
    dn = double_normalize(logits)
    torch.testing.assert_close(dn, soft / soft.sum(-2, keepdim=True))
    assert not torch.allclose(dn.sum(-1), torch.ones(3, 8))


def test_key_and_value_memories_are_independent_parameters():
    m = ExternalAttention(16, slots=8)
    params = dict(m.named_parameters())
    assert params["memory_key"].shape == (8, 16) and params["memory_value"].shape == (16, 8)
    assert m.memory_key.data_ptr() != m.memory_value.data_ptr()
    before = m.memory_value.detach().clone()
    with torch.no_grad():
        m.memory_key.add_(1.0)
    torch.testing.assert_close(m.memory_value.detach(), before, rtol=0, atol=0)
    # Both receive their own gradient and a state_dict round trip keeps them apart.
    m(torch.randn(2, 16, 4, 4)).sum().backward()
    assert m.memory_key.grad is not None and m.memory_value.grad is not None
    clone = ExternalAttention(16, slots=8)
    clone.load_state_dict(m.state_dict())
    torch.testing.assert_close(clone.memory_key, m.memory_key)
    torch.testing.assert_close(clone.memory_value, m.memory_value)


def test_attention_is_linear_in_pixels_and_handles_any_size():
    m = ExternalAttention(16, slots=8).eval()
    for size in (3, 7):
        assert m(torch.randn(1, 16, size, size)).shape == (1, 16, size, size)
    with pytest.raises(ValueError, match=r"expects \(N, 16, H, W\)"):
        m(torch.randn(1, 8, 4, 4))
    with pytest.raises(ValueError, match="divisible by heads"):
        ExternalAttention(16, heads=3)


def _ea_params(c: int, s: int, heads: int = 1, expansion: int = 1) -> int:
    inner = c * expansion
    d = inner // heads
    return (c * inner + inner) + s * d + d * s + inner * c + 2 * c   # conv_in (+bias), M_k, M_v, conv_out, BN


@pytest.mark.parametrize("depth", [26, 38, 50])
def test_ea_resnet_params_equal_formula(depth):
    with torch.device("meta"):
        ea = create_model(f"ea_resnet{depth}")
        base = build_resnet(RESNET_LAYERS[depth], 1000, "imagenet")
        multi = create_model(f"ea_resnet{depth}", heads=8, expansion=2)
    channels = [256, 512, 1024, 2048]
    assert count_params(ea) == count_params(base) + sum(_ea_params(c, 64) for c in channels)
    assert count_params(multi) == count_params(base) + sum(_ea_params(c, 64, 8, 2) for c in channels)
    assert [type(stage[-1]) for stage in (ea.layer1, ea.layer2, ea.layer3, ea.layer4)] == [ExternalAttention] * 4


@pytest.mark.parametrize("name", ["ea_resnet26", "ea_resnet38", "ea_resnet50"])
def test_gradient_reaches_both_memories(name):
    # generic checks (finite, eval determinism, round trip) live in tests/test_models.py
    model = create_model(name, num_classes=10, resolution="cifar", width=0.25)
    for m in model.modules():          # undo the zero-init of last BNs so every branch gets gradient
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
    model(torch.rand(2, 3, 32, 32)).logsumexp(-1).sum().backward()
    memories = [p for n, p in model.named_parameters() if "memory" in n]
    assert len(memories) == 8 and all(p.grad.abs().sum() > 0 for p in memories)

