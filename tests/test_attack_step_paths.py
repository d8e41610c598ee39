"""The attack-time computation of every zoo family is the model's function: the folded attack copy
(:func:`robust_attn.attacks.fast_model.attack_model`) on the default (lean, compiled-kernel) attention
paths, in channels-last layout, against the model itself on its reference attention paths (SAN's
unfold, SASA's reference), at the CIFAR zoo's layout (stem_downsample 2: SASA's first stage streams
over a 16x16 map). In float64, so that float ties cannot hide a wrong function: logits and input
gradients agree to 1e-9, and native PGD's fast mode ends on the same predictions as the exact mode.
On CUDA too where a GPU is present (the lean paths run PyTorch operators there, not the CPU kernels);
those cases skip without one."""
import copy

import pytest
import torch

import robust_attn
from robust_attn.attacks import PGDConfig, draw_targets, targeted_pgd
from robust_attn.attacks.fast_model import attack_model
from robust_attn.layers.paths import set_attention_path
from robust_attn.models.wrapper import NormalizedModel

FAMILIES = ("resnet26", "san10_pairwise", "san10_patchwise", "sasa_resnet26", "gsa_resnet26", "aa_resnet26",
            "ea_resnet26")
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")))


def _model(name: str) -> NormalizedModel:
    """A tiny float64 model in eval mode whose batch norms have non-trivial statistics and affines
    (so folding them changes the convolutions' weights)."""
    torch.manual_seed(0)
    net = robust_attn.create_model(name, 10, "cifar", width=0.25, stem_downsample=2)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.2)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 1.0)
                m.weight.copy_(torch.rand(m.num_features, generator=gen) * 0.2 + 0.1)
                m.bias.copy_(torch.randn(m.num_features, generator=gen) * 0.2)
    return NormalizedModel(net, [0.49, 0.48, 0.45], [0.25, 0.24, 0.26]).double().eval()


def _logits_and_input_gradient(model, x):
    x = x.clone().requires_grad_(True)
    out = model(x)
    grad, = torch.autograd.grad(out.logsumexp(1).sum() - out[:, 3].sum(), x)
    return out.detach(), grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FAMILIES)
def test_attack_copy_on_the_default_paths_computes_the_reference_function(name, device):
    model = _model(name).to(device)
    x = torch.rand(2, 3, 32, 32, dtype=torch.double, generator=torch.Generator().manual_seed(2)).to(device)
    reference = copy.deepcopy(model)
    set_attention_path(reference, "reference")
    fast = attack_model(model, x)
    want = _logits_and_input_gradient(reference, x)
    got = _logits_and_input_gradient(fast, x.contiguous(memory_format=torch.channels_last))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FAMILIES)
def test_native_pgd_fast_mode_ends_on_the_exact_modes_predictions(name, device):
    model = _model(name).to(device)
    x = torch.rand(4, 3, 32, 32, dtype=torch.double, generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        labels = model(x).argmax(1)
    targets = draw_targets(labels, 10, seed=0)
    config = PGDConfig(8, 2, 4)
    fast = targeted_pgd(model, x, targets, config)
    reference = copy.deepcopy(model)
    set_attention_path(reference, "reference")
    exact = targeted_pgd(reference, x, targets, config, exact=True)
    assert (fast - x).abs().max() > 0                       # the attack moved the images
    assert ((fast - exact).abs() <= 1e-12).double().mean() >= 0.99
    with torch.no_grad():
        assert torch.equal(model(fast).argmax(1), reference(exact).argmax(1))
