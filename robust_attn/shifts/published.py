"""The precomputed corruption datasets of Hendrycks & Dietterich (ICLR 2019) in their published
layouts, as a source of corrupted images for the corruption protocol.

* CIFAR-10-C (``CIFAR-10-C.tar``): ``ROOT/<corruption>.npy``, uint8 (50000, 32, 32, 3): the
  10,000 CIFAR-10 test images, in test-set order, at severity 1, then 2, ... 5; and
  ``ROOT/labels.npy``, the 50,000 labels (the test labels five times). RobustBench's
  ``load_cifar10c`` reads the same files the same way.
* ImageNet-C: ``ROOT/<corruption>/<severity>/<wnid>/<file>.JPEG``, 224 x 224 images (the centre
  crops of the validation images), one folder per class; the sorted wnids are the class
  indices, as for the validation set (:mod:`robust_attn.data.imagenet`), and the sorted file
  names give the validation set's order.

Both give uint8 (N, H, W, 3) arrays for positions of the clean test set
(:meth:`PublishedCorruptions.__call__`), so a run evaluates the same images clean and corrupted;
the labels of every batch are checked against the clean set's (a copy in another order is an
error, never a silent mismatch).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from robust_attn.shifts.corruptions import check_corruption, check_severity

__all__ = ["CifarC", "ImageNetC", "PublishedCorruptions", "published_reader"]

CIFAR_C_PER_SEVERITY = 10000


class CifarC:
    """CIFAR-10-C (or CIFAR-100-C, same layout) under ``root``."""

    layout = "ROOT/<corruption>.npy (50000 x 32 x 32 x 3 uint8, severities 1-5 in blocks of 10000) and ROOT/labels.npy"

    def __init__(self, root, per_severity: int = CIFAR_C_PER_SEVERITY):
        self.root, self.per_severity = Path(root), per_severity
        self._arrays: dict[str, np.ndarray] = {}

    def _load(self, stem: str) -> np.ndarray:
        if stem not in self._arrays:
            path = self.root / f"{stem}.npy"
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found: a CIFAR-10-C folder holds {self.layout}")
            array = np.load(path, mmap_mode="r")
            if len(array) != 5 * self.per_severity:
                raise ValueError(f"{path} holds {len(array)} items; CIFAR-10-C files hold 5 severities x "
                                 f"{self.per_severity} = {5 * self.per_severity}")
            self._arrays[stem] = array
        return self._arrays[stem]

    def images(self, name: str, severity: int, indices: Sequence[int]) -> np.ndarray:
        array = self._load(check_corruption(name))
        if array.ndim != 4 or array.shape[-1] != 3 or array.dtype != np.uint8:
            raise ValueError(f"{self.root / name}.npy is {array.dtype} {array.shape}, not uint8 (N, H, W, 3)")
        offset = (check_severity(severity) - 1) * self.per_severity
        return np.asarray(array[offset + np.asarray(indices, dtype=np.int64)])

    def labels(self, name: str, severity: int, indices: Sequence[int]) -> np.ndarray:
        offset = (check_severity(severity) - 1) * self.per_severity
        return np.asarray(self._load("labels")[offset + np.asarray(indices, dtype=np.int64)]).astype(np.int64)


class ImageNetC:
    """ImageNet-C under ``root``: ``<corruption>/<severity>/<wnid>/*``."""

    layout = "ROOT/<corruption>/<severity>/<wnid>/<image>.JPEG"
    extensions = (".jpeg", ".jpg", ".png")

    def __init__(self, root):
        self.root = Path(root)
        self._files: dict[tuple[str, int], list[tuple[Path, int]]] = {}

    def files(self, name: str, severity: int) -> list[tuple[Path, int]]:
        """(path, class index) of every image of one corruption and severity, in the validation
        set's order (sorted wnid, then sorted file name)."""
        key = (check_corruption(name), check_severity(severity))
        if key not in self._files:
            folder = self.root / key[0] / str(key[1])
            if not folder.is_dir():
                raise FileNotFoundError(f"{folder} not found: an ImageNet-C folder holds {self.layout}")
            wnids = sorted(p.name for p in folder.iterdir() if p.is_dir())
            self._files[key] = [(f, label) for label, wnid in enumerate(wnids)
                                for f in sorted((folder / wnid).iterdir()) if f.suffix.lower() in self.extensions]
        return self._files[key]

    def images(self, name: str, severity: int, indices: Sequence[int]) -> np.ndarray:
        from PIL import Image

        files = self.files(name, severity)
        out = []
        for i in indices:
            with Image.open(files[int(i)][0]) as im:
                out.append(np.asarray(im.convert("RGB")))
        return np.stack(out)

    def labels(self, name: str, severity: int, indices: Sequence[int]) -> np.ndarray:
        files = self.files(name, severity)
        return np.asarray([files[int(i)][1] for i in indices], dtype=np.int64)


def published_reader(dataset: str, root):
    """The reader of the published corrupted copy of ``dataset`` (cifar10/cifar100 or imagenet)."""
    if dataset in ("cifar10", "cifar100"):
        return CifarC(root)
    if dataset == "imagenet":
        return ImageNetC(root)
    raise ValueError(f"no published corruption dataset for {dataset!r}: CIFAR-10-C / CIFAR-100-C (cifar10, cifar100) "
                     f"and ImageNet-C (imagenet) are read")


class PublishedCorruptions:
    """A corruption source over a published reader: position ``i`` of the evaluated set is item
    ``positions[i]`` of the published files (``positions``: the ``--limit`` subset of the full
    test set, or None for all of it)."""

    def __init__(self, reader, positions: Sequence[int] | None = None):
        self.reader = reader
        self.positions = None if positions is None else np.asarray(positions, dtype=np.int64)

    def __call__(self, name: str, severity: int, images: torch.Tensor, indices: torch.Tensor,
                 labels: torch.Tensor | None = None) -> np.ndarray:
        where = indices.numpy() if self.positions is None else self.positions[indices.numpy()]
        if labels is not None:
            published = self.reader.labels(name, severity, where)
            if not np.array_equal(published, labels.cpu().numpy()):
                raise ValueError(f"the published {name} severity {severity} images at positions {where[:5].tolist()}... "
                                 f"have labels {published[:5].tolist()}, the test set {labels[:5].tolist()}: the "
                                 f"published copy is not in the test set's order")
        out = self.reader.images(name, severity, where)
        if out.shape[1:3] != tuple(images.shape[2:]):
            raise ValueError(f"published {name} images are {out.shape[1]}x{out.shape[2]}, the test images "
                             f"{images.shape[2]}x{images.shape[3]}")
        return out
