"""GSA-ResNets (Shen et al., "Global Self-Attention Networks", section 4 and Table 6):
ResNet-26/38/50/101 with every 3x3 convolution replaced by a GSA module
(:class:`robust_attn.layers.gsa.GlobalSelfAttention2d`, 8 heads, key/query/value channels equal
to the input width), and 2x2/2 average pooling right after the first GSA module of residual
groups 2-4. Each module's relative embeddings are sized for the map side at its layer
(``BlockSpec.feature_size``), so a model accepts inputs up to the ``image_size`` it was built
for and refuses larger ones with a message naming ``image_size=``.

Parameters (1000 classes): 14.20M / 18.05M / 30.40M for GSA-ResNet-38/50/101 against
14.2 / 18.1 / 30.4M in GSA Table 6. GSA-ResNet-26 (no paper figure): 10.35M.

Multiply-adds at 224 px (``robust_attn.models.complexity.count_macs``): 2.95 / 3.59 / 6.09 G for 38 /
50 / 101, against 5.9 / 7.2 / 12.2 GFLOPs in Table 6 with multiplies and adds counted separately,
i.e. 2.95 / 3.6 / 6.1 G multiply-adds (within 1%). Per module that is the qkv 1x1 convolutions,
the content attention (two ``N d_k d_v`` products per head) and the column and row positional
layers over the whole map (``q . P`` and the weighted sum, ``N L d`` each); softmax, BN and
pooling are not counted.
"""
from __future__ import annotations

from functools import partial

import torch.nn as nn

from robust_attn.layers.gsa import GlobalSelfAttention2d
from robust_attn.models.resnet import RESNET_LAYERS, BlockSpec, build_resnet
from robust_attn.models.registry import register_model

__all__ = ["build_gsa_resnet"]


def _gsa_layer(spec: BlockSpec, heads: int) -> nn.Module:
    return GlobalSelfAttention2d(spec.in_channels, spec.out_channels, spec.feature_size, heads=heads,
                                 stride=spec.stride)


def build_gsa_resnet(depth: int, num_classes: int = 1000, resolution: str = "imagenet", *, heads: int = 8,
                     **kw) -> nn.Module:
    """GSA-ResNet-``depth``; ``kw``: ``width``, ``image_size``, ``stem_downsample``."""
    return build_resnet(RESNET_LAYERS[depth], num_classes, resolution,
                        spatial_layer=partial(_gsa_layer, heads=heads), **kw)


@register_model(family="gsa", paper="GSA: ResNet-26 with GSA modules (no figure in the paper)")
def gsa_resnet26(num_classes=1000, resolution="imagenet", **kw):
    return build_gsa_resnet(26, num_classes, resolution, **kw)


@register_model(family="gsa", paper="GSA Table 6: GSA-ResNet-38")
def gsa_resnet38(num_classes=1000, resolution="imagenet", **kw):
    return build_gsa_resnet(38, num_classes, resolution, **kw)


@register_model(family="gsa", paper="GSA Table 6: GSA-ResNet-50")
def gsa_resnet50(num_classes=1000, resolution="imagenet", **kw):
    return build_gsa_resnet(50, num_classes, resolution, **kw)


@register_model(family="gsa", paper="GSA Table 6: GSA-ResNet-101")
def gsa_resnet101(num_classes=1000, resolution="imagenet", **kw):
    return build_gsa_resnet(101, num_classes, resolution, **kw)
