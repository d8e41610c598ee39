"""Properties every registered architecture must have, parametrized over ``list_models()``
(timm's tests/test_models.py pattern): family tests hold only what is specific to a family."""
import pytest
from model_checks import SLOW_AT_CIFAR, check_trains_evaluates_and_round_trips

from robust_attn import list_models
from robust_attn.complexity import model_complexity
from robust_attn.reference import imagenet_reference


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
