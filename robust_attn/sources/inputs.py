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

__all__ = ["model_dataset", "record_preprocessing", "same_preprocessing"]


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


def same_preprocessing(by_model: dict, why: str, fix: str) -> dict | None:
    """The one preprocessing (``as_dict()`` or None) of every model of ``by_model`` (name ->
    preprocessing); a ValueError naming each model's when they differ: ``why`` they must agree,
    and the ``fix``."""
    from robust_attn.reports.models import describe_preprocessing

    kinds = {name: (p.as_dict() if isinstance(p, Preprocessing) else p) or None for name, p in by_model.items()}
    if len({repr(sorted(p.items())) if p else None for p in kinds.values()}) > 1:
        raise ValueError(f"{why}, but these models take different preprocessing ("
                         + "; ".join(f"{n}: {describe_preprocessing(p)}" for n, p in kinds.items()) + f"); {fix}")
    return next(iter(kinds.values()), None)


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
