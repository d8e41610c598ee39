"""What every model source returns: the model, its preprocessing and where it came from.

A source turns the part of a spec after its prefix (``timm:`` ``resnet50``) into a
:class:`LoadedModel`: a :class:`~robust_attn.models.wrapper.NormalizedModel` in eval mode (images in
[0, 1]; the source's mean/std live inside the wrapper, so attacks never see normalized
pixels), the :class:`Preprocessing` the weights expect (``None``: the dataset's own images as
they are), and a description for the run directory that always names the source, the spec and
a weights hash.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from robust_attn.models.wrapper import NormalizedModel

__all__ = ["SourceError", "Preprocessing", "LoadedModel", "SourceRequest", "state_dict_sha256",
           "load_weights_file", "INTERPOLATIONS"]

INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")


class SourceError(ValueError):
    """A model spec that cannot be turned into a model; the message names the fix."""


class _ToFloatTensor:
    """PIL image -> float tensor in [0, 1] (``ToTensor``); a tensor is passed on as float.

    The datasets of robust-attn already yield float tensors in [0, 1], which ``Resize`` and
    ``CenterCrop`` take as they are; a PIL image (an ImageFolder without a transform) is
    converted after the crop, as torchvision's presets do."""

    def __call__(self, image):
        if isinstance(image, torch.Tensor):
            return image if image.is_floating_point() else image.float().div(255.0)
        from torchvision.transforms.functional import to_tensor

        return to_tensor(image)

    def __repr__(self) -> str:
        return "ToFloatTensor()"


@dataclass(frozen=True)
class Preprocessing:
    """The eval-time preprocessing a model's weights were trained with.

    ``resize_size``: the shorter image side is resized to this (``interpolation``, antialiased);
    ``crop_size``: then the centre square of this side is kept; ``input_size``: the side the
    network takes (equal to ``crop_size`` for every source here). ``mean``/``std`` are what the
    :class:`NormalizedModel` normalizes with: they are recorded here but not applied by
    :meth:`eval_transform`, so images stay in [0, 1] for the attacks.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    input_size: int
    resize_size: int
    crop_size: int
    interpolation: str = "bilinear"

    def __post_init__(self):
        if self.interpolation not in INTERPOLATIONS:
            raise SourceError(f"unknown interpolation {self.interpolation!r}; choose one of {INTERPOLATIONS}")
        if min(self.input_size, self.resize_size, self.crop_size) < 1:
            raise SourceError(f"preprocessing sizes must be positive: {self}")

    def eval_transform(self):
        """Resize(resize_size, interpolation) -> CenterCrop(crop_size) -> float tensor in [0, 1].
        No ``Normalize``: normalization is inside the model wrapper."""
        from torchvision import transforms as T

        mode = T.InterpolationMode(self.interpolation)
        return T.Compose([T.Resize(self.resize_size, interpolation=mode, antialias=True),
                          T.CenterCrop(self.crop_size), _ToFloatTensor()])

    def as_dict(self) -> dict:
        out = asdict(self)
        out["mean"], out["std"] = list(self.mean), list(self.std)
        return out

    @classmethod
    def from_dict(cls, values: dict) -> "Preprocessing":
        """The inverse of :meth:`as_dict` (``run.json``'s ``preprocessing``)."""
        return cls(**{k: tuple(float(x) for x in v) if k in ("mean", "std") else v for k, v in values.items()})


@dataclass
class LoadedModel:
    """A model from a spec: ``model`` takes [0, 1] images; ``preprocessing`` is None when the
    dataset's images are used as they are; ``description`` goes into the run's ``run.json``
    (always ``source``, ``spec``, ``model``, ``weights_origin`` and ``weights_sha256``; see
    :mod:`robust_attn.sources.provenance`)."""

    model: NormalizedModel
    preprocessing: Preprocessing | None
    description: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SourceRequest:
    """What a source is asked for: ``target`` is the spec without its prefix."""

    spec: str
    target: str
    dataset_info: Any
    checkpoint: str | None = None
    model_args: dict = field(default_factory=dict)
    seed: int = 0
    device: str = "cpu"
    manifest: str | None = None     # zoo: the manifest file (None: the default one)
    other_dataset: bool = False     # a checkpoint trained on another dataset than dataset_info's may be used


def state_dict_sha256(module: nn.Module) -> str:
    """sha256 over a module's state dict (names, dtypes, shapes and bytes, in name order): the
    weights hash of a model that was not read from one file (downloaded, built by a function)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def load_weights_file(module: nn.Module, path: str | os.PathLike, spec: str) -> str:
    """Load a local state dict (``torch.save`` .pth, read with ``weights_only=True``, or
    .safetensors) into ``module`` strictly; return the file's sha256."""
    from robust_attn.importers import ConversionError, read_state_dict
    from robust_attn.utils.io import sha256_file

    path = Path(path)
    if not path.is_file():
        raise SourceError(f"weights file {path} for {spec!r} does not exist; check the --checkpoint path")
    try:
        state = read_state_dict(path)
    except ConversionError as err:
        raise SourceError(str(err)) from None
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as err:
        first = str(err).splitlines()[0:3]
        raise SourceError(f"weights in {path} do not fit {spec!r}: {' '.join(first)}; pass the state dict of "
                          f"this architecture (and model-args such as num_classes that match it)") from None
    return sha256_file(path)
