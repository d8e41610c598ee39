"""SAN10/15/19, pairwise and patchwise (Zhao, Jia, Koltun, CVPR 2020, section 3.4, Table 1).

Five stages of 64/256/512/1024/2048 channels with [2,1,2,4,1] (SAN10), [3,2,3,5,2] (SAN15) or
[3,3,4,6,3] (SAN19) self-attention blocks; footprints 3, 7, 7, 7, 7.

* Stem: 1x1 conv 3 -> 64 (no bias) at full resolution, BN, ReLU.
* Before each stage: 2x2/2 max pool and a bias-free 1x1 conv to the stage width; after the
  stage's blocks: BN, ReLU (the paper's "transition" BN-ReLU-pool-linear, as arranged in the
  authors' code). Blocks never stride.
* Block (Figure 1, pre-activation as in the authors' code): ``x + conv1x1(relu(bn2(sa(relu(bn1(x))))))``
  where ``sa`` is :class:`~robust_attn.layers.san.SelfAttention2d` ``C -> C/4`` (r1 = 16,
  r2 = 4, 8 channels share a weight) and the 1x1 conv ``C/4 -> C`` has a bias.
* Head: global average pool, linear.
* Initialization (not in the paper): convolutions Kaiming-normal (fan-out); each block's last
  1x1 conv zero-initialized, so every block starts as the identity.

Resolutions. ImageNet (224 px, ``stem_downsample=4``): pools before all five stages, maps
112/56/28/14/7. The stage with 256 channels sees ``image_size / stem_downsample``, the size
ResNet's first stage sees: ``stem_downsample=1`` ("cifar", 32 px) drops the pools before the
first two stages (maps 32/32/16/8/4), ``stem_downsample=2`` keeps only the one before the
256-channel stage (32/16/8/4/2). Where a map is smaller than the 7x7 footprint the reflection
padding mirrors repeatedly (see :mod:`robust_attn.layers.local_aggregation`).

``width`` scales every stage width with :func:`~robust_attn.models.resolution.scaled_width` (multiples
of 16, so C/16 is exact). When ``C/4`` is not a multiple of 8 (e.g. a 16-channel stage at
``width=0.25``), ``share_planes`` becomes ``gcd(8, C/4)`` for that stage; at ``width=1`` it is
always 8.

Complexity at 1000 classes, ImageNet 224 (``robust_attn.models.complexity.model_complexity``; paper
Table 3 in brackets): parameters 10.52/14.07/17.60M pairwise (10.5/14.1/17.6M) and
11.84/16.18/20.52M patchwise (11.8/16.2/20.5M); Table 4's relations also match (pairwise
concatenation 10.57M, dot 10.50M; patchwise star 10.93M, clique 11.51M). Multiply-adds:
2.01/2.80/3.56G pairwise (2.2/3.0/3.8G) and 1.76/2.42/3.06G patchwise (1.9/2.6/3.3G), 6-9%
below the paper, see :data:`PAPER_MACS_NOTE`.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn

from robust_attn.layers.san import SelfAttention2d, conv1x1
from robust_attn.models.registry import register_model
from robust_attn.models.resolution import resolve, scaled_width

__all__ = ["SAN_LAYERS", "SAN_FOOTPRINTS", "SAN_WIDTHS", "SANBlock", "SAN", "build_san", "PAPER_MACS_NOTE"]

SAN_LAYERS = {10: (2, 1, 2, 4, 1), 15: (3, 2, 3, 5, 2), 19: (3, 3, 4, 6, 3)}
SAN_FOOTPRINTS = (3, 7, 7, 7, 7)
SAN_WIDTHS = (64, 256, 512, 1024, 2048)

PAPER_MACS_NOTE = (
    "Multiply-adds are counted by FlopCounterMode over convolutions and matmuls, which covers "
    "phi/psi/beta, gamma's 1x1 layers (applied at every footprint position for pairwise) and the "
    "linear layers; the footprint aggregation itself (k^2 * C/4 multiply-adds per pixel) is an "
    "element-wise product-sum and is not counted, like softmax and BN; it is below 2% of the total "
    "(0.03G for SAN10). The remaining 6-9% below the paper's Table 3 is not explained by the paper; "
    "presumably its counter also counted element-wise work (relations, BN, softmax).")


class SANBlock(nn.Module):
    """Pre-activation SAN residual block (Figure 1): BN-ReLU-SA(C -> C/4)-BN-ReLU-linear(C/4 -> C) + x.

    The linear layer is an ``nn.Conv2d`` (state-dict layout) applied with
    :func:`~robust_attn.layers.san.conv1x1` (a batched matmul, faster on CPU)."""

    def __init__(self, channels: int, *, attention: str, relation: str | None, footprint: int,
                 share_planes: int = 8, implementation: str = "lean"):
        super().__init__()
        mid = channels // 4
        self.bn1 = nn.BatchNorm2d(channels)
        self.attn = SelfAttention2d(channels, attention=attention, relation=relation, footprint=footprint,
                                    share_planes=math.gcd(share_planes, mid), implementation=implementation)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv = nn.Conv2d(mid, channels, 1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.attn(self.relu(self.bn1(x)))
        return x + conv1x1(self.relu(self.bn2(out)), self.conv)


class SAN(nn.Module):
    """Self-attention network of Table 1; ``pools[s]`` says whether stage ``s`` starts with a 2x2 pool."""

    def __init__(self, layers: Sequence[int], *, attention: str = "pairwise", relation: str | None = None,
                 num_classes: int = 1000, widths: Sequence[int] = SAN_WIDTHS,
                 footprints: Sequence[int] = SAN_FOOTPRINTS, pools: Sequence[bool] = (True,) * 5,
                 image_size: int = 224, implementation: str = "lean"):
        super().__init__()
        if not (len(layers) == len(widths) == len(footprints) == len(pools) == 5):
            raise ValueError("SAN has five stages: layers, widths, footprints and pools need 5 entries each")
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(inplace=True))
        stages, in_channels, size, sizes = [], widths[0], image_size, []
        for blocks, channels, footprint, pool in zip(layers, widths, footprints, pools):
            size //= 2 if pool else 1
            sizes.append(size)
            stages.append(nn.Sequential(
                nn.MaxPool2d(2, 2) if pool else nn.Identity(),
                nn.Conv2d(in_channels, channels, 1, bias=False),
                *[SANBlock(channels, attention=attention, relation=relation, footprint=footprint,
                           implementation=implementation) for _ in range(blocks)],
                nn.BatchNorm2d(channels), nn.ReLU(inplace=True)))
            in_channels = channels
        self.stages = nn.Sequential(*stages)
        self.num_features = in_channels
        self.feature_sizes = tuple(sizes)  # side of each stage's map
        self.final_feature_size = sizes[-1]
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        # Zero-init each block's last linear layer: every residual branch starts as identity, as
        # the ResNet baseline's zero-initialized last BN does. Patchwise weights have no softmax,
        # so without it the residual stream of an untrained model grows block by block in eval
        # mode (BN with fresh running statistics does not renormalize) until it overflows.
        for m in self.modules():
            if isinstance(m, SANBlock):
                nn.init.zeros_(m.conv.weight)
                nn.init.zeros_(m.conv.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.forward_features(x)), 1))


def build_san(depth: int, attention: str, num_classes: int = 1000, resolution: str = "imagenet", *,
              width: float = 1.0, stem_downsample: int | None = None, image_size: int | None = None,
              relation: str | None = None, implementation: str = "lean") -> SAN:
    """SAN``depth`` (10/15/19) at ``resolution`` with the shared overrides (see module doc).

    ``relation`` selects a Table 4 relation (default: subtraction / concatenation), ``implementation``
    the operator's ``"lean"`` (default) or ``"unfold"`` path.
    """
    if depth not in SAN_LAYERS:
        raise ValueError(f"SAN depth must be one of {sorted(SAN_LAYERS)}, got {depth}")
    res = resolve(resolution, image_size, stem_downsample)
    pools = (res.stem_downsample == 4, res.stem_downsample >= 2, True, True, True)
    widths = [scaled_width(c, width) for c in SAN_WIDTHS]
    return SAN(SAN_LAYERS[depth], attention=attention, relation=relation, num_classes=num_classes,
               widths=widths, pools=pools, image_size=res.image_size, implementation=implementation)


_PAPER = "SAN (Zhao et al. CVPR 2020) Table 1/3: SAN{depth} {attention}, {relation} relation"


@register_model(family="san", paper=_PAPER.format(depth=10, attention="pairwise", relation="subtraction"))
def san10_pairwise(num_classes=1000, resolution="imagenet", **overrides):
    return build_san(10, "pairwise", num_classes, resolution, **overrides)


@register_model(family="san", paper=_PAPER.format(depth=15, attention="pairwise", relation="subtraction"))
def san15_pairwise(num_classes=1000, resolution="imagenet", **overrides):
    return build_san(15, "pairwise", num_classes, resolution, **overrides)


@register_model(family="san", paper=_PAPER.format(depth=19, attention="pairwise", relation="subtraction"))
def san19_pairwise(num_classes=1000, resolution="imagenet", **overrides):
    return build_san(19, "pairwise", num_classes, resolution, **overrides)


@register_model(family="san", paper=_PAPER.format(depth=10, attention="patchwise", relation="concatenation"))
def san10_patchwise(num_classes=1000, resolution="imagenet", **overrides):
    return build_san(10, "patchwise", num_classes, resolution, **overrides)


@register_model(family="san", paper=_PAPER.format(depth=15, attention="patchwise", relation="concatenation"))
def san15_patchwise(num_classes=1000, resolution="imagenet", **overrides):
    return build_san(15, "patchwise", num_classes, resolution, **overrides)


@register_model(family="san", paper=_PAPER.format(depth=19, attention="patchwise", relation="concatenation"))
def san19_patchwise(num_classes=1000, resolution="imagenet", **overrides):
    return build_san(19, "patchwise", num_classes, resolution, **overrides)
