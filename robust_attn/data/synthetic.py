"""A small deterministic, learnable dataset for tests: 10 classes of 32x32 colour patterns.

Every class has a smooth random colour pattern (a 4x4 RGB grid upsampled bilinearly to 32x32,
drawn from a fixed seed); an image is its class pattern shifted by up to 2 pixels plus Gaussian
noise, clamped to [0, 1]. A tiny CNN separates the classes within a few dozen steps. Built in
memory (no root); the same arguments always give the same bytes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from robust_attn.data.base import DatasetInfo, TensorImageDataset, register_dataset
from robust_attn.data.transforms import RandomCropFlip

NUM_CLASSES = 10
IMAGE_SIZE = 32
SIZES = {"train": 600, "test": 200}
SEED = 1234

INFO = DatasetInfo(name="synthetic", num_classes=NUM_CLASSES, image_size=IMAGE_SIZE, resolution="cifar",
                   mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), val_per_class=10,
                   how_to_get="It is generated in memory.")


def class_patterns(seed: int = SEED) -> torch.Tensor:
    """The (10, 3, 32, 32) noise-free class patterns, values in about [0.15, 0.85]."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.rand(NUM_CLASSES, 3, 4, 4, generator=gen)
    return 0.15 + 0.7 * F.interpolate(coarse, size=IMAGE_SIZE, mode="bilinear", align_corners=False)


def make_images(split: str, seed: int = SEED, noise: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images (N, 3, 32, 32) and balanced labels (N,) of ``split``."""
    n = SIZES[split]
    gen = torch.Generator().manual_seed(seed + (1 if split == "train" else 2))
    labels = torch.arange(n) % NUM_CLASSES
    labels = labels[torch.randperm(n, generator=gen)]
    patterns = class_patterns(seed)
    images = torch.empty(n, 3, IMAGE_SIZE, IMAGE_SIZE)
    shifts = torch.randint(-2, 3, (n, 2), generator=gen)
    for i in range(n):
        images[i] = torch.roll(patterns[labels[i]], shifts=tuple(shifts[i].tolist()), dims=(1, 2))
    images += noise * torch.randn(images.shape, generator=gen)
    return (images.clamp(0, 1) * 255).round().to(torch.uint8), labels


def build(root, split: str, augment: bool, download: bool = False, verify: bool = False) -> TensorImageDataset:
    images, labels = make_images(split)
    return TensorImageDataset(images, labels, RandomCropFlip(4) if augment else None)


def locate(root, split: str | None = None) -> None:
    return None


register_dataset(__name__)
