"""SAN's validation split and deterministic subsets.

SAN (section 5.1) reports ImageNet results on the original validation set and selects
hyper-parameters on a split held out of the training set. The paper says no more; we hold out
``per_class`` images of every class (50, i.e. 50,000 images for ImageNet and 5,000 for
CIFAR-100), chosen by a generator with a fixed seed, so the split is the same everywhere.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["VAL_SEED", "holdout_split", "subset_indices"]

#: Seed of the held-out split; fixed so that every run and every machine agrees.
VAL_SEED = 20200614


def holdout_split(labels: Sequence[int], per_class: int, seed: int = VAL_SEED) -> tuple[list[int], list[int]]:
    """``(train_indices, val_indices)``: ``per_class`` indices of every class go to val, the rest
    to train; both sorted. A class with ``per_class`` images or fewer is an error (nothing would
    be left to train on)."""
    labels_t = torch.as_tensor(list(labels), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    val: list[int] = []
    for cls in torch.unique(labels_t).tolist():
        members = torch.nonzero(labels_t == cls).flatten()
        if len(members) <= per_class:
            raise ValueError(f"class {cls} has {len(members)} training images; cannot hold out {per_class}")
        pick = members[torch.randperm(len(members), generator=gen)[:per_class]]
        val.extend(pick.tolist())
    val_set = set(val)
    train = [i for i in range(len(labels_t)) if i not in val_set]
    return train, sorted(val)


def subset_indices(n: int, limit: int | None, seed: int = 0) -> list[int] | None:
    """``limit`` indices out of ``n`` drawn without replacement by a fixed-seed generator, sorted
    (so a limited class-sorted set such as an ImageFolder still covers many classes);
    ``None`` when no subset is needed."""
    if limit is None or limit >= n:
        return None
    if limit < 1:
        raise ValueError(f"limit must be a positive number of images, got {limit}")
    gen = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(n, generator=gen)[:limit].tolist())
