"""Checkpoints: weights as safetensors plus a JSON sidecar that says how to rebuild the model.

``model.safetensors`` holds the state dict of a :class:`~robust_attn.wrapper.NormalizedModel`
(so mean and std travel with the weights); ``model.json`` beside it holds at least
``arch`` (the ``arch_args`` of :func:`robust_attn.create_model`), ``mean`` and ``std``, and
whatever the writer adds (recipe, epoch, metrics, versions). Loading never unpickles.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from robust_attn.registry import create_model
from robust_attn.utils.io import atomic_path, atomic_write_json, sha256_file
from robust_attn.wrapper import NormalizedModel

__all__ = ["sidecar_path", "save_checkpoint", "read_sidecar", "load_checkpoint", "CheckpointError"]


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
    path = sidecar_path(weights)
    if not path.is_file():
        raise CheckpointError(f"checkpoint sidecar {path} is missing; a checkpoint is a .safetensors file "
                              f"with a .json beside it, as written by robust-attn train")
    return json.loads(path.read_text())


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
            raise CheckpointError(f"sha256 of {weights} is {actual}, expected {expected_sha256}: the file is "
                                  f"corrupt or not the one the manifest lists; download or train it again")
    meta = read_sidecar(weights)
    arch = meta["arch"]
    model = NormalizedModel(create_model(arch["name"], arch["num_classes"], arch["resolution"],
                                         **arch.get("overrides", {})), meta["mean"], meta["std"])
    state = load_file(str(weights), device=str(map_location))
    missing, unexpected = set(model.state_dict()) - set(state), set(state) - set(model.state_dict())
    if missing or unexpected:
        raise CheckpointError(f"weights in {weights} do not fit architecture {arch['name']}: "
                              f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"weights in {weights} do not fit architecture {arch['name']}: {err}") from err
    return model.to(map_location).eval()
