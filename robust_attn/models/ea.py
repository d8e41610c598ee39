"""External-attention ResNets (EA: Guo et al. 2021; see ``robust_attn.layers.external_attention``).

No ImageNet EA-ResNet classifier is published (EA's classification results use a transformer;
its ResNet experiments are COCO detection backbones, where "external attention is added at the
end of the residual stages", notes section 4.4). Our choice, following that detection backbone:
the bottleneck ResNet-26/38/50 of :mod:`robust_attn.models.resnet` (unchanged blocks) with one
:class:`~robust_attn.layers.external_attention.ExternalAttention` module (``S = 64`` slots,
single head unless ``heads=``/``expansion=`` say otherwise) appended after the last block of
*each* of the four residual stages, through ``build_resnet``'s ``stage_end_layer`` hook.

Each module adds ``2 C^2 + C`` (two 1x1 convs, the first with bias) ``+ 2 S C`` (memories)
``+ 2 C`` (BN) parameters for a stage of ``C`` output channels (C = 256, 512, 1024, 2048 at
width 1), 11.64M in all, dominated by the last stage's 2048-channel convs (8.4M); and about
``2 C^2 + 2 S C`` multiply-adds per pixel, 1.84G at 224 px (0.46G per stage). Measured with
``robust_attn.models.complexity.model_complexity``: ea_resnet26 25.34M / 4.18 GMACs (resnet26 13.70M /
2.34G), ea_resnet38 31.27M / 5.05G (19.63M / 3.22G), ea_resnet50 37.20M / 5.93G (25.56M / 4.09G).
These are heavier backbones than their baselines; compare robustness at matched clean
accuracy or note the budget. No paper figure exists; the tests check the count against the
formula above built from the layer dimensions.
"""
from __future__ import annotations

from robust_attn.layers.external_attention import ExternalAttention
from robust_attn.models.resnet import RESNET_LAYERS, build_resnet
from robust_attn.models.registry import register_model

__all__ = ["build_ea_resnet"]


def build_ea_resnet(layers, num_classes: int, resolution: str, *, slots: int = 64, heads: int = 1,
                    expansion: int = 1, **kw):
    """Bottleneck ResNet with an :class:`ExternalAttention` module at the end of every stage."""
    return build_resnet(layers, num_classes, resolution,
                        stage_end_layer=lambda stage, channels, size: ExternalAttention(channels, slots, heads,
                                                                                        expansion), **kw)


@register_model(family="ea", paper="EA (Guo et al. 2021) modules at the end of each stage of ResNet-26 (ours)")
def ea_resnet26(num_classes=1000, resolution="imagenet", **kw):
    return build_ea_resnet(RESNET_LAYERS[26], num_classes, resolution, **kw)


@register_model(family="ea", paper="EA (Guo et al. 2021) modules at the end of each stage of ResNet-38 (ours)")
def ea_resnet38(num_classes=1000, resolution="imagenet", **kw):
    return build_ea_resnet(RESNET_LAYERS[38], num_classes, resolution, **kw)


@register_model(family="ea", paper="EA (Guo et al. 2021) modules at the end of each stage of ResNet-50 (ours)")
def ea_resnet50(num_classes=1000, resolution="imagenet", **kw):
    return build_ea_resnet(RESNET_LAYERS[50], num_classes, resolution, **kw)
