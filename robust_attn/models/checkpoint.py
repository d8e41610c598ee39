"""Checkpoints: weights as safetensors plus a JSON sidecar that says how to rebuild the model.

``model.safetensors`` holds the state dict of a :class:`~robust_attn.models.wrapper.NormalizedModel`
(so mean and std travel with the weights); ``model.json`` beside it holds at least
``arch`` (the ``arch_args`` of :func:`robust_attn.create_model`), ``mean`` and ``std``, and
whatever the writer adds (recipe, epoch, metrics, versions). Loading never unpickles.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from robust_attn.models.registry import create_model
from robust_attn.utils.io import atomic_path, atomic_write_json, sha256_file
from robust_attn.models.wrapper import NormalizedModel

__all__ = ["sidecar_path", "save_checkpoint", "read_sidecar", "load_checkpoint", "check_safetensors_file",
           "check_num_classes", "CheckpointError"]

SIDECAR_KEYS = ("arch", "mean", "std")
ARCH_KEYS = ("name", "num_classes", "resolution")
_REWRITE = "train it again with `robust-attn train`, or restore the .json written beside the weights"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not fit its architecture."""


def sidecar_path(weights: str | os.PathLike) -> Path:
    return Path(weights).with_suffix(".json")


def save_checkpoint(weights: str | os.PathLike, model: NormalizedModel, meta: dict | None = None) -> str:
    """Write ``weights`` (.safetensors) and its sidecar atomically; return the weights' sha256."""
    if not isinstance(model, NormalizedModel):
        raise TypeError("save_checkpoint takes a NormalizedModel (mean/std must travel with the weights)")
    weights = Path(weights)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    with atomic_path(weights) as tmp:
        save_file(state, str(tmp))
    sidecar = dict(meta or {})
    sidecar.update(arch=model.arch_args, mean=model.mean.flatten().tolist(), std=model.std.flatten().tolist(),
                   sha256=sha256_file(weights))
    atomic_write_json(sidecar_path(weights), sidecar)
    return sidecar["sha256"]


def read_sidecar(weights: str | os.PathLike) -> dict:
    """The sidecar of ``weights``, checked: valid JSON with ``arch`` (``name``, ``num_classes``,
    ``resolution``), ``mean`` and ``std``."""
    path = sidecar_path(weights)
    if not path.is_file():
        raise CheckpointError(f"checkpoint sidecar {path} is missing; a checkpoint is a .safetensors file "
                              f"with a .json beside it, as written by robust-attn train")
    try:
        meta = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise CheckpointError(f"checkpoint sidecar {path} is not text (a binary file under the sidecar's name); "
                              f"{_REWRITE}") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint sidecar {path} is not valid JSON ({err.msg} at line {err.lineno}, "
                              f"column {err.colno}): fix the hand edit, or {_REWRITE}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint sidecar {path} holds a JSON {type(meta).__name__}, not an object "
                              f"with {', '.join(SIDECAR_KEYS)}; {_REWRITE}")
    missing = [k for k in SIDECAR_KEYS if k not in meta]
    missing += [f"arch.{k}" for k in ARCH_KEYS if isinstance(meta.get("arch"), dict) and k not in meta["arch"]]
    if "arch" in meta and not isinstance(meta["arch"], dict):
        missing.append("arch (an object)")
    if missing:
        raise CheckpointError(f"checkpoint sidecar {path} lacks {', '.join(missing)}: it is not a robust-attn "
                              f"sidecar or was cut short; {_REWRITE}")
    return meta


# file signatures of what is most often saved under a .safetensors name by mistake
_FOREIGN = [
    (b"PK\x03\x04", "a zip archive, which is what torch.save writes (a .pt/.pth checkpoint)",
     "convert it: `sd = torch.load(path, weights_only=True)`, load it into the model and write it with "
     "robust_attn.models.checkpoint.save_checkpoint (or safetensors.torch.save_file)"),
    (b"\x80", "a Python pickle (a legacy torch.save .pt/.pth file)",
     "convert it: `sd = torch.load(path, weights_only=True)`, load it into the model and write it with "
     "robust_attn.models.checkpoint.save_checkpoint (or safetensors.torch.save_file)"),
    (b"version https://git-lfs", "a Git LFS pointer, not the weights themselves",
     "fetch the weights with `git lfs pull`"),
    (b"\x1f\x8b", "gzip-compressed", "decompress it (gunzip) and check that what comes out is a .safetensors file"),
    (b"\x89HDF", "an HDF5 file (e.g. Keras weights)", "convert the weights to a PyTorch state dict in safetensors"),
    (b"\x93NUMPY", "a NumPy .npy array", "convert the arrays to a state dict and save it with safetensors"),
]


def _sniff(head: bytes) -> tuple[str, str] | None:
    """(what the file is, what to do) for a file that is recognisably not safetensors."""
    text = head.lstrip().lower()
    if text.startswith((b"<!doctype", b"<html", b"<?xml", b"<head", b"<body")):
        return ("an HTML/XML page: a download that saved a web page (login, redirect, quota or error page) "
                "instead of the file", "download it again from a direct link to the file (and check the link "
                "works in a browser), or train it again with `robust-attn train`")
    if text.startswith((b"{", b"[")):
        return ("JSON text (a sidecar or manifest under the weights' name?)",
                "pass the .safetensors weights file; its .json sidecar must lie beside it")
    for magic, what, fix in _FOREIGN:
        if head.startswith(magic):
            return what, fix
    return None


def check_safetensors_file(path: str | os.PathLike) -> None:
    """Refuse, with the likely cause and the fix, a file that is not a complete safetensors file.

    The safetensors layout: an 8-byte little-endian header length N, a JSON header of N bytes
    mapping each tensor to ``data_offsets`` [begin, end) in the byte buffer that follows; the
    file must end exactly at the buffer's end. A wrong signature (HTML page, torch pickle/zip,
    LFS pointer) is named; a header or buffer cut short is called truncated.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
        if size == 0:
            raise CheckpointError(f"checkpoint {path} is empty (0 bytes): an interrupted download or copy; "
                                  f"download or train it again")
        foreign = _sniff(head)
        if foreign is not None:
            what, fix = foreign
            raise CheckpointError(f"checkpoint {path} is not a safetensors file: it is {what}. Fix: {fix}.")
        if size < 8:
            raise CheckpointError(f"checkpoint {path} is truncated ({size} bytes, shorter than the 8-byte "
                                  f"safetensors header length): download or train it again")
        (n,) = struct.unpack("<Q", head[:8])
        looks_like_header = head[8:9] == b"{"
        if not looks_like_header:
            raise CheckpointError(f"checkpoint {path} is not a safetensors file (no JSON header after the "
                                  f"8-byte length; first bytes {head[:16]!r}): pass a .safetensors file written "
                                  f"by robust-attn train or safetensors.torch.save_file")
        if 8 + n > size:
            raise CheckpointError(f"checkpoint {path} is truncated: its header alone needs {8 + n} bytes but the "
                                  f"file has {size}; the download or copy was cut short: download or train it again")
        f.seek(8)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"checkpoint {path} has a corrupt safetensors header (not JSON): the file is "
                                  f"damaged; download or train it again") from None
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
            and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2]
    expected = 8 + n + max(ends, default=0)
    if size < expected:
        raise CheckpointError(f"checkpoint {path} is truncated: {size} bytes of the {expected} its header "
                              f"describes ({100 * size / expected:.0f}%); the download, copy or save was cut "
                              f"short: download or train it again")
    if size > expected:
        raise CheckpointError(f"checkpoint {path} has {size - expected} bytes after the tensors its header "
                              f"describes: two files written over each other or a damaged copy; download or "
                              f"train it again")


def load_checkpoint(weights: str | os.PathLike, expected_sha256: str | None = None,
                    map_location: str | torch.device = "cpu") -> NormalizedModel:
    """Rebuild the model a checkpoint describes and load its weights; returned in eval mode.

    ``expected_sha256`` (e.g. from the zoo manifest) is checked before anything is read.
    """
    weights = Path(weights)
    if not weights.is_file():
        raise CheckpointError(f"checkpoint {weights} does not exist")
    if expected_sha256 is not None:
        actual = sha256_file(weights)
        if actual != expected_sha256:
            raise CheckpointError(f"sha256 of {weights} is {actual}, expected {expected_sha256} (the manifest's): "
                                  f"the file is corrupt, truncated or not the one the manifest lists; download "
                                  f"or train it again, or, if this file is the right one, register it anew with "
                                  f"`robust-attn zoo add` (which records its sha256)")
    check_safetensors_file(weights)
    meta = read_sidecar(weights)
    recorded = meta.get("sha256")
    if recorded and recorded != expected_sha256:
        actual = expected_sha256 or sha256_file(weights)   # the manifest's, when given, was just checked
        if actual != recorded:
            raise CheckpointError(f"sha256 of {weights} is {actual} but its sidecar {sidecar_path(weights)} "
                                  f"records {recorded}: the weights were replaced, or the .json belongs to "
                                  f"another checkpoint; use the .safetensors/.json pair written together by "
                                  f"`robust-attn train` (or train it again)")
    arch = meta["arch"]
    try:
        net = create_model(arch["name"], arch["num_classes"], arch["resolution"], **arch.get("overrides", {}))
    except (KeyError, TypeError, ValueError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        raise CheckpointError(f"sidecar {sidecar_path(weights)} describes an architecture that cannot be "
                              f"built ({message}); {_REWRITE}") from err
    model = NormalizedModel(net, meta["mean"], meta["std"])
    try:
        state = load_file(str(weights), device=str(map_location))
    except SafetensorError as err:   # whatever check_safetensors_file could not see
        raise CheckpointError(f"checkpoint {weights} cannot be read as safetensors ({err}): the file is "
                              f"damaged; download or train it again") from None
    missing, unexpected = set(model.state_dict()) - set(state), set(state) - set(model.state_dict())
    if missing or unexpected:
        raise CheckpointError(f"weights in {weights} do not fit architecture {arch['name']}: "
                              f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"weights in {weights} do not fit architecture {arch['name']}: {err}") from err
    return model.to(map_location).eval()


def check_trained_on(weights: str | os.PathLike, dataset: str, allow_other: bool = False) -> None:
    """Refuse a checkpoint whose sidecar says it was trained on another dataset than ``dataset``
    (its normalization and class order are that dataset's), unless ``allow_other``."""
    trained_on = read_sidecar(weights).get("dataset")
    if trained_on and trained_on != dataset and not allow_other:
        raise CheckpointError(f"checkpoint {weights} was trained on {trained_on} (its sidecar says so) but the "
                              f"dataset is {dataset}: its normalization and classes are {trained_on}'s. Evaluate it "
                              f"on --dataset {trained_on}, or pass --other-dataset to measure it on {dataset} on "
                              f"purpose")


def check_num_classes(model: torch.nn.Module, num_classes: int, where: str, image_size: int = 32,
                      channels: int = 3) -> None:
    """Refuse a model whose output is not ``(batch, num_classes)``, whatever its source.

    One forward pass of a dummy zero image (a batch of one ``channels x image_size x image_size``,
    no gradients, the model's train/eval mode restored) on the model's own device. ``where``
    names the model in the error (e.g. ``"checkpoint runs/x/model.safetensors"``).
    """
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(1, channels, image_size, image_size, device=device))
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != 1:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise CheckpointError(f"{where} returns {shape} for a batch of 1 image, not (1, classes) logits; "
                              f"evaluate a classifier")
    if out.shape[1] != num_classes:
        raise CheckpointError(f"{where} outputs {out.shape[1]} classes but the dataset has {num_classes}: "
                              f"evaluate it on the dataset it was trained on, or pick a model trained on this "
                              f"dataset (robust-attn zoo list)")
