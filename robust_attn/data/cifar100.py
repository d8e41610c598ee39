"""CIFAR-100 (Krizhevsky 2009) from the canonical "python version" pickles.

Layout: ``ROOT/cifar-100-python/{train,test,meta}`` as in ``cifar-100-python.tar.gz`` (what
torchvision's ``CIFAR100`` downloads). The pickles are read with a restricted unpickler
(:mod:`robust_attn.data.pickles`), so reading a tampered file cannot run code. ``verify=True`` checks the canonical md5s first.

Where it is looked for: an explicit ``root`` is searched alone (``ROOT/cifar-100-python``, then ``ROOT``)
and a root without the pickles is an error; without one, the default data root (``$ROBUST_ATTN_DATA``
or ``./data``) is searched the same way. Nothing is embedded and there is no other fallback. The
dataset built carries ``variant`` ("cifar100") and ``source`` (the folder read).

Mean/std: the usual per-channel statistics of the CIFAR-100 training images.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from robust_attn.data.pickles import load_pickle, text_list
from robust_attn.data.base import (DatasetInfo, TensorImageDataset, default_data_root, missing_dataset_error,
                                   register_dataset)
from robust_attn.data.transforms import RandomCropFlip

__all__ = ["INFO", "MD5", "read_batch", "read_meta", "locate", "build"]

FOLDER = "cifar-100-python"
#: Canonical md5s, as in torchvision's ``CIFAR100`` class.
MD5 = {"train": "16019d7e3df5f24257cddd939b257f8d", "test": "f0ef6b0ae62326f3e7ffdfab6717acfc",
       "meta": "7973b15100ade9c7d40fb424638fde48"}
SIZES = {"train": 50000, "test": 10000}

INFO = DatasetInfo(name="cifar100", num_classes=100, image_size=32, resolution="cifar",
                   mean=(0.5071, 0.4865, 0.4409), std=(0.2673, 0.2564, 0.2762),
                   how_to_get="Get it with build_dataset('cifar100', root, download=True) (torchvision downloads "
                              "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz) or unpack that archive "
                              "into ROOT.")


def _load(path: Path, verify: bool, name: str) -> dict:
    return load_pickle(path, MD5[name] if verify else None)


def read_batch(path: str | Path, verify: bool = False, name: str | None = None) -> dict:
    """Decode a ``train`` or ``test`` pickle: ``images`` uint8 (N, 3, 32, 32), ``fine_labels`` and
    ``coarse_labels`` int64 (N,), ``filenames`` list of str."""
    path = Path(path)
    obj = _load(path, verify, name or path.name)
    data = np.asarray(obj["data"], dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{path}: 'data' has shape {data.shape}, expected (N, 3072)")
    return {"images": torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()),
            "fine_labels": torch.tensor(obj["fine_labels"], dtype=torch.long),
            "coarse_labels": torch.tensor(obj["coarse_labels"], dtype=torch.long),
            "filenames": text_list(obj["filenames"])}


def read_meta(path: str | Path, verify: bool = False) -> dict:
    """``fine_label_names`` (100) and ``coarse_label_names`` (20) from the ``meta`` pickle."""
    obj = _load(Path(path), verify, "meta")
    return {"fine_label_names": text_list(obj["fine_label_names"]),
            "coarse_label_names": text_list(obj["coarse_label_names"])}


def _candidates(root: Path) -> list[Path]:
    return [root / FOLDER, root]


def locate(root: str | Path | None, split: str | None = None) -> Path:
    """The ``cifar-100-python`` folder under ``root`` (or ``root`` itself) holding ``split``'s
    pickle (both when ``split`` is None); FileNotFoundError naming what was searched if absent."""
    root = Path(root) if root is not None else default_data_root()
    names = (split,) if split else ("train", "test")
    for folder in _candidates(root):
        if all((folder / name).is_file() for name in names):
            return folder
    pattern = names[0] if len(names) == 1 else "{" + ",".join(names) + "}"
    raise missing_dataset_error("cifar100", [c / pattern for c in _candidates(root)], INFO.how_to_get)


def build(root, split: str, augment: bool, download: bool = False, verify: bool = False) -> TensorImageDataset:
    """The 50,000 training or 10,000 test images with fine labels (``split`` is "train" or "test")."""
    root = Path(root) if root is not None else default_data_root()
    if download:
        from torchvision.datasets import CIFAR100

        CIFAR100(str(root), train=(split == "train"), download=True)
    folder = locate(root, split)
    batch = read_batch(folder / split, verify=verify, name=split)
    dataset = TensorImageDataset(batch["images"], batch["fine_labels"], RandomCropFlip(4) if augment else None)
    dataset.variant, dataset.source = "cifar100", str(folder)
    return dataset


register_dataset(__name__)
