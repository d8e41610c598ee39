"""torchvision-layout bottleneck ResNet state dicts as robust-attn ResNets.

``robust-attn zoo import torchvision-resnet PATH.pth --arch resnet50``. Our
:class:`robust_attn.models.resnet.ResNet` names the stem ``stem.0`` (7x7/2 conv) and ``stem.1``
(BN) where torchvision has ``conv1`` and ``bn1``; ``layer1``-``layer4`` (``conv1..3``, ``bn1..3``,
``downsample.0/1``) and ``fc`` have torchvision's names and shapes. The conversion renames the
stem and checks every key and shape.

Structure: both put the bottleneck's stride on the 3x3 convolution ("ResNet v1.5",
torchvision's ``Bottleneck`` since 0.2; ours, :class:`~robust_attn.models.resnet.Bottleneck`),
with a strided 1x1 projection shortcut, stem max pool 3x3/2 padding 1, and ReLU after the sum.
A v1 (Caffe-style, stride on the first 1x1) checkpoint has the same keys and shapes, so no
converter can tell it apart: its forward would differ silently. Import only torchvision-layout
weights trained as v1.5 (all of torchvision's ``ResNet50_Weights``).

Not supported, refused with the reason: BasicBlock ResNets (``resnet18``/``resnet34``: no
``conv3``), ``wide_resnet*`` and ``resnext*`` (other widths/groups: shape errors), and block
counts of no registered arch (``resnet101``/``resnet152``).
"""
from __future__ import annotations

import os

import torch

from robust_attn.importers import (ConversionError, convert_and_save, register_importer, remap, strip_module_prefix,
                                   target_model)
from robust_attn.models.resnet import RESNET_LAYERS
from robust_attn.models.registry import list_models, model_info

__all__ = ["RESNET_ARCHS", "convert_torchvision_resnet", "import_torchvision_resnet"]

RESNET_ARCHS = tuple(n for n in list_models("resnet*") if model_info(n).family == "resnet")
_STEM = {"stem.0.": "conv1.", "stem.1.": "bn1."}
_DESCRIPTION = "torchvision-layout ResNet state dict (stem conv1/bn1 renamed to stem.0/stem.1)"


def torchvision_key(key: str) -> str:
    """torchvision's name of our ResNet parameter/buffer ``key``."""
    for ours, theirs in _STEM.items():
        if key.startswith(ours):
            return theirs + key[len(ours):]
    return key


def _hint(state_dict: dict[str, torch.Tensor], arch: str) -> str:
    if "layer1.0.conv2.weight" in state_dict and "layer1.0.conv3.weight" not in state_dict:
        return ("The file is a BasicBlock ResNet (torchvision resnet18/resnet34: no conv3), which robust-attn "
                "does not build; import a bottleneck ResNet (resnet50)")
    counts = tuple(len({k.split(".")[1] for k in state_dict if k.startswith(f"layer{s}.")}) for s in range(1, 5))
    if any(counts) and counts != RESNET_LAYERS.get(int(arch[len("resnet"):])):
        match = [f"resnet{d}" for d, layers in RESNET_LAYERS.items()
                 if layers == counts and f"resnet{d}" in RESNET_ARCHS]
        return (f"The file has {list(counts)} blocks per stage: " +
                (f"pass --arch {match[0]}" if match else "no registered ResNet has that layout "
                 f"(registered: {', '.join(f'{a} {list(RESNET_LAYERS[int(a[6:])])}' for a in RESNET_ARCHS)})"))
    conv2 = state_dict.get("layer1.0.conv2.weight")
    if isinstance(conv2, torch.Tensor) and conv2.dim() == 4 and conv2.shape[0] != conv2.shape[1]:
        return "The 3x3 convolutions are grouped (a ResNeXt), which robust-attn does not build"
    return ""


def _check_arch(arch: str) -> None:
    if arch not in RESNET_ARCHS:
        raise ConversionError(f"--arch {arch!r} is not a ResNet baseline; choose one of {', '.join(RESNET_ARCHS)}")


def convert_torchvision_resnet(state_dict: dict[str, torch.Tensor], arch: str,
                               model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Our state dict (of ``create_model(arch, num_classes, "imagenet")``) from torchvision's layout.

    ``num_classes`` comes from ``fc.weight``. Unknown, missing or mis-shaped keys raise
    :class:`ConversionError` naming them, with the likely reason (BasicBlock, block counts, groups)."""
    _check_arch(arch)
    state_dict = strip_module_prefix(state_dict)
    model = target_model(state_dict, arch, model)
    target = model.state_dict()
    mapping = {k: torchvision_key(k) for k in target}
    return remap(state_dict, mapping, target, f"not a torchvision-layout {arch} state dict", _hint(state_dict, arch))


@register_importer("torchvision-resnet", "a torchvision-layout ResNet state dict")
def import_torchvision_resnet(path: str | os.PathLike, arch: str, out: str | os.PathLike) -> str:
    """Convert the torchvision-layout state dict at ``path`` into a robust-attn checkpoint ``out``
    (ImageNet mean/std in the wrapper); its sha256."""
    _check_arch(arch)
    return convert_and_save("torchvision-resnet", path, arch, out, convert_torchvision_resnet, _DESCRIPTION)
