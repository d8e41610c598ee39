"""The model of ``bench_memory.py``: a zoo architecture (or a timm model) at a chosen input size,
given as ``benchmarks/_memory_model.py:build`` so that every command loads it the same way.

The environment chooses it (a transfer's ``--source``/``--target`` take no model-args):
``BENCH_ARCH`` (a registry name, or ``timm:NAME``), ``BENCH_SIZE`` (pixels) and ``BENCH_WIDTH``
(the zoo's channel width multiplier). Its ``preprocessing`` resizes the images to the size, and
it takes normalized input (``input_range``)."""
import os

from robust_attn.models.registry import create_model

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def build(num_classes=2):
    arch, size = os.environ.get("BENCH_ARCH", "resnet26"), int(os.environ.get("BENCH_SIZE", "224"))
    if arch.startswith("timm:"):
        import timm

        net = timm.create_model(arch[5:], pretrained=False, num_classes=num_classes)
    else:
        net = create_model(arch, num_classes, "imagenet" if size > 64 else "cifar",
                           width=float(os.environ.get("BENCH_WIDTH", "0.25")))
    net.preprocessing = {"mean": MEAN, "std": STD, "input_size": size, "resize_size": size, "crop_size": size,
                         "interpolation": "bilinear"}
    net.input_range = "normalized"
    return net.eval()
