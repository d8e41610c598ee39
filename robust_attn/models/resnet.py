"""Bottleneck ResNets (He et al. 2016) as the SAN paper uses them, and the backbone the
attention families plug into.

ResNet-26/38/50 have [1, 2, 4, 1], [2, 3, 5, 2] and [3, 4, 6, 3] bottleneck blocks (SAN section
5.1): 13.70M / 19.63M / 25.56M parameters at 1000 classes. Not timm's ``resnet26`` ([2,2,2,2]).

:class:`ResNet` takes two hooks so that the attention families reuse it instead of copying it:

* ``spatial_layer(spec)`` builds the layer that stands where the bottleneck's 3x3 convolution
  stands (SASA, GSA, AA replace it); it must map ``(N, spec.in_channels, S, S)`` to
  ``(N, spec.out_channels, S / spec.stride, S / spec.stride)`` with ``S = spec.feature_size``.
* ``stage_end_layer(stage, channels, feature_size)`` optionally appends a module after the
  last block of a stage (External Attention); ``None`` appends nothing.
* ``stem`` optionally replaces the convolutional stem (SASA's attention stem).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn

from robust_attn.models.registry import register_model
from robust_attn.models.resolution import resolve, scaled_width

__all__ = ["BlockSpec", "Bottleneck", "ResNet", "conv_stem", "build_resnet"]


@dataclass(frozen=True)
class BlockSpec:
    """Where a bottleneck's spatial layer sits: what a ``spatial_layer`` hook is told."""

    stage: int          # residual stage, 0..3 (conv2_x .. conv5_x)
    index: int          # block index within the stage
    in_channels: int    # channels into the spatial layer (the bottleneck width)
    out_channels: int   # channels out of it
    stride: int         # 2 in the first block of stages 1-3, else 1
    feature_size: int   # side of the (square) map entering the spatial layer


def conv3x3_layer(spec: BlockSpec) -> nn.Module:
    return nn.Conv2d(spec.in_channels, spec.out_channels, 3, spec.stride, 1, bias=False)


class Bottleneck(nn.Module):
    """1x1 reduce, spatial layer (3x3 conv by default, stride here as in torchvision v1.5),
    1x1 expand, projection shortcut where shape changes."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, spec: BlockSpec,
                 spatial_layer: Callable[[BlockSpec], nn.Module]):
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = spatial_layer(spec)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if spec.stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, spec.stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def conv_stem(out_channels: int, stem_downsample: int) -> nn.Sequential:
    """The ResNet stem: 7x7/2 conv + 3x3/2 max pool for ``stem_downsample=4`` (ImageNet),
    a 3x3 conv of stride 1 or 2 for 1 or 2 (CIFAR-sized input)."""
    if stem_downsample == 4:
        return nn.Sequential(nn.Conv2d(3, out_channels, 7, 2, 3, bias=False), nn.BatchNorm2d(out_channels),
                             nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
    return nn.Sequential(nn.Conv2d(3, out_channels, 3, stem_downsample, 1, bias=False),
                         nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True))


class ResNet(nn.Module):
    """Four stages of bottleneck blocks on a stem, global average pool, linear classifier."""

    def __init__(self, layers: Sequence[int], num_classes: int = 1000, image_size: int = 224,
                 stem_downsample: int = 4, width: float = 1.0, base_widths: Sequence[int] = (64, 128, 256, 512),
                 spatial_layer: Callable[[BlockSpec], nn.Module] = conv3x3_layer,
                 stage_end_layer: Callable[[int, int, int], nn.Module | None] | None = None,
                 stem: nn.Module | None = None):
        super().__init__()
        stem_channels = scaled_width(64, width)
        self.stem = stem if stem is not None else conv_stem(stem_channels, stem_downsample)
        size = image_size // stem_downsample
        in_channels = stem_channels
        stages = []
        for stage, (blocks, base) in enumerate(zip(layers, base_widths)):
            planes = scaled_width(base, width)
            modules: list[nn.Module] = []
            for index in range(blocks):
                stride = 2 if (stage > 0 and index == 0) else 1
                spec = BlockSpec(stage, index, planes, planes, stride, size)
                modules.append(Bottleneck(in_channels, planes, spec, spatial_layer))
                in_channels = planes * Bottleneck.expansion
                size //= stride
            if stage_end_layer is not None:
                extra = stage_end_layer(stage, in_channels, size)
                if extra is not None:
                    modules.append(extra)
            stages.append(nn.Sequential(*modules))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.num_features = in_channels
        self.final_feature_size = size
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        # Zero-init the last BN of each block: each residual branch starts as identity.
        for m in self.modules():
            if isinstance(m, Bottleneck):
                nn.init.zeros_(m.bn3.weight)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.forward_features(x)), 1))


def build_resnet(layers: Sequence[int], num_classes: int, resolution: str, *, image_size: int | None = None,
                 stem_downsample: int | None = None, width: float = 1.0, **hooks) -> ResNet:
    """Resolve ``resolution`` and its overrides, then build a :class:`ResNet` with ``hooks``."""
    res = resolve(resolution, image_size, stem_downsample)
    return ResNet(layers, num_classes, res.image_size, res.stem_downsample, width, **hooks)


RESNET_LAYERS = {26: (1, 2, 4, 1), 38: (2, 3, 5, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}


@register_model(family="resnet", paper="SAN section 5.1: ResNet-26 baseline, blocks [1,2,4,1]")
def resnet26(num_classes=1000, resolution="imagenet", **kw):
    return build_resnet(RESNET_LAYERS[26], num_classes, resolution, **kw)


@register_model(family="resnet", paper="SAN section 5.1: ResNet-38 baseline, blocks [2,3,5,2]")
def resnet38(num_classes=1000, resolution="imagenet", **kw):
    return build_resnet(RESNET_LAYERS[38], num_classes, resolution, **kw)


@register_model(family="resnet", paper="He et al. 2016: ResNet-50, blocks [3,4,6,3]")
def resnet50(num_classes=1000, resolution="imagenet", **kw):
    return build_resnet(RESNET_LAYERS[50], num_classes, resolution, **kw)
