"""ImageNet-Sketch (Wang et al., "Learning Robust Global Representations by Penalizing Local
Predictive Power", NeurIPS 2019): 50,889 black-and-white sketches, about 50 per ImageNet class.

Published layout: ``sketch/<wnid>/*.JPEG``, one folder per ImageNet-1k wnid (the archive of
github.com/HaohanWang/ImageNet-Sketch), read from ``ROOT/imagenet-sketch/sketch``,
``ROOT/sketch`` or ``ROOT/imagenet-sketch``. Labels are the ImageNet-1k class indices.
"""
from __future__ import annotations

from robust_attn.data.base import register_dataset
from robust_attn.data.class_folders import folder_test_set
from robust_attn.data.imagenet import wnid_index, wnids

__all__ = ["INFO", "locate", "build", "TAKES_TRANSFORM"]

INFO, locate, build = folder_test_set(
    "imagenet_sketch", wnid_index(), wnids(), ("imagenet-sketch/sketch", "sketch", "imagenet-sketch"),
    how_to_get="Download ImageNet-Sketch from https://github.com/HaohanWang/ImageNet-Sketch and extract it under "
               "ROOT (ROOT/sketch/<wnid>/*.JPEG).")
TAKES_TRANSFORM = True

register_dataset(__name__)
