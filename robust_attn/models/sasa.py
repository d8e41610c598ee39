"""SASA-ResNets (Ramachandran et al. 2019, section 3): ResNet-26/38/50 with every 3x3 convolution
replaced by 7x7 local multi-head self-attention with relative embeddings (8 heads), 2x2/2 average
pooling after the attention layer where the ResNet downsamples (section 3.1), a convolutional stem
by default ("Conv-stem + Attention" of Table 1) or the spatially-aware attention stem of
appendix A.1 with ``stem="attention"`` ("Full Attention").

Parameters (1000 classes, conv stem): 10.34M / 14.19M / 18.04M against 10.3 / 14.1 / 18.0M in
SASA Table 1. Multiply-adds at 224 px (``robust_attn.models.complexity.count_macs``, which on the meta
device runs the einsum reference of the attention): 2.24 / 2.86 / 3.48 G, against the Table's
4.5 / 5.7 / 7.0 GFLOPs with multiplies and adds counted separately, i.e. 2.25 / 2.85 / 3.5 G
multiply-adds (within 1%). With ``stem="attention"``, ResNet-50: 18.03M and 3.54 G against the
"Full Attention" row's 18.0M and 7.2 GFLOPs (3.6 G multiply-adds).

Overrides (besides ``width``, ``stem_downsample``, ``image_size``): ``stem`` ("conv" or
"attention"), ``kernel_size`` (7), ``heads`` (8), ``impl`` ("lean" or "reference").
"""
from __future__ import annotations

from functools import partial

import torch.nn as nn

from robust_attn.layers.sasa import AttentionStem, SASAttention2d
from robust_attn.models.resnet import RESNET_LAYERS, BlockSpec, build_resnet
from robust_attn.models.registry import register_model
from robust_attn.models.resolution import resolve, scaled_width

__all__ = ["build_sasa_resnet"]


def _sasa_layer(spec: BlockSpec, kernel_size: int, heads: int, impl: str) -> nn.Module:
    return SASAttention2d(spec.in_channels, spec.out_channels, kernel_size, heads, spec.stride, impl)


def build_sasa_resnet(depth: int, num_classes: int = 1000, resolution: str = "imagenet", *, stem: str = "conv",
                      kernel_size: int = 7, heads: int = 8, impl: str = "lean", width: float = 1.0,
                      image_size: int | None = None, stem_downsample: int | None = None) -> nn.Module:
    """SASA-ResNet-``depth`` (26, 38 or 50 in the paper)."""
    if stem not in ("conv", "attention"):
        raise ValueError(f"stem must be 'conv' or 'attention', got {stem!r}")
    res = resolve(resolution, image_size, stem_downsample)
    stem_module = None
    if stem == "attention":
        stem_module = AttentionStem(scaled_width(64, width), res.stem_downsample)
    return build_resnet(RESNET_LAYERS[depth], num_classes, resolution, image_size=res.image_size,
                        stem_downsample=res.stem_downsample, width=width,
                        spatial_layer=partial(_sasa_layer, kernel_size=kernel_size, heads=heads, impl=impl),
                        stem=stem_module)


@register_model(family="sasa", paper="SASA Table 1: ResNet-26, 7x7 local attention, conv stem")
def sasa_resnet26(num_classes=1000, resolution="imagenet", **kw):
    return build_sasa_resnet(26, num_classes, resolution, **kw)


@register_model(family="sasa", paper="SASA Table 1: ResNet-38, 7x7 local attention, conv stem")
def sasa_resnet38(num_classes=1000, resolution="imagenet", **kw):
    return build_sasa_resnet(38, num_classes, resolution, **kw)


@register_model(family="sasa", paper="SASA Table 1: ResNet-50, 7x7 local attention, conv stem")
def sasa_resnet50(num_classes=1000, resolution="imagenet", **kw):
    return build_sasa_resnet(50, num_classes, resolution, **kw)
