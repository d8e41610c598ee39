"""Attention-augmented ResNets and Wide-ResNet (Bello et al., ICCV 2019, "AA").

ImageNet ResNets (AA section 4.2): every residual block of the last three stages has its 3x3
convolution replaced by an :class:`~robust_attn.layers.aa.AugmentedConv2d` (stage 0 keeps plain
3x3 convolutions); ``Nh = 8``; ``kappa = upsilon = 0.2`` (ResNet-34: 0.25). Bottleneck nets
(26/38/50/101) reuse :func:`robust_attn.models.resnet.build_resnet` through its
``spatial_layer`` hook; ResNet-34 is a basic-block net, built by :class:`BasicResNet` below,
whose first 3x3 convolution of each block is augmented ("once per residual block", AA
section 3.2). The first attention stage attends on a 2x average-pooled map at ImageNet
resolution (AA section 4.2 "downsample only during the first stage", Table 9: the 28x28 stage
attends at 14x14); at CIFAR resolution nothing is pooled (AA appendix A.1). Override with
``pool_first_stage=True/False``.

CIFAR-100 Wide-ResNet-28-10 (AA section 4.1): :class:`WideResNet` (pre-activation basic
blocks, widths 160/320/640, 4 blocks per stage, no dropout: the paper does not mention it),
the first convolution of every block augmented with ``kappa = 2 upsilon = 0.2``.

**Key depth.** AA section 4.1 states "a minimum of 20 dimensions per head for the keys"
(``dk >= 160`` with 8 heads). We apply it to every model: it is the setting that reproduces
AA's parameter counts wherever they are mutually consistent:

====================================  ==============  =========================
model (AA table)                      paper           ours (this module)
====================================  ==============  =========================
AA-WRN-28-10, Table 1                 36.2M           36,312,660 (+0.3%)
AA-ResNet-34, Table 3                 20.7M           20,745,072 (+0.2%)
AA-ResNet-50 k=v=0.25, Tables 2, 6    24.3M           24,303,728 (+0.0%)
AA-ResNet-50 k=v=0.5 / 0.75 / 1.0, T6 22.3/20.7/19.4M 22.34M / 20.74M / 19.38M
AA-ResNet-50 k=v=0.2, Table 3         25.8M           24,798,768 (-3.9%)
AA-ResNet-101 k=v=0.2, Table 3        45.4M           43,569,896 (-4.0%)
====================================  ==============  =========================

Without the minimum, AA-ResNet-50 at 0.2 has 24.13M and Table 6 is missed by up to 2.2%. The
Table 3 counts of AA-ResNet-50/101 are *above* their ResNet baselines (25.6M / 44.5M) although
equation 5 says augmenting a 3x3 convolution removes parameters; no setting consistent with
Tables 1, 2 and 6 reaches them (computing q, k, v from the 4x wider block input instead of the
conv input would give 25.93M / 45.60M, but it contradicts AA Figure 8, where one ``X`` feeds
both the conv and the attention, and misses Table 6 by 7-47%). Note also that Table 3's
AA-ResNet-50 top-1 (77.7) is that of Table 2's 24.3M ``upsilon = 0.25`` model. The tests pin
our counts exactly for those two and check the others within 2%.

**Multiply-adds** (``robust_attn.models.complexity.model_complexity``, 1 image; AA's GFlops count a
multiply and an add separately, so paper MACs = GFlops / 2):

=============  ===========  ==========================
model          paper GMACs  ours GMACs
=============  ===========  ==========================
aa_resnet34    3.55         3.60  (+1.3%)
aa_resnet50    4.15         4.07  (-1.9%)
aa_resnet101   8.05         7.89  (-2.0%)
aa_wrn28_10    5.45         6.17  (+13%, CIFAR 32 px)
aa_resnet26    --           2.35  (resnet26 2.34)
aa_resnet38    --           3.21  (resnet38 3.22)
=============  ===========  ==========================

aa_wrn28_10 exceeds the paper by more than 10% because of the same 20-dims-per-head minimum:
in the first stage (32x32 = 1024 tokens, 160 channels) it makes ``dk = 160`` instead of 32, and
``QK^T`` alone costs 1024^2 x 160 = 168M multiply-adds per layer (0.67G over 4 blocks), plus
the 1x1 query/key convolutions. With ``dk = 0.2 * 160`` the model has 5.38 GMACs (-1.3%) but
35.82M parameters (-1.1%): AA's Table 1 parameters (36.2M) need the minimum, its GFlops
(10.9) look computed without it. We keep the stated minimum (``min_key_dims_per_head=0``
selects the other reading).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn

from robust_attn.layers.aa import AugmentedConv2d, aa_dims
from robust_attn.models.resnet import RESNET_LAYERS, BlockSpec, build_resnet, conv_stem
from robust_attn.models.registry import register_model
from robust_attn.models.resolution import resolve, scaled_width

__all__ = ["aa_spatial_layer", "BasicBlock", "BasicResNet", "WideBlock", "WideResNet", "build_aa_resnet",
           "PAPER_MACS"]

# AA Table 3 / Table 1 GFlops halved (multiply-adds), for comparison with count_macs.
PAPER_MACS = {"aa_resnet34": 3.55e9, "aa_resnet50": 4.15e9, "aa_resnet101": 8.05e9, "aa_wrn28_10": 5.45e9}


def conv3x3(spec: BlockSpec) -> nn.Module:
    return nn.Conv2d(spec.in_channels, spec.out_channels, 3, spec.stride, 1, bias=False)


def aa_spatial_layer(kappa: float, upsilon: float, heads: int = 8, min_key_dims_per_head: int = 20,
                     stages: Sequence[int] = (1, 2, 3), pool_stage: int | None = None,
                     **layer_kw) -> Callable[[BlockSpec], nn.Module]:
    """A ``spatial_layer`` hook: augmented 3x3 convs in ``stages`` (plain 3x3 convs elsewhere);
    the stage ``pool_stage`` attends on a 2x pooled map. ``layer_kw`` go to the layer
    (``impl``, ``chunk_elements``, ``checkpoint``)."""

    def make(spec: BlockSpec) -> nn.Module:
        if spec.stage not in stages:
            return conv3x3(spec)
        dk, dv = aa_dims(spec.out_channels, kappa, upsilon, heads, min_key_dims_per_head)
        return AugmentedConv2d(spec.in_channels, spec.out_channels, 3, spec.stride, dk=dk, dv=dv, heads=heads,
                               feature_size=spec.feature_size, attn_pool=2 if spec.stage == pool_stage else 1,
                               **layer_kw)

    return make


def _pool_stage(resolution: str, pool_first_stage: bool | None, first_stage: int) -> int | None:
    pool = (resolution == "imagenet") if pool_first_stage is None else pool_first_stage
    return first_stage if pool else None


def build_aa_resnet(layers: Sequence[int], num_classes: int, resolution: str, *, kappa: float = 0.2,
                    upsilon: float = 0.2, heads: int = 8, min_key_dims_per_head: int = 20,
                    pool_first_stage: bool | None = None, impl: str = "einsum", checkpoint: bool = False,
                    **kw) -> nn.Module:
    """Bottleneck AA-ResNet: :func:`build_resnet` with augmented 3x3 convs in stages 1-3."""
    hook = aa_spatial_layer(kappa, upsilon, heads, min_key_dims_per_head,
                            pool_stage=_pool_stage(resolution, pool_first_stage, 1), impl=impl,
                            checkpoint=checkpoint)
    return build_resnet(layers, num_classes, resolution, spatial_layer=hook, **kw)


# -- basic-block ResNet (ResNet-18/34 layout) -------------------------------------------------------
class BasicBlock(nn.Module):
    """Post-activation basic block (He et al. 2016): spatial layer (3x3 conv or augmented,
    strided), BN, ReLU, 3x3 conv, BN, projection shortcut where the shape changes."""

    def __init__(self, spec: BlockSpec, first_layer: Callable[[BlockSpec], nn.Module]):
        super().__init__()
        planes = spec.out_channels
        self.conv1 = first_layer(spec)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if spec.stride != 1 or spec.in_channels != planes:
            self.downsample = nn.Sequential(nn.Conv2d(spec.in_channels, planes, 1, spec.stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class BasicResNet(nn.Module):
    """ResNet-18/34 layout: the ResNet stem, four stages of :class:`BasicBlock` (64-512 wide),
    global average pool, linear classifier. ``first_layer(spec)`` builds each block's first conv
    (``spec.in_channels`` is the block input)."""

    def __init__(self, layers: Sequence[int], num_classes: int = 1000, image_size: int = 224,
                 stem_downsample: int = 4, width: float = 1.0,
                 first_layer: Callable[[BlockSpec], nn.Module] = conv3x3):
        super().__init__()
        in_channels = scaled_width(64, width)
        self.stem = conv_stem(in_channels, stem_downsample)
        size = image_size // stem_downsample
        stages = []
        for stage, (blocks, base) in enumerate(zip(layers, (64, 128, 256, 512))):
            planes = scaled_width(base, width)
            modules = []
            for index in range(blocks):
                stride = 2 if (stage > 0 and index == 0) else 1
                modules.append(BasicBlock(BlockSpec(stage, index, in_channels, planes, stride, size), first_layer))
                in_channels, size = planes, size // stride
            stages.append(nn.Sequential(*modules))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.num_features, self.final_feature_size = in_channels, size
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if isinstance(m, BasicBlock):
                nn.init.zeros_(m.bn2.weight)    # each residual branch starts as identity

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.forward_features(x)), 1))


# -- Wide-ResNet (Zagoruyko & Komodakis 2016), pre-activation ----------------------------------------
class WideBlock(nn.Module):
    """Pre-activation wide basic block: BN, ReLU, first conv (strided; augmented in AA), BN,
    ReLU, 3x3 conv; 1x1 projection shortcut of the pre-activated input where shape changes."""

    def __init__(self, spec: BlockSpec, first_layer: Callable[[BlockSpec], nn.Module]):
        super().__init__()
        planes = spec.out_channels
        self.bn1 = nn.BatchNorm2d(spec.in_channels)
        self.conv1 = first_layer(spec)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.relu = nn.ReLU(inplace=False)
        self.shortcut = None
        if spec.stride != 1 or spec.in_channels != planes:
            self.shortcut = nn.Conv2d(spec.in_channels, planes, 1, spec.stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.relu(self.bn1(x))
        identity = x if self.shortcut is None else self.shortcut(pre)
        out = self.conv2(self.relu(self.bn2(self.conv1(pre))))
        return out + identity


class WideResNet(nn.Module):
    """WRN-``depth``-``k``: a 3x3 conv to 16 channels (at ``stem_downsample=1``; the ResNet stem
    otherwise), three stages of ``(depth - 4) / 6`` :class:`WideBlock` with ``16k, 32k, 64k``
    channels (strides 1, 2, 2), BN-ReLU, global average pool, linear classifier."""

    def __init__(self, depth: int = 28, widen: int = 10, num_classes: int = 100, image_size: int = 32,
                 stem_downsample: int = 1, width: float = 1.0,
                 first_layer: Callable[[BlockSpec], nn.Module] = conv3x3):
        super().__init__()
        if (depth - 4) % 6:
            raise ValueError(f"WRN depth must be 6n + 4, got {depth}")
        blocks = (depth - 4) // 6
        in_channels = scaled_width(16, width)
        self.stem = (nn.Conv2d(3, in_channels, 3, 1, 1, bias=False) if stem_downsample == 1
                     else conv_stem(in_channels, stem_downsample))
        size = image_size // stem_downsample
        stages = []
        for stage, base in enumerate((16 * widen, 32 * widen, 64 * widen)):
            planes = scaled_width(base, width)
            modules = []
            for index in range(blocks):
                stride = 2 if (stage > 0 and index == 0) else 1
                modules.append(WideBlock(BlockSpec(stage, index, in_channels, planes, stride, size), first_layer))
                in_channels, size = planes, size // stride
            stages.append(nn.Sequential(*modules))
        self.layer1, self.layer2, self.layer3 = stages
        self.bn = nn.BatchNorm2d(in_channels)
        self.relu = nn.ReLU(inplace=True)
        self.num_features, self.final_feature_size = in_channels, size
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.relu(self.bn(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.forward_features(x)), 1))


# -- registered architectures ------------------------------------------------------------------------
@register_model(family="aa", paper="AA section 4.2 style: ResNet-26 [1,2,4,1], k=v=0.2, Nh=8 (no AA figure)")
def aa_resnet26(num_classes=1000, resolution="imagenet", **kw):
    return build_aa_resnet(RESNET_LAYERS[26], num_classes, resolution, **kw)


@register_model(family="aa", paper="AA section 4.2 style: ResNet-38 [2,3,5,2], k=v=0.2, Nh=8 (no AA figure)")
def aa_resnet38(num_classes=1000, resolution="imagenet", **kw):
    return build_aa_resnet(RESNET_LAYERS[38], num_classes, resolution, **kw)


@register_model(family="aa", paper="AA Table 3: AA-ResNet-50, k=v=0.2, Nh=8")
def aa_resnet50(num_classes=1000, resolution="imagenet", **kw):
    return build_aa_resnet(RESNET_LAYERS[50], num_classes, resolution, **kw)


@register_model(family="aa", paper="AA Table 3: AA-ResNet-101, k=v=0.2, Nh=8")
def aa_resnet101(num_classes=1000, resolution="imagenet", **kw):
    return build_aa_resnet(RESNET_LAYERS[101], num_classes, resolution, **kw)


@register_model(family="aa", paper="AA Table 3: AA-ResNet-34 (basic blocks [3,4,6,3]), k=v=0.25, Nh=8")
def aa_resnet34(num_classes=1000, resolution="imagenet", *, image_size=None, stem_downsample=None, width=1.0,
                kappa=0.25, upsilon=0.25, heads=8, min_key_dims_per_head=20, pool_first_stage=None,
                impl="einsum", checkpoint=False):
    res = resolve(resolution, image_size, stem_downsample)
    hook = aa_spatial_layer(kappa, upsilon, heads, min_key_dims_per_head,
                            pool_stage=_pool_stage(resolution, pool_first_stage, 1), impl=impl,
                            checkpoint=checkpoint)
    return BasicResNet((3, 4, 6, 3), num_classes, res.image_size, res.stem_downsample, width,
                                        first_layer=hook)


@register_model(family="aa", paper="AA Table 1: AA-Wide-ResNet-28-10 (CIFAR-100), k=2v=0.2, Nh=8")
def aa_wrn28_10(num_classes=1000, resolution="imagenet", *, image_size=None, stem_downsample=None, width=1.0,
                kappa=0.2, upsilon=0.1, heads=8, min_key_dims_per_head=20, pool_first_stage=None,
                impl="einsum", checkpoint=False):
    """All three stages augmented ("first conv of every block"); at ImageNet resolution the
    ResNet stem is used and the first stage attends on a pooled map, like the AA-ResNets."""
    res = resolve(resolution, image_size, stem_downsample)
    hook = aa_spatial_layer(kappa, upsilon, heads, min_key_dims_per_head, stages=(0, 1, 2),
                            pool_stage=_pool_stage(resolution, pool_first_stage, 0), impl=impl,
                            checkpoint=checkpoint)
    return WideResNet(28, 10, num_classes, res.image_size, res.stem_downsample, width,
                                       first_layer=hook)
