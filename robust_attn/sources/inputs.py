"""The images a model is evaluated on: the dataset through the model's own preprocessing.

Datasets that decode image files (``imagenet``, ``imagefolder``: see
:func:`robust_attn.data.takes_transform`) resize and crop each image the way the model's weights
expect (:meth:`Preprocessing.eval_transform`; mean/std stay inside the model wrapper). Datasets
held as tensors (CIFAR, Fashion-MNIST, synthetic) keep their images as they are: a model with
its own preprocessing is then evaluated on those (a warning says so) and the run records
``preprocessing: None`` with the weights' own under ``weights_preprocessing``.

The subset of ``limit`` images depends only on the dataset's length, so models with different
preprocessing are evaluated on the same images.
"""
from __future__ import annotations

import sys

from robust_attn.sources.base import Preprocessing

__all__ = ["model_dataset", "record_preprocessing"]


def model_dataset(name: str, preprocessing, *, root=None, split: str = "test", limit: int | None = None):
    """``(dataset, applied)``: dataset ``name`` as the model of ``preprocessing`` (a
    :class:`Preprocessing`, its ``as_dict()`` or None) takes it, and the preprocessing applied
    (None: the dataset's own images)."""
    from robust_attn.data import build_dataset, takes_transform

    wanted = preprocessing if preprocessing is None or isinstance(preprocessing, Preprocessing) else \
        Preprocessing.from_dict(preprocessing)
    applied = wanted if wanted is not None and takes_transform(name) else None
    dataset = build_dataset(name, root=root, split=split, limit=limit,
                            transform=applied.eval_transform() if applied is not None else None)
    return dataset, applied


def record_preprocessing(description: dict, applied: Preprocessing | None) -> dict:
    """``description`` (a model's) with ``preprocessing`` set to what was applied; the weights'
    own, when not applied, under ``weights_preprocessing`` (with a warning on stderr)."""
    out = dict(description)
    own = out.get("preprocessing")
    out["preprocessing"] = applied.as_dict() if applied is not None else None
    if own is not None and applied is None:
        out["weights_preprocessing"] = own
        print(f"WARNING: {out.get('model', 'the model')} expects {own['crop_size']} px images resized from "
              f"{own['resize_size']} px; this dataset's images are tensors and are evaluated as they are",
              file=sys.stderr)
    return out
