"""A training run's checkpoints: one complete folder per epoch, written before ``LAST`` points at
it, the guard's best epoch, and the resume that reads them back (layout in
:mod:`robust_attn.train.trainer`)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file

from robust_attn.models.checkpoint import save_checkpoint
from robust_attn.models.wrapper import NormalizedModel
from robust_attn.train.ema import WeightAverage
from robust_attn.train.recipe import Recipe, RecipeError
from robust_attn.utils.io import atomic_path, atomic_write_text, sha256_file

__all__ = ["ResumeError", "latest_checkpoint", "restore", "save_best", "save_epoch"]


class ResumeError(RecipeError):
    """``--resume`` cannot continue from what is in the output directory."""


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete epoch folder (the one ``LAST`` names), or None."""
    pointer = out / "checkpoints" / "LAST"
    if not pointer.is_file():
        return None
    folder = out / "checkpoints" / pointer.read_text().strip()
    return folder if (folder / "state.pt").is_file() else None


def restore(out: Path, recipe: Recipe, net: NormalizedModel, average: WeightAverage | None, optimizer,
            scheduler, scaler, device: torch.device) -> tuple[Path, dict]:
    """Load the newest epoch of ``out`` into the model, its weight average, the optimizer,
    scheduler and scaler, and restore the RNG states; returns the folder and its ``state.pt`` (the
    epoch, the metric history and whatever the loop saved beside them). A clear
    :class:`ResumeError` where there is nothing to resume, the recipe differs, or the folder's
    weights are not the ones its state was written with."""
    folder = latest_checkpoint(out)
    if folder is None:
        raise ResumeError(f"--resume: no checkpoint in {out / 'checkpoints'}; run without --resume to start")
    state = torch.load(folder / "state.pt", map_location="cpu", weights_only=True)
    if state["recipe_sha256"] != recipe.sha256():
        raise ResumeError(f"--resume: the recipe differs from the one {out} was started with "
                          f"(see {out / 'recipe.json'}); resume with the same recipe and overrides, "
                          f"or use a new --out")
    if sha256_file(folder / "model.safetensors") != state["weights_sha256"]:
        raise ResumeError(f"--resume: {folder} is inconsistent (weights do not match state.pt)")
    saved = load_file(str(folder / "model.safetensors"), device=str(device))
    if average is None:
        net.load_state_dict(saved, strict=True)
    else:  # model.safetensors holds the average; state.pt the live weights
        net.load_state_dict(state["live_weights"], strict=True)
        average.load_state_dict({"weights": saved, "updates": state["ema_updates"]})
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng_cpu"])
    if device.type == "cuda" and state.get("rng_cuda") is not None:
        torch.cuda.set_rng_state(state["rng_cuda"], device)
    return folder, state


def save_best(out: Path, model: nn.Module, meta: dict) -> None:
    """checkpoints/best/model.safetensors: the model of the guard's best epoch so far."""
    folder = out / "checkpoints" / "best"
    folder.mkdir(parents=True, exist_ok=True)
    save_checkpoint(folder / "model.safetensors", model, meta)


def save_epoch(out: Path, net: NormalizedModel, optimizer, scheduler, scaler, device: torch.device,
                history: list[dict], recipe: Recipe, world: int, meta_base: dict,
                average: WeightAverage | None = None, extra: dict | None = None) -> None:
    """Write checkpoints/epoch_NNNN completely, then point LAST at it, then drop older folders.
    With a weight average, model.safetensors holds the average and state.pt the live weights."""
    epoch = len(history)
    root = out / "checkpoints"
    name = f"epoch_{epoch:04d}"
    folder = root / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    meta = dict(meta_base, epoch=epoch, metrics=history[-1])
    weights_sha = save_checkpoint(folder / "model.safetensors", net if average is None else average.module, meta)
    state = {"epoch": epoch, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "scaler": scaler.state_dict(), "rng_cpu": torch.get_rng_state(),
             "rng_cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
             "history": history, "recipe_sha256": recipe.sha256(), "weights_sha256": weights_sha,
             "world_size": world}
    if average is not None:
        state["live_weights"] = {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}
        state["ema_updates"] = average.updates
    state.update(extra or {})
    with atomic_path(folder / "state.pt") as tmp:
        torch.save(state, tmp)
    atomic_write_text(root / "LAST", name + "\n")
    for old in root.glob("epoch_*"):  # "best" is kept
        if old.name != name and old.is_dir():
            shutil.rmtree(old)
