"""Attack targets per image, shared by every targeted protocol (SAN's Table 10 PGD, ``eval attack
--targeted``, transfer): drawn once from a seeded generator over the whole evaluated set
(:func:`robust_attn.attacks.draw_targets`, uniform over the wrong classes), or given as a tensor or
as another run's ``targets.csv``, and saved in the run directory so that other runs and models are
attacked towards the same classes."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pandas as pd
import torch
from torch.utils.data import DataLoader

from robust_attn.utils.io import atomic_path, sha256_file

__all__ = ["TARGETS_FILE", "dataset_labels", "prepare_targets", "save_targets"]

TARGETS_FILE = "targets.csv"


def dataset_labels(dataset) -> torch.Tensor:
    """All labels of ``dataset`` in order: its ``targets`` when it has them, else one pass."""
    targets = getattr(dataset, "targets", None)
    if targets is not None and len(targets) == len(dataset):
        return torch.as_tensor(list(targets), dtype=torch.long)
    labels = [torch.as_tensor(y) for _, y in DataLoader(dataset, batch_size=32)]   # images of any size: a small batch
    return torch.cat(labels).long()


def _draw_targets(labels: torch.Tensor, num_classes: int, seed: int) -> torch.Tensor:
    from robust_attn.attacks import draw_targets

    return torch.as_tensor(draw_targets(labels, num_classes, seed)).long()


def prepare_targets(labels: torch.Tensor, num_classes: int, seed: int,
                    targets_file: str | Path | None = None, *,
                    targets: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The attack target of every image, and how they were made (for ``run.json``).

    With ``targets`` (a tensor or sequence: one class per image, in dataset order) or
    ``targets_file`` (another run's ``targets.csv``, checked to cover the same images with the
    same labels) those targets are used. Otherwise they are drawn with ``seed``.
    :func:`save_targets` saves them.
    """
    if targets is not None and targets_file is not None:
        raise ValueError("give the attack targets as targets (a tensor) or targets_file (a targets.csv), not both")
    if targets is not None:
        targets = torch.as_tensor(targets).detach().cpu()
        if targets.dim() != 1 or len(targets) != len(labels) or targets.is_floating_point():
            raise ValueError(f"targets must be one integer class per image of the dataset ({len(labels)}), in "
                             f"dataset order; got a {targets.dtype} tensor of shape {tuple(targets.shape)}")
        targets = targets.long()
        source = {"tensor": "given by the caller",
                  "sha256": hashlib.sha256(targets.numpy().astype("<i8").tobytes()).hexdigest()}
    elif targets_file is not None:
        frame = pd.read_csv(targets_file)
        if list(frame.columns[:3]) != ["index", "label", "target"]:
            raise ValueError(f"{targets_file} is not a targets file (columns index,label,target)")
        if len(frame) != len(labels) or not (frame["label"].to_numpy() == labels.numpy()).all():
            raise ValueError(f"{targets_file} was made for other images ({len(frame)} rows) than these "
                             f"({len(labels)}); use the same --dataset, --split and --limit as its run")
        targets = torch.as_tensor(frame["target"].to_numpy().copy()).long()
        source = {"file": str(targets_file), "sha256": sha256_file(targets_file)}
    else:
        targets = _draw_targets(labels, num_classes, seed)
        source = {"seed": int(seed), "rule": "uniform over the wrong classes"}
    if len(targets) != len(labels) or (targets == labels).any() or (targets < 0).any() \
            or (targets >= num_classes).any():
        bad = torch.nonzero((targets == labels) | (targets < 0) | (targets >= num_classes)).flatten()[:3].tolist() \
            if len(targets) == len(labels) else []
        raise ValueError(f"attack targets must be one wrong class in [0, {num_classes}) per image"
                         + (f"; images {bad} have their own label or a class out of range" if bad else ""))
    return targets, source


def save_targets(out_dir, labels: torch.Tensor, targets: torch.Tensor) -> Path:
    """Write ``targets.csv`` (index, label, target), or check the one a previous attempt saved."""
    path = Path(out_dir) / TARGETS_FILE
    frame = pd.DataFrame({"index": range(len(labels)), "label": labels.numpy(), "target": targets.numpy()})
    if path.is_file():
        saved = pd.read_csv(path)
        if not saved.equals(frame):
            raise ValueError(f"{path} holds other targets than this run would use; pass a new --out "
                             f"or the same --seed / --targets as the run that made it")
    else:
        with atomic_path(path) as tmp:
            frame.to_csv(tmp, index=False)
    return path
