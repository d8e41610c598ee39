"""Fashion-MNIST (Xiao et al. 2017) from IDX files, at CIFAR resolution.

Looked for, in order: ``ROOT/FashionMNIST/raw`` (torchvision's layout, plain IDX), ``ROOT/fashion-mnist``
and ``ROOT`` itself. Only when no root is given: the default root (``$ROBUST_ATTN_DATA`` or ``./data``),
``/usr/share/datasets/fashion-mnist`` (the Debian package ``dataset-fashion-mnist``, gzipped IDX) and,
for the test split, the 10,000 test images embedded in the package. Each file may be plain or ``.gz``.
An explicit root without the files is an error, never a silent fallback.

Each 28x28 gray image is zero-padded by 2 pixels to 32x32 and repeated to 3 channels, so the
CIFAR-resolution models take it unchanged.

Mean/std: computed once over the 60,000 padded 32x32 training images (pixels in [0, 1]):
mean 0.2190, std 0.3318 (before padding, 28x28: mean 0.2860, std 0.3530).
"""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from robust_attn.data import embedded
from robust_attn.data.base import (DatasetInfo, TensorImageDataset, default_data_root, missing_dataset_error,
                                   register_dataset)
from robust_attn.data.transforms import RandomCropFlip

__all__ = ["INFO", "read_idx", "locate", "build", "KNOWN_LOCATIONS"]

KNOWN_LOCATIONS = [Path("/usr/share/datasets/fashion-mnist")]
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
SIZES = {"train": 60000, "test": 10000}

INFO = DatasetInfo(name="fashion_mnist", num_classes=10, image_size=32, resolution="cifar",
                   mean=(0.2190, 0.2190, 0.2190), std=(0.3318, 0.3318, 0.3318),
                   how_to_get="Install the Debian package dataset-fashion-mnist (apt-get install "
                              "dataset-fashion-mnist), or get it with build_dataset('fashion_mnist', root, "
                              "download=True) (torchvision's FashionMNIST).")

_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (LeCun's MNIST format), plain or gzipped (detected by its magic bytes)."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic {raw[:4].hex()})")
    dtype, ndim = np.dtype(_IDX_TYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(f"{path}: {len(raw)} bytes, but its header {shape} implies {expected}: truncated or corrupt")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


def _find(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _candidates(root: Path) -> list[Path]:
    return [root / "FashionMNIST" / "raw", root / "fashion-mnist", root]


def locate(root: str | Path | None, split: str | None = None) -> Path:
    """The first folder holding the IDX files of ``split`` (all four when None); FileNotFoundError
    naming every folder searched.

    An explicit ``root`` is searched alone (its layouts above); without one, the default root, then
    the Debian package's folder, then (test split only) the copy embedded in the package
    (:mod:`robust_attn.data.embedded`)."""
    explicit = root is not None
    base = Path(root) if explicit else default_data_root()
    stems = FILES[split] if split else [stem for pair in FILES.values() for stem in pair]
    searched = _candidates(base) if explicit else [*_candidates(base), *KNOWN_LOCATIONS]
    for folder in searched:
        if all(_find(folder, stem) for stem in stems):
            return folder
    if not explicit and split == "test":
        return embedded.path("fashion_mnist_test")
    raise missing_dataset_error("fashion_mnist", searched, INFO.how_to_get)


def to_cifar_resolution(images: np.ndarray) -> torch.Tensor:
    """(N, 28, 28) uint8 -> (N, 3, 32, 32) uint8: zero-pad 2 pixels on each side, repeat gray to RGB."""
    t = torch.from_numpy(np.array(images, dtype=np.uint8)).unsqueeze(1)
    return F.pad(t, (2, 2, 2, 2)).repeat(1, 3, 1, 1)


def build(root, split: str, augment: bool, download: bool = False, verify: bool = False) -> TensorImageDataset:
    if download:
        from torchvision.datasets import FashionMNIST

        FashionMNIST(str(Path(root) if root is not None else default_data_root()), train=(split == "train"),
                     download=True)
    folder = locate(root, split)
    images = read_idx(_find(folder, FILES[split][0]))
    labels = read_idx(_find(folder, FILES[split][1]))
    if images.shape[1:] != (28, 28) or len(images) != len(labels):
        raise ValueError(f"{folder}: unexpected Fashion-MNIST shapes {images.shape} / {labels.shape}")
    dataset = TensorImageDataset(to_cifar_resolution(images), torch.from_numpy(labels.astype(np.int64)),
                                 RandomCropFlip(4) if augment else None)
    dataset.variant, dataset.source = "fashion_mnist", str(folder)
    return dataset


register_dataset(__name__)
