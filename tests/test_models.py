"""Properties every registered architecture must have, parametrized over ``list_models()``
(timm's tests/test_models.py pattern): family tests hold only what is specific to a family."""
import io

import pytest
import torch
import torch.nn as nn

from robust_attn import create_model, list_models
from robust_attn.complexity import model_complexity
from robust_attn.reference import imagenet_reference

# A tiny but complete instance of each architecture: width 0.25, a 64 px "imagenet" input
# (the stem still downsamples 4x), the real 32 px "cifar" input. AA's WRN at 32 px is slow on
# CPU, so the default run builds it with a 2x stem (the full one is marked slow below).
TINY = {"cifar": dict(width=0.25), "imagenet": dict(width=0.25, image_size=64)}
SLOW_AT_CIFAR = {"aa_wrn28_10"}


def tiny_model(name, resolution, **overrides):
    return create_model(name, num_classes=10, resolution=resolution, **{**TINY[resolution], **overrides})


def check_trains_evaluates_and_round_trips(name, resolution, **overrides):
    """Default init: finite forward/backward, deterministic eval, exact state_dict round trip."""
    model = tiny_model(name, resolution, **overrides)
    size = TINY[resolution].get("image_size", 32)
    x = torch.rand(2, 3, size, size)
    out = model.train()(x)
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    out.logsumexp(-1).sum().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"{pname}: no finite gradient"
    model.eval()
    with torch.no_grad():
        first, second = model(x), model(x)
    assert torch.isfinite(first).all()
    torch.testing.assert_close(first, second, rtol=0, atol=0)   # eval mode is deterministic
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    clone = tiny_model(name, resolution, **overrides)
    clone.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    with torch.no_grad():
        torch.testing.assert_close(clone.eval()(x), first, rtol=0, atol=0)


@pytest.mark.parametrize("resolution", ["cifar", "imagenet"])
@pytest.mark.parametrize("name", list_models())
def test_every_architecture_trains_evaluates_and_round_trips(name, resolution):
    overrides = {"stem_downsample": 2} if resolution == "cifar" and name in SLOW_AT_CIFAR else {}
    check_trains_evaluates_and_round_trips(name, resolution, **overrides)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW_AT_CIFAR))
def test_slow_architectures_at_full_cifar_resolution(name):
    check_trains_evaluates_and_round_trips(name, "cifar")


# AA Table 3's AA-ResNet-50/101 counts exceed their ResNet baselines, which AA's equation 5 rules
# out for q/k/v from 1x1 convs on the bottleneck width; models/aa.py explains and tests/test_aa.py
# pins the counts we get (24.80M and 43.57M).
UNREACHABLE = {"aa_resnet50", "aa_resnet101"}
REFERENCE = sorted(set(imagenet_reference()) & set(list_models()))


@pytest.mark.parametrize("name", REFERENCE)
def test_parameters_within_2_percent_of_the_papers(name):
    if name in UNREACHABLE:
        pytest.skip("paper figure unreachable; count pinned in tests/test_aa.py")
    paper = imagenet_reference()[name]["params_M"]
    ours = model_complexity(name)["params"] / 1e6
    assert abs(ours - paper) / paper < 0.02, (ours, paper)


@pytest.mark.parametrize("name", REFERENCE)
def test_multiply_adds_within_10_percent_of_the_papers(name):
    paper = imagenet_reference()[name]["macs_G"]
    ours = model_complexity(name)["macs"] / 1e9
    assert abs(ours - paper) / paper < 0.10, (ours, paper)


def test_reference_table_covers_every_family():
    assert {name.split("_")[0].rstrip("0123456789") for name in REFERENCE} >= {"resnet", "san", "sasa", "gsa", "aa"}
