"""ImageNetV2 matched-frequency (Recht et al., "Do ImageNet Classifiers Generalize to ImageNet?",
ICML 2019): 10,000 new test images, 10 per ImageNet class, sampled as the original validation set was.

Published layout: ``imagenetv2-matched-frequency-format-val/<class index>/*.jpeg``, one folder per
class named by its ImageNet-1k index ``0`` ... ``999`` (the archive of
github.com/modestyachts/ImageNetV2), read from that folder under ``ROOT`` or
``ROOT/imagenetv2``. Labels are the folder names as integers (not their sorted order, in which
``10`` comes before ``2``).
"""
from __future__ import annotations

from robust_attn.data.base import register_dataset
from robust_attn.data.class_folders import folder_test_set
from robust_attn.data.imagenet import wnids

__all__ = ["INFO", "locate", "build", "TAKES_TRANSFORM"]

FOLDER = "imagenetv2-matched-frequency-format-val"

INFO, locate, build = folder_test_set(
    "imagenetv2", {str(i): i for i in range(1000)}, wnids(), (FOLDER, f"imagenetv2/{FOLDER}"),
    how_to_get=f"Download imagenetv2-matched-frequency.tar.gz from https://github.com/modestyachts/ImageNetV2 and "
               f"extract it under ROOT (ROOT/{FOLDER}/<0..999>/*.jpeg).")
TAKES_TRANSFORM = True

register_dataset(__name__)
