"""Importers: state dicts in other projects' layouts converted into robust-attn checkpoints.

Each importer is one module with a ``convert_*(state_dict, arch) -> our state dict`` (pure key
renaming plus checks, no arithmetic on the tensors) and an ``import_*(path, arch, out)`` that
reads the source file, builds our model, loads the converted weights and writes a safetensors
checkpoint with :func:`robust_attn.models.checkpoint.save_checkpoint`; the sidecar's ``origin`` names
the importer, the source file and its sha256.

* :mod:`.san_official`: the SAN authors' checkpoints (hszhao/SAN, ``san10_pairwise`` etc.).
* :mod:`.torchvision_resnet`: torchvision-layout ResNet state dicts (``conv1``/``bn1`` stem).

An importer module registers its ``import_*`` with ``@register_importer(name, summary)``
(:data:`IMPORTERS` imports every module of this package when first asked), so a new importer is
one new file here.

The helpers here are shared: :func:`read_state_dict` (``torch.load(weights_only=True)``, never a
full unpickle; unwraps ``{"state_dict": ...}`` and the DataParallel ``module.`` prefix),
:func:`remap` (refuses unknown, missing and mis-shaped keys, naming them) and :func:`fc_classes`
(the class count of an ``fc`` head).
"""
from __future__ import annotations

import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from robust_attn.models.checkpoint import save_checkpoint
from robust_attn.models.registry import create_model
from robust_attn.utils.io import sha256_file
from robust_attn.utils.plugins import Registry
from robust_attn.models.wrapper import NormalizedModel

__all__ = ["ConversionError", "IMAGENET_MEAN", "IMAGENET_STD", "read_state_dict", "remap", "fc_classes",
           "default_output", "Importer", "IMPORTERS", "register_importer", "import_checkpoint"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: wrappers a training script commonly saves the state dict under
_WRAPPER_KEYS = ("state_dict", "model", "model_state_dict")
_SHOW = 8


class ConversionError(ValueError):
    """A source file that is not a state dict, or whose keys or shapes do not fit the architecture."""


def _names(keys, show: int = _SHOW) -> str:
    keys = list(keys)
    more = f" ... and {len(keys) - show} more" if len(keys) > show else ""
    return ", ".join(keys[:show]) + more


def fc_classes(state_dict: Mapping[str, torch.Tensor]) -> int:
    """The number of classes of a state dict's ``fc`` head (``fc.weight`` rows); 1000 (ImageNet)
    when it has none, so that the key check names the missing head."""
    fc = state_dict.get("fc.weight")
    return int(fc.shape[0]) if isinstance(fc, torch.Tensor) and fc.dim() == 2 else 1000


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a ``torch.save`` checkpoint at ``path`` (or of a .safetensors file).

    Loaded with ``weights_only=True``; a ``{"state_dict": ...}`` (or ``"model"``) wrapper is
    unwrapped and a ``module.`` prefix on every key (DataParallel) removed. Raises
    :class:`ConversionError` naming what the file holds instead."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"source checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        try:
            obj = load_file(str(path))
        except Exception as err:  # safetensors raises its own error types
            raise ConversionError(f"{path} cannot be read as safetensors ({err})") from None
    else:
        with open(path, "rb") as f:
            head = f.read(16)
        if not head.startswith((b"PK\x03\x04", b"\x80")):  # torch.save: a zip archive, or a legacy pickle
            raise ConversionError(f"{path} is not a torch.save checkpoint (first bytes {head!r}; a .pth file is a "
                                  f"zip archive or a pickle): an HTML page or another format saved under its "
                                  f"name? Download the checkpoint file itself")
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise ConversionError(
                f"{path} holds Python objects that torch.load(weights_only=True) refuses (e.g. a whole pickled "
                f"model rather than its state dict): save `model.state_dict()` instead ({str(err).splitlines()[0]})"
            ) from None
        except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as err:
            raise ConversionError(f"{path} is not a torch.save checkpoint, or is truncated or corrupt "
                                  f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                                  f"pass the .pth/.pth.tar file itself") from None
    for _ in range(2):  # e.g. {"state_dict": {...}, "epoch": ..., "optimizer": ...}
        if isinstance(obj, Mapping) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
            inner = [k for k in _WRAPPER_KEYS if isinstance(obj.get(k), Mapping)]
            if inner:
                obj = obj[inner[0]]
    if not isinstance(obj, Mapping):
        raise ConversionError(f"{path} holds a {type(obj).__name__}, not a state dict (a dict of tensors, or a "
                              f"dict with one under 'state_dict'); save `model.state_dict()`")
    bad = [str(k) for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad or not obj:
        what = f"entries that are not tensors: {_names(bad)}" if bad else "no tensors"
        raise ConversionError(f"{path} is not a state dict: it has {what} (keys: {_names(map(str, obj))}); "
                              f"pass a file holding `model.state_dict()` or {{'state_dict': model.state_dict()}}")
    return strip_module_prefix(dict(obj))


def strip_module_prefix(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` without the ``module.`` prefix that DataParallel/DDP put on every key."""
    if state_dict and all(k.startswith("module.") for k in state_dict):
        return {k[len("module."):]: v for k, v in state_dict.items()}
    return dict(state_dict)


def target_model(state_dict: Mapping[str, torch.Tensor], arch: str, model: torch.nn.Module | None = None
                 ) -> torch.nn.Module:
    """``model``, or ``create_model(arch, ...)`` at ImageNet resolution with as many classes as the
    source's ``fc`` head: the model whose state dict a converter fills."""
    return model if model is not None else create_model(arch, fc_classes(state_dict), "imagenet")


def _optional(key: str) -> bool:
    """Keys a source may lack (BatchNorm's counter, absent from PyTorch < 0.4.1 checkpoints)."""
    return key.endswith("num_batches_tracked")


def remap(source: Mapping[str, torch.Tensor], mapping: Mapping[str, str], target: Mapping[str, torch.Tensor],
          what: str, hint: str = "") -> dict[str, torch.Tensor]:
    """Our state dict from ``source`` through ``mapping`` (our key -> source key).

    Every source key must be mapped, every mapped key present (``num_batches_tracked`` may be
    missing: ``target``'s value is kept) and of ``target``'s shape; otherwise a
    :class:`ConversionError` names the unexpected, missing and mis-shaped keys (in the source's
    names), prefixed by ``what`` and followed by ``hint``. Tensors are cast to ``target``'s dtypes."""
    expected = set(mapping.values())
    unexpected = sorted(set(source) - expected)
    missing = sorted(k for k in expected - set(source) if not _optional(k))
    shapes = [f"{src} {tuple(source[src].shape)} (needs {tuple(target[ours].shape)})"
              for ours, src in mapping.items() if src in source and source[src].shape != target[ours].shape]
    if unexpected or missing or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing key(s): {_names(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s): {_names(unexpected)}")
        if shapes:
            parts.append(f"{len(shapes)} key(s) of the wrong shape: {_names(shapes)}")
        raise ConversionError(f"{what}: {'; '.join(parts)}" + (f". {hint}" if hint else ""))
    return {ours: (source[src] if src in source else target[ours]).to(target[ours].dtype).clone()
            for ours, src in mapping.items()}


def default_output(path: str | os.PathLike) -> Path:
    """``PATH`` with its suffix (``.pth``, ``.pth.tar``) replaced by ``.safetensors``."""
    path = Path(path)
    name = path.name[:-len(".pth.tar")] if path.name.endswith(".pth.tar") else path.stem
    return path.with_name(name + ".safetensors")


@dataclass(frozen=True)
class Importer:
    """A registered importer: ``run(path, arch, out) -> sha256 of out`` and what it reads."""

    run: Callable[[Path, str, Path], str]
    summary: str


#: every importer by name, from the modules of this package
IMPORTERS: Registry[Importer] = Registry("importer", package="robust_attn.importers", error=ConversionError)


def register_importer(name: str, summary: str):
    """Decorator registering ``import_*(path, arch, out) -> sha256`` as importer ``name``;
    ``summary`` says what it reads (``robust-attn zoo import --help``)."""

    def wrap(fn: Callable) -> Callable:
        IMPORTERS.register(name, Importer(fn, summary))
        return fn

    return wrap


def import_checkpoint(kind: str, path: str | os.PathLike, arch: str, out: str | os.PathLike | None = None,
                      overwrite: bool = False) -> tuple[Path, str]:
    """Convert ``path`` with importer ``kind`` into a checkpoint at ``out`` (default: ``path`` with
    suffix ``.safetensors``); return ``(out, sha256 of out)``. Refuses to overwrite unless asked."""
    importer = IMPORTERS.get(kind)
    path = Path(path)
    out = Path(out) if out is not None else default_output(path)
    if out.suffix != ".safetensors":
        raise ConversionError(f"output {out} must end in .safetensors (the sidecar .json is written beside it)")
    if out.resolve() == path.resolve():
        raise ConversionError(f"output {out} is the source file itself; pass --out with another name")
    if out.exists() and not overwrite:
        raise ConversionError(f"{out} already exists; pass another --out, or --force to replace it")
    return out, importer.run(path, arch, out)


def source_origin(kind: str, path: Path, description: str) -> dict:
    """The sidecar's ``origin``: importer, what the source is, its file name and sha256."""
    return {"importer": kind, "source": description, "source_file": path.name, "source_sha256": sha256_file(path)}


def convert_and_save(kind: str, path: str | os.PathLike, arch: str, out: str | os.PathLike,
                     convert: Callable, description: str) -> str:
    """The common ``import_*``: read ``path``, build ``arch`` (ImageNet resolution, the source's
    class count), load ``convert(source, arch, model)`` strictly, wrap it with ImageNet mean/std
    and save it to ``out`` with the origin of importer ``kind``; the sha256 of ``out``."""
    path = Path(path)
    source = read_state_dict(path)
    model = create_model(arch, fc_classes(source), "imagenet")
    model.load_state_dict(convert(source, arch, model), strict=True)
    wrapped = NormalizedModel(model, IMAGENET_MEAN, IMAGENET_STD).eval()
    return save_checkpoint(out, wrapped, {"origin": source_origin(kind, path, description)})
