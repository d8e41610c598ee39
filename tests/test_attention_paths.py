"""robust_attn.layers.paths: one switch puts a model's SAN and SASA layers on their reference or lean
path, which compute the same function (outputs and input gradients agree)."""
import pytest
import torch

import robust_attn
from robust_attn.layers.paths import ATTENTION_PATHS, set_attention_path
from robust_attn.layers.san import SelfAttention2d
from robust_attn.layers.sasa import SASAttention2d


def _tiny(name):
    torch.manual_seed(0)
    return robust_attn.create_model(name, 10, "cifar", width=0.25, stem_downsample=4).double().eval()


def _output_and_input_gradient(model, x):
    x = x.clone().requires_grad_(True)
    out = model(x)
    grad, = torch.autograd.grad(out.logsumexp(1).sum() + out[:, 3].sum(), x)
    return out.detach(), grad


@pytest.mark.parametrize("name", ["san10_pairwise", "san10_patchwise", "sasa_resnet26"])
def test_both_paths_compute_the_same_function(name):
    model = _tiny(name)
    layers = [m for m in model.modules() if isinstance(m, (SelfAttention2d, SASAttention2d))]
    x = torch.rand(2, 3, 32, 32, dtype=torch.double, generator=torch.Generator().manual_seed(1))
    results = {}
    for path in ATTENTION_PATHS:
        assert set_attention_path(model, path) == len(layers) > 0
        expected = "unfold" if path == "reference" and name.startswith("san") else path
        assert {getattr(m, "implementation", getattr(m, "impl", None)) for m in layers} == {expected}
        results[path] = _output_and_input_gradient(model, x)
    for lean, reference in zip(results["lean"], results["reference"]):
        torch.testing.assert_close(lean, reference, rtol=1e-9, atol=1e-10)


def test_a_model_without_local_attention_is_left_as_it_is_and_a_bad_path_is_refused():
    model = _tiny("resnet26")
    x = torch.rand(2, 3, 32, 32, dtype=torch.double)
    before = model(x)
    assert set_attention_path(model, "reference") == 0
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    with pytest.raises(ValueError, match="one of lean, reference, got 'fast'"):
        set_attention_path(_tiny("sasa_resnet26"), "fast")
