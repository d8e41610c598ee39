"""Under CPU autocast, SAN's and SASA's operators run in float32 (layers/precision.py): the same
outputs and gradients as without autocast, while the convolutions around them run in bfloat16."""
import pytest
import torch

from robust_attn import create_model
from robust_attn.layers.san import SelfAttention2d
from robust_attn.layers.sasa import SASAttention2d


def _layers():
    torch.manual_seed(0)
    return {
        "san_pairwise": SelfAttention2d(32, attention="pairwise", footprint=3),
        "san_patchwise": SelfAttention2d(32, attention="patchwise", footprint=3),
        "sasa": SASAttention2d(32, 32, kernel_size=3, heads=4),
    }


@pytest.mark.parametrize("name", ["san_pairwise", "san_patchwise", "sasa"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_operator_under_cpu_autocast_is_its_float32_self(name, in_dtype):
    layer = _layers()[name].train()
    x = torch.randn(2, 32, 6, 6).to(in_dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.float32
    y.square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    for p in layer.parameters():
        p.grad = None
    x32 = x.detach().float().requires_grad_()
    expected = layer(x32)
    expected.square().sum().backward()
    # bit for bit: the same float32 computation (the batch statistics were updated twice alike)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    for got, want in zip(grads, [p.grad for p in layer.parameters()] + [x32.grad]):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=0)


def test_float64_input_stays_float64_under_autocast():
    layer = _layers()["san_pairwise"].double().eval()
    x = torch.randn(1, 32, 5, 5, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, layer(x), rtol=0, atol=0)


@pytest.mark.parametrize("arch,attention_type", [("san10_pairwise", SelfAttention2d),
                                                 ("sasa_resnet26", SASAttention2d)])
def test_in_a_model_only_the_attention_leaves_bfloat16(arch, attention_type):
    model = create_model(arch, 10, "cifar", width=0.125).eval()
    dtypes = {"attention": set(), "conv": set()}

    def hook(kind):
        return lambda module, inputs, output: dtypes[kind].add(output.dtype)

    for module in model.modules():
        if isinstance(module, attention_type):
            module.register_forward_hook(hook("attention"))
        elif isinstance(module, torch.nn.Conv2d) and not any(
                module is sub for a in model.modules() if isinstance(a, attention_type) for sub in a.modules()):
            module.register_forward_hook(hook("conv"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.rand(2, 3, 32, 32))
    assert dtypes["attention"] == {torch.float32}
    assert dtypes["conv"] == {torch.bfloat16}


def test_off_switch_restores_half_precision(monkeypatch):
    monkeypatch.setattr("robust_attn.layers.precision.CPU_AUTOCAST_FLOAT32", False)
    layer = _layers()["sasa"].eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(1, 32, 6, 6)).dtype == torch.bfloat16
