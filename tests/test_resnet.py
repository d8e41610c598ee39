import pytest
import torch
import torch.nn as nn

from robust_attn import create_model
from robust_attn.models.complexity import count_params, model_complexity
from robust_attn.models.resnet import BlockSpec, build_resnet
from robust_attn.models.reference import imagenet_reference


@pytest.mark.parametrize("name,expected", [("resnet26", 13_696_552), ("resnet38", 19_626_792),
                                           ("resnet50", 25_557_032)])
def test_parameter_counts_match_torchvision_layout(name, expected):
    # 25,557,032 is torchvision's resnet50; 26 and 38 follow from SAN section 5.1's block counts.
    assert model_complexity(name)["params"] == expected
    paper = imagenet_reference()[name]
    assert abs(expected / 1e6 - paper["params_M"]) / paper["params_M"] < 0.02


def test_resnet50_equals_torchvision_resnet50_in_parameters():
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        ours, theirs = create_model("resnet50"), torchvision.models.resnet50()
    assert count_params(ours) == count_params(theirs)


@pytest.mark.parametrize("name", ["resnet26", "resnet38", "resnet50"])
def test_multiply_adds_match_san_table3(name):
    macs = model_complexity(name)["macs"] / 1e9
    assert abs(macs - imagenet_reference()[name]["flops_G"]) / imagenet_reference()[name]["flops_G"] < 0.05


def test_cifar_resolution_keeps_a_4x4_map_in_the_last_stage():
    model = create_model("resnet26", num_classes=10, resolution="cifar", width=0.25)
    assert model.final_feature_size == 4
    assert model.forward_features(torch.rand(1, 3, 32, 32)).shape[-2:] == (4, 4)
    strided = create_model("resnet26", num_classes=10, resolution="cifar", width=0.25, stem_downsample=2)
    assert strided.forward_features(torch.rand(1, 3, 32, 32)).shape[-2:] == (2, 2)


def test_imagenet_resolution_ends_at_7x7():
    with torch.device("meta"):
        model = create_model("resnet26")
    assert model.final_feature_size == 7


def test_spatial_and_stage_end_hooks_see_the_right_specs():
    seen: list[BlockSpec] = []

    def spatial(spec: BlockSpec) -> nn.Module:
        seen.append(spec)
        return nn.Conv2d(spec.in_channels, spec.out_channels, 3, spec.stride, 1, bias=False)

    ends = []
    model = build_resnet((1, 2, 1, 1), 10, "cifar", width=0.25, spatial_layer=spatial,
                         stage_end_layer=lambda s, c, f: ends.append((s, c, f)) or nn.Identity())
    assert [(s.stage, s.index, s.stride, s.feature_size) for s in seen] == [
        (0, 0, 1, 32), (1, 0, 2, 32), (1, 1, 1, 16), (2, 0, 2, 16), (3, 0, 2, 8)]
    assert ends == [(0, 64, 32), (1, 128, 16), (2, 256, 8), (3, 512, 4)]
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 10)


def test_width_multiplier_scales_every_stage():
    model = create_model("resnet26", num_classes=10, resolution="cifar", width=0.5)
    assert model.num_features == 1024
    assert model.layer1[0].conv2.in_channels == 32


def test_reference_puts_every_paper_on_the_multiply_add_convention():
    reference = imagenet_reference()
    assert reference["resnet50"]["macs_G"] == reference["resnet50"]["flops_G"] == 4.1   # SAN: multiply-adds
    assert reference["sasa_resnet50"]["macs_G"] == 3.5                                  # SASA: 7.0 FLOPs
