"""Datasets: CIFAR-10, CIFAR-100, ImageNet (val-original), Fashion-MNIST, a synthetic test set and
a user's own image folder (``imagefolder``: one folder per class; needs ``root``). Each is one
module of this package (:class:`robust_attn.data.base.DatasetModule`) that registers itself, so a
new dataset is one new file here.

    >>> from robust_attn.data import dataset_info, build_dataset
    >>> info = dataset_info("cifar100")            # num_classes, image_size, resolution, mean, std
    >>> test = build_dataset("cifar100", root="data", split="test", limit=1000)
    >>> image, label = test[0]                      # float32 (3, 32, 32) in [0, 1], int

Items are ``(image, label)``: a float32 tensor (3, H, W) in [0, 1] and an int. Nothing is
normalized here: the model wrapper (:class:`robust_attn.models.wrapper.NormalizedModel`) normalizes with
``info.mean`` / ``info.std``, so attacks work in [0, 1] pixel space.

Splits:

* ``"test"``: the published test set (ImageNet: the original validation set).
* ``"val"``: SAN's held-out validation split, ``info.val_per_class`` images of every class taken
  out of the training set by a fixed-seed draw (:func:`robust_attn.data.splits.holdout_split`);
  never augmented.
* ``"train"``: the whole training set by default (what the papers train on). With
  ``holdout=True`` the "val" images are excluded, so train and val are disjoint; a recipe asks
  for it with ``data.holdout = true``.

``transform`` (imagenet, imagefolder: the datasets that decode image files) replaces the
default evaluation transform by a model's own (a torchvision transform from a PIL image to a
float tensor in [0, 1], e.g. :meth:`robust_attn.sources.base.Preprocessing.eval_transform`);
:func:`takes_transform` says which datasets accept one.

``limit`` keeps a fixed-seed random subset of that many images (sorted, so class-sorted sets
such as ImageFolder stay spread over the classes). A missing dataset raises
``FileNotFoundError`` that names every folder searched and how to get the data.
"""
from __future__ import annotations

import sys
from pathlib import Path

from torch.utils.data import Dataset, Subset

from robust_attn.data.base import DATA_ENV, DATASETS, DatasetInfo, TensorImageDataset, default_data_root
from robust_attn.data.splits import holdout_split, subset_indices
from robust_attn.data.transforms import SeededAugment

__all__ = ["DatasetInfo", "dataset_info", "build_dataset", "locate_dataset", "list_datasets", "subset_dataset",
           "SeededAugment", "TensorImageDataset", "default_data_root", "DATA_ENV", "takes_transform"]

SPLITS = ("train", "val", "test")


def _module(name: str):
    return DATASETS.get(name)


def list_datasets() -> list[str]:
    return DATASETS.names()


def dataset_info(name: str, root: str | Path | None = None) -> DatasetInfo:
    """Classes, image size, model resolution and normalization statistics of dataset ``name``.

    ``root`` matters only where the class count comes from the data (``imagefolder``: its class
    folders are counted, and ``root`` is required)."""
    module = _module(name)
    return module.info(root) if hasattr(module, "info") else module.INFO


def takes_transform(name: str) -> bool:
    """Whether dataset ``name`` decodes image files, so ``build_dataset(..., transform=)`` can apply
    a model's own preprocessing."""
    return bool(getattr(_module(name), "TAKES_TRANSFORM", False))


def locate_dataset(name: str, root: str | Path | None = None, split: str | None = None) -> Path | None:
    """The folder the data of ``name`` (its ``split`` "train"/"test", or all when None) would be
    read from (``None`` for generated data); ``FileNotFoundError`` naming the folders searched and
    how to get the data if it is absent. Cheap: nothing is decoded."""
    if split == "val":
        split = "train"
    return _module(name).locate(root, split)


def _labels(dataset: Dataset) -> list[int]:
    targets = getattr(dataset, "targets", None)
    if targets is None:
        raise TypeError(f"{type(dataset).__name__} has no targets; cannot draw a per-class split")
    return list(targets)


def build_dataset(name: str, root: str | Path | None = None, split: str = "test", augment: bool = False,
                  limit: int | None = None, *, holdout: bool = False, download: bool = False,
                  verify: bool = False, transform=None) -> Dataset:
    """Dataset ``name``'s ``split`` ("train", "val" or "test"); see the module docstring.

    ``augment`` applies the dataset's training augmentation to "train" ("val" is never
    augmented; "test" is augmented only if asked). ``root`` defaults to ``$ROBUST_ATTN_DATA`` or ``./data``.
    ``download=True`` lets torchvision fetch CIFAR-100 / Fashion-MNIST where the network allows;
    ``verify=True`` checks canonical checksums where the dataset has them (CIFAR-100 md5s).
    ``transform``: a model's eval transform replacing the default one (see the module docstring);
    an error for datasets that hold tensors and with augmentation.
    """
    module = _module(name)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    augment = augment and split != "val"
    kwargs = {}
    if transform is not None:
        if not takes_transform(name):
            decoding = [n for n in DATASETS.names() if takes_transform(n)]
            raise ValueError(f"dataset {name!r} holds its images as tensors and takes no model transform "
                             f"(only {', '.join(decoding)} do); evaluate without one")
        if augment:
            raise ValueError("a model's eval transform replaces the evaluation preprocessing; it cannot be combined "
                             "with augment=True")
        kwargs["transform"] = transform
    if split == "test":
        dataset = module.build(root, "test", augment, download=download, verify=verify, **kwargs)
    else:
        dataset = module.build(root, "train", augment, download=download, verify=verify, **kwargs)
        if split == "val" or holdout:
            train_idx, val_idx = holdout_split(_labels(dataset), module.INFO.val_per_class)
            dataset = subset_dataset(dataset, val_idx if split == "val" else train_idx)
    if root is None and getattr(dataset, "source", None):
        print(f"data: {name} {split} read from {dataset.source} (default location; pass root / --root to choose)",
              file=sys.stderr)
    keep = subset_indices(len(dataset), limit)
    return dataset if keep is None else subset_dataset(dataset, keep)


#: attributes a subset keeps: where the images came from and what the labels index
_CARRIED = ("variant", "source", "num_classes", "classes", "class_to_idx")


def subset_dataset(dataset: Dataset, indices: list[int]) -> Dataset:
    """The images ``indices`` of ``dataset``, in that order: a ``Subset`` that keeps ``targets`` (so a
    subset can be split or sampled per class again) and where the images came from."""
    if isinstance(dataset, TensorImageDataset):
        subset = TensorImageDataset(dataset.images[indices], dataset.labels[indices], dataset.transform)
        for key in _CARRIED:  # where the images came from (see e.g. robust_attn.data.cifar10)
            if hasattr(dataset, key):
                setattr(subset, key, getattr(dataset, key))
        return subset
    subset = Subset(dataset, indices)
    targets = _labels(dataset)
    subset.targets = [targets[i] for i in indices]
    for key in _CARRIED:
        if hasattr(dataset, key):
            setattr(subset, key, getattr(dataset, key))
    return subset
