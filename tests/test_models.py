"""Properties every registered architecture must have, parametrized over ``list_models()``
(timm's tests/test_models.py pattern): family tests hold only what is specific to a family."""
import pytest
import torch
from model_checks import SLOW_AT_CIFAR, check_trains_evaluates_and_round_trips

from robust_attn import create_model, list_models
from robust_attn.models.complexity import model_complexity
from robust_attn.models.reference import imagenet_reference


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


DEPTH_26 = ["resnet26", "san10_pairwise", "san10_patchwise", "sasa_resnet26", "gsa_resnet26", "aa_resnet26",
            "ea_resnet26"]


@pytest.mark.parametrize("name", DEPTH_26)
def test_every_family_runs_under_bf16_autocast(name):
    """CPU bfloat16 autocast (the path a GPU run with --amp bf16 takes): eval logits within bfloat16
    rounding of float32's, and a training step with finite loss and gradients."""
    torch.manual_seed(0)
    model = create_model(name, num_classes=10, resolution="cifar", width=0.25, stem_downsample=4).eval()
    x, y = torch.rand(2, 3, 32, 32), torch.tensor([1, 7])
    with torch.no_grad():
        reference = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(x)
    assert low.dtype == torch.bfloat16
    assert (low.float() - reference).abs().max() <= 0.02 * reference.abs().max()
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
