"""A user's own images, one folder per class: ``--dataset imagefolder --root DIR``.

Layouts (``DIR`` must be given; there is no default location):

* ``DIR/<class>/*.jpg``: the whole folder is the test split;
* ``DIR/{train,test}/<class>/*`` (``val/`` is accepted for ``test`` where there is no ``test/``):
  one folder per split.

Classes are the sorted folder names; with split folders, the sorted union of the classes of
every split folder, so a class missing from one split does not shift the labels of the others.
The number of classes is only known from the folder: :func:`info` (``dataset_info("imagefolder",
root=DIR)``) counts them, and the built dataset carries ``num_classes`` and ``classes``.

Preprocessing chosen (the images can be any size): evaluation resizes the short side to 256
and keeps the central 224x224 crop (the ImageNet single-crop protocol, SAN section 5.1);
training takes a random-resized crop to 224 with a horizontal flip. A model's own eval transform
(``build_dataset(..., transform=...)``, e.g. a timm/torchvision model's preprocessing) replaces
the evaluation default. ``mean``/``std`` default to ImageNet's (what a model pre-trained on
ImageNet normalizes with).

:class:`ImageListDataset` and the folder helpers here are shared with
:mod:`robust_attn.data.imagenet`.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence

from torch.utils.data import Dataset

from robust_attn.data.base import DatasetInfo, register_dataset
from robust_attn.data.transforms import imagenet_eval_transform, imagenet_train_transform

__all__ = ["INFO", "IMAGE_EXTENSIONS", "ImageListDataset", "info", "locate", "build", "list_images",
           "class_folders", "TAKES_TRANSFORM"]

#: file name endings read as images (lower case; torchvision's ImageFolder list)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
#: a model's eval transform can replace the default (see ``build_dataset(..., transform=)``)
TAKES_TRANSFORM = True
SPLIT_FOLDERS = {"train": ("train",), "test": ("test", "val")}

INFO = DatasetInfo(name="imagefolder", num_classes=0, image_size=224, resolution="imagenet",
                   mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), val_per_class=5,
                   how_to_get="Pass --root DIR (root=...) naming a folder with one sub-folder of images per "
                              "class (DIR/<class>/*.jpg), or DIR/train/<class>/ and DIR/test/<class>/.")


class ImageListDataset(Dataset):
    """Image files with their labels: items ``(transform(PIL RGB image), int label)``.

    ``samples`` are ``(path, label)`` pairs; ``classes`` the class names the labels index
    (``num_classes`` of them unless given); ``targets`` the labels (what per-class splits read)."""

    def __init__(self, samples: Sequence[tuple[str, int]], transform: Callable | None, classes: Sequence[str],
                 num_classes: int | None = None):
        self.samples = [(str(p), int(y)) for p, y in samples]
        self.targets = [y for _, y in self.samples]
        self.transform = transform
        self.classes = list(classes)
        self.num_classes = int(num_classes if num_classes is not None else len(self.classes))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        from PIL import Image

        path, label = self.samples[index]
        with open(path, "rb") as f:
            image = Image.open(f).convert("RGB")
        if self.transform is not None:
            image = self.transform(image)
        return image, label


def list_images(folder: Path) -> list[Path]:
    """The image files directly in ``folder``, sorted by name (hidden files left out)."""
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS)


def class_folders(folder: Path) -> list[str]:
    """The sorted names of the sub-folders of ``folder`` (hidden ones left out)."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _root(root) -> Path:
    if root is None:
        raise ValueError("dataset 'imagefolder' reads your own folder and has no default location: "
                         + INFO.how_to_get)
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"dataset 'imagefolder': {root} is not a folder. " + INFO.how_to_get)
    return root


def _split_folders(root: Path) -> dict[str, Path]:
    """``{"train": DIR/train, "test": DIR/test or DIR/val}`` for the split layout, {} otherwise."""
    found = {}
    for split, names in SPLIT_FOLDERS.items():
        for name in names:
            if (root / name).is_dir():
                found[split] = root / name
                break
    return found


def locate(root, split: str | None = None) -> Path:
    """The folder holding the class folders of ``split`` ("train", "test" or None: test)."""
    root = _root(root)
    splits = _split_folders(root)
    split = split or "test"
    if splits:
        if split not in splits:
            names = " or ".join(f"{root / n}" for n in SPLIT_FOLDERS[split])
            present = ", ".join(sorted(p.name for p in splits.values()))
            raise FileNotFoundError(f"dataset 'imagefolder': {root} has split folders ({present}) but no {names} "
                                    f"for split {split!r}")
        return splits[split]
    if split != "test":
        raise FileNotFoundError(f"dataset 'imagefolder': {root} holds the class folders of one split, read as "
                                f"'test'; for {split!r} arrange {root}/train/<class>/ and {root}/test/<class>/")
    return root


def _classes(root: Path) -> list[str]:
    splits = _split_folders(root)
    folders = list(splits.values()) or [root]
    classes = sorted(set().union(*(class_folders(f) for f in folders)))
    if not classes:
        raise FileNotFoundError(f"dataset 'imagefolder': no class folders in {', '.join(map(str, folders))}. "
                                + INFO.how_to_get)
    return classes


def info(root=None) -> DatasetInfo:
    """:data:`INFO` with ``num_classes`` counted from the class folders under ``root``."""
    return dataclasses.replace(INFO, num_classes=len(_classes(_root(root))))


def build(root, split: str, augment: bool, download: bool = False, verify: bool = False,
          transform: Callable | None = None) -> ImageListDataset:
    if download:
        raise ValueError("dataset 'imagefolder' is your own folder and cannot be downloaded: " + INFO.how_to_get)
    base = _root(root)
    folder = locate(base, split)
    classes = _classes(base)
    samples = []
    for index, name in enumerate(classes):
        if not (folder / name).is_dir():
            continue  # a class of another split only: its index is kept, nothing to read here
        images = list_images(folder / name)
        if not images:
            raise FileNotFoundError(f"dataset 'imagefolder': class folder {folder / name} holds no images "
                                    f"({', '.join(IMAGE_EXTENSIONS)}); add images or remove the folder")
        samples += [(p, index) for p in images]
    if transform is None:
        transform = imagenet_train_transform(INFO.image_size) if augment else imagenet_eval_transform(INFO.image_size)
    dataset = ImageListDataset(samples, transform, classes)
    dataset.variant, dataset.source = "imagefolder", str(folder)
    return dataset


register_dataset(__name__)
