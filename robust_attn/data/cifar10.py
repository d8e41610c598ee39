"""CIFAR-10 (Krizhevsky 2009) from the canonical pickles or from an image-folder copy.

Two forms of the same 60,000 images, which are *not* the same pixels:

* ``cifar10``: the canonical "python version" pickles, ``ROOT/cifar-10-batches-py/{data_batch_1..5,
  test_batch,batches.meta}`` (what torchvision's ``CIFAR10`` downloads); ``verify=True`` checks the
  canonical md5s.
* ``cifar10-jpeg``: an image folder, ``ROOT/cifar10-jpeg/{train,test}/<class>/*.jpg`` (or
  ``ROOT/cifar10/...`` or ``ROOT/{train,test}/...``), one folder per class whose sorted order is the
  canonical label order (airplane ... truck), files read in sorted path order; e.g. the quality-75
  JPEG copy of the project's shared data. JPEG softens colour edges, so accuracies differ a little.

The dataset built carries ``variant`` ("cifar10" or "cifar10-jpeg") and ``source`` (the folder or
file it was read from); runs record both.

Where it is looked for: an explicit ``root`` is searched alone (pickles first, then the folder
layouts), and a root holding neither is an error. Without one, the default data root
(``$ROBUST_ATTN_DATA`` or ``./data``) is searched the same way, and the test split falls back to the
test set embedded in the package (:mod:`robust_attn.data.embedded`: the 10,000 CIFAR-10-JPEG test
images, byte for byte), with a line saying so.

Mean/std: the usual per-channel statistics of the canonical CIFAR-10 training images.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from robust_attn.data import embedded
from robust_attn.data.base import (DatasetInfo, TensorImageDataset, default_data_root, missing_dataset_error,
                                   register_dataset)
from robust_attn.data.pickles import load_pickle
from robust_attn.data.transforms import RandomCropFlip

__all__ = ["INFO", "CLASSES", "MD5", "read_batch", "read_folder", "decode_jpegs", "locate", "build"]

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
PICKLE_FOLDER = "cifar-10-batches-py"
FOLDER_NAMES = ("cifar10-jpeg", "cifar10")
BATCHES = {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}
#: Canonical md5s, as in torchvision's ``CIFAR10`` class.
MD5 = {"data_batch_1": "c99cafc152244af753f735de768cd75f", "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
       "data_batch_3": "54ebc095f3ab1f0389bbae665268c751", "data_batch_4": "634d18415352ddfa80567beed471001a",
       "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb", "test_batch": "40351d587109b95175f43aff81a1287e",
       "batches.meta": "5ff9c542aee3614f3951f8cda6e48888"}
SIZES = {"train": 50000, "test": 10000}

INFO = DatasetInfo(name="cifar10", num_classes=10, image_size=32, resolution="cifar",
                   mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616),
                   how_to_get="Get the canonical pickles with build_dataset('cifar10', root, download=True) "
                              "(torchvision downloads cifar-10-python.tar.gz) or unpack that archive into ROOT; "
                              "or put an image-folder copy at ROOT/cifar10-jpeg/{train,test}/<class>/*.jpg "
                              "(e.g. tar -xzf cifar10-jpeg.tar.gz -C ROOT/cifar10-jpeg).")


def read_batch(path: str | Path, verify: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One pickle batch: images uint8 (N, 3, 32, 32) and labels int64 (N,)."""
    path = Path(path)
    obj = load_pickle(path, MD5.get(path.name) if verify else None)
    data = np.asarray(obj.get("data", ()), dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or "labels" not in obj or len(obj["labels"]) != len(data):
        raise ValueError(f"{path}: not a CIFAR-10 batch ('data' {data.shape}, 'labels' "
                         f"{len(obj.get('labels', ()))}); expected (N, 3072) images and N labels")
    return torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()), torch.tensor(obj["labels"], dtype=torch.long)


def decode_jpegs(blobs: list[bytes], what: str = "image") -> torch.Tensor:
    """Decode 32x32 RGB JPEG byte strings with Pillow into uint8 (N, 3, 32, 32)."""
    from PIL import Image

    out = np.empty((len(blobs), 32, 32, 3), dtype=np.uint8)
    for i, blob in enumerate(blobs):
        with Image.open(io.BytesIO(blob)) as image:
            array = np.asarray(image.convert("RGB"))
        if array.shape != (32, 32, 3):
            raise ValueError(f"{what} {i}: {array.shape[1]}x{array.shape[0]}, expected a 32x32 CIFAR-10 image")
        out[i] = array
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()


def read_folder(folder: str | Path) -> tuple[list[Path], torch.Tensor]:
    """The image files of a ``<class>/*`` folder in sorted order and their labels (hidden files such as
    ``.DS_Store`` skipped). The class folders must be exactly :data:`CLASSES`, each holding at least one
    file: a clear error naming what is missing and how to get the data otherwise (e.g. a partial copy,
    or a folder of another dataset)."""
    folder = Path(folder)
    found = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if tuple(found) != CLASSES:
        missing = [c for c in CLASSES if c not in found]
        extra = [c for c in found if c not in CLASSES]
        raise ValueError(f"{folder}: class folders {found} are not CIFAR-10's {list(CLASSES)} (missing {missing}, "
                         f"unexpected {extra}): an incomplete copy or another dataset. {INFO.how_to_get}")
    files, labels = [], []
    for label, name in enumerate(CLASSES):
        members = sorted(p for p in (folder / name).iterdir() if p.is_file() and not p.name.startswith("."))
        if not members:
            raise ValueError(f"{folder / name} holds no images: an incomplete copy. {INFO.how_to_get}")
        files += members
        labels += [label] * len(members)
    return files, torch.tensor(labels, dtype=torch.long)


def _pickle_folder(base: Path, split: str | None) -> Path | None:
    names = BATCHES[split] if split else BATCHES["train"] + BATCHES["test"]
    for folder in (base / PICKLE_FOLDER, base):
        if all((folder / n).is_file() for n in names):
            return folder
    return None


def _image_folder(base: Path, split: str | None) -> Path | None:
    splits = (split,) if split else ("train", "test")
    for folder in (*(base / n for n in FOLDER_NAMES), base):
        if all((folder / s).is_dir() and any((folder / s).iterdir()) for s in splits):
            return folder
    return None


def _searched(base: Path) -> list[Path]:
    return [base / PICKLE_FOLDER, *(base / n for n in FOLDER_NAMES), base]


def _incomplete(base: Path, split: str | None) -> list[str]:
    """What a started but incomplete copy under ``base`` lacks, for the error message."""
    names = BATCHES[split] if split else BATCHES["train"] + BATCHES["test"]
    notes = []
    for folder in (base / PICKLE_FOLDER, base):
        present = [n for n in names if (folder / n).is_file()]
        if present and len(present) < len(names):
            notes.append(f"{folder} holds {present} but lacks {[n for n in names if n not in present]}")
    splits = (split,) if split else ("train", "test")
    for folder in (*(base / n for n in FOLDER_NAMES), base):
        have = [s for s in ("train", "test") if (folder / s).is_dir() and any((folder / s).iterdir())]
        lacking = [s for s in splits if s not in have]
        if have and lacking:
            notes.append(f"{folder} holds {', '.join(h + '/' for h in have)} "
                         f"but no {', '.join(s + '/' for s in lacking)}")
    return notes


def locate(root: str | Path | None, split: str | None = None) -> Path:
    """Where ``split`` would be read from: a pickle folder, an image folder (holding train/ and test/),
    or, with no ``root`` and split "test", the embedded test set's file. FileNotFoundError naming
    every place searched, what a partial copy lacks, and how to get the data otherwise."""
    base = Path(root) if root is not None else default_data_root()
    found = _pickle_folder(base, split) or _image_folder(base, split)
    if found is not None:
        return found
    if root is None and split == "test":
        return embedded.path("cifar10_jpeg_test")
    notes = _incomplete(base, split)
    how = (f"Incomplete copy: {'; '.join(notes)}. " if notes else "") + INFO.how_to_get
    raise missing_dataset_error("cifar10", _searched(base), how)


def build(root, split: str, augment: bool, download: bool = False, verify: bool = False) -> TensorImageDataset:
    """The 50,000 training or 10,000 test images (``split`` "train" or "test")."""
    if download:
        from torchvision.datasets import CIFAR10

        CIFAR10(str(Path(root) if root is not None else default_data_root()), train=(split == "train"),
                download=True)
    found = locate(root, split)
    if found.suffix == ".npz":
        blobs, labels = embedded.read_jpeg_set("cifar10_jpeg_test")
        images, variant = decode_jpegs(blobs, what=f"{found} image"), "cifar10-jpeg"
    elif all((found / n).is_file() for n in BATCHES[split]):
        parts = [read_batch(found / n, verify=verify) for n in BATCHES[split]]
        images, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        variant = "cifar10"
    else:
        files, labels = read_folder(found / split)
        images, variant = decode_jpegs([f.read_bytes() for f in files], what=str(found / split)), "cifar10-jpeg"
    dataset = TensorImageDataset(images, labels, RandomCropFlip(4) if augment else None)
    dataset.variant, dataset.source = variant, str(found)
    return dataset


register_dataset(__name__)
