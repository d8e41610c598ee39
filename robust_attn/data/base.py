"""Shared pieces of the dataset readers: :class:`DatasetInfo`, the shape of a dataset module
(:class:`DatasetModule`) and their registry, the in-memory uint8 dataset, where data is looked for,
and the error raised when it is not there."""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch
from torch.utils.data import Dataset

from robust_attn.utils.plugins import Registry

__all__ = ["DatasetInfo", "DatasetModule", "DATASETS", "register_dataset", "TensorImageDataset", "default_data_root",
           "missing_dataset_error", "DATA_ENV"]

#: Environment variable naming the default data root (torchvision's ``root`` convention:
#: each dataset lives in its own sub-folder, e.g. ``ROOT/cifar-100-python``).
DATA_ENV = "ROBUST_ATTN_DATA"


@dataclass(frozen=True)
class DatasetInfo:
    """What a model and a trainer need to know about a dataset besides its images.

    ``mean``/``std`` are per-channel statistics of the images in [0, 1] as the model sees them
    (the :class:`~robust_attn.models.wrapper.NormalizedModel` normalizes with them); ``resolution`` is the
    name in :data:`robust_attn.models.resolution.RESOLUTIONS` whose models take ``image_size`` inputs.

    ``logit_subset``: for a test set of some of the classes of a larger one (ImageNet-A and
    ImageNet-R: 200 of ImageNet's 1,000), the index of each of its classes, in label order, among
    the ``model_classes`` outputs of the models it evaluates; a model is then built and checked for
    ``model_classes`` outputs and evaluated on these logits only (:meth:`for_models`,
    :class:`robust_attn.models.wrapper.ClassSubset`), as the sets' authors evaluate.
    """

    name: str
    num_classes: int
    image_size: int
    resolution: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    splits: tuple[str, ...] = ("train", "val", "test")
    val_per_class: int = 50
    how_to_get: str = ""
    logit_subset: tuple[int, ...] = ()
    model_classes: int = 0

    def __post_init__(self):
        if self.logit_subset and (len(self.logit_subset) != self.num_classes
                                  or not all(0 <= i < self.model_classes for i in self.logit_subset)):
            raise ValueError(f"dataset {self.name!r}: logit_subset must name each of its {self.num_classes} classes "
                             f"among the models' {self.model_classes} outputs")

    def for_models(self) -> "DatasetInfo":
        """The info a model is built and checked with: ``model_classes`` outputs where the
        dataset's classes are a subset of them (``logit_subset``), else this info."""
        if not self.logit_subset:
            return self
        return dataclasses.replace(self, num_classes=self.model_classes, logit_subset=(), model_classes=0)


@runtime_checkable
class DatasetModule(Protocol):
    """What a dataset module of :mod:`robust_attn.data` holds (one module per dataset).

    ``INFO``: its :class:`DatasetInfo` (``INFO.name`` is the dataset's name);
    ``build(root, split, augment, download=False, verify=False[, transform=None])``: the
    ``"train"`` or ``"test"`` split as a ``Dataset`` of ``(float (3, H, W) in [0, 1], int)``;
    ``locate(root, split=None)``: the folder it reads (``None`` for generated data), or
    ``FileNotFoundError`` naming the folders searched and how to get the data. Optional:
    ``info(root) -> DatasetInfo`` where the classes come from the data, and
    ``TAKES_TRANSFORM = True`` where ``build`` decodes image files and takes a model's transform.
    The module ends with ``register_dataset(__name__)``."""

    INFO: DatasetInfo

    def build(self, root, split: str, augment: bool, download: bool = False, verify: bool = False,
              **kwargs) -> Dataset: ...

    def locate(self, root, split: str | None = None) -> Path | None: ...


#: every dataset module by name, from the modules of :mod:`robust_attn.data`
DATASETS: Registry[DatasetModule] = Registry("dataset", package="robust_attn.data", error=ValueError)


def register_dataset(module_name: str) -> None:
    """Register the module ``module_name`` (a :class:`DatasetModule`) under ``INFO.name``."""
    module = sys.modules[module_name]
    if not isinstance(module, DatasetModule):
        raise TypeError(f"dataset module {module_name} needs INFO, build(root, split, augment, ...) and "
                        f"locate(root, split) (robust_attn.data.base.DatasetModule)")
    DATASETS.register(module.INFO.name, module)


def default_data_root() -> Path:
    """``$ROBUST_ATTN_DATA`` if set, else ``./data`` (relative to the working directory)."""
    return Path(os.environ.get(DATA_ENV, "data")).expanduser()


def missing_dataset_error(name: str, searched: Sequence[os.PathLike | str], how_to_get: str) -> FileNotFoundError:
    where = ", ".join(str(p) for p in searched)
    return FileNotFoundError(f"dataset {name!r} not found; searched {where}. {how_to_get} "
                             f"Give the folder that holds it (--root DIR; root=... in Python; data.root in a recipe) "
                             f"or set ${DATA_ENV}.")


class TensorImageDataset(Dataset):
    """Images held in memory as uint8 ``(N, C, H, W)``; items are ``(float32 in [0, 1], int label)``.

    ``transform`` (optional) maps a float image (C, H, W) to a float image and may be random
    (it draws from torch's global generator; see :class:`robust_attn.data.SeededAugment`).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"images must be uint8 (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = labels.long()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index].float().div_(255.0)
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])

    @property
    def targets(self) -> list[int]:
        return self.labels.tolist()
