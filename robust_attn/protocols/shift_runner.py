"""The run loop of the shift protocols (corruption, occlusion, shuffle): each condition is a
function of the images and their dataset positions; every image is classified under every
condition and recorded as ``index, label, pred, top1, top5`` (the rotation protocol's records),
through the shared resumable, sharded runner (:mod:`robust_attn.protocols.runner`)."""
from __future__ import annotations

from typing import Callable, Iterator

import pandas as pd
import torch
import torch.nn as nn

from robust_attn.distributed import barrier
from robust_attn.protocols.runner import finite_logits, open_run, run_chunks, topk_hits

__all__ = ["CLEAN", "Shift", "prediction_records", "make_shift_evaluator", "run_shift", "accuracy_by_condition"]

CLEAN = "clean"
#: ``shift(condition_name, images (N, C, H, W) in [0, 1] on the model's device, indices (N,) of the
#: images in the dataset, labels (N,))`` -> the shifted images, same shape.
Shift = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def prediction_records(logits: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor) -> pd.DataFrame:
    pred = finite_logits(logits, indices, "shifted images").argmax(dim=1)
    return pd.DataFrame({"index": indices.cpu().numpy(), "label": labels.cpu().numpy(), "pred": pred.cpu().numpy(),
                         "top1": (pred == labels).long().cpu().numpy(),
                         "top5": topk_hits(logits, labels, 5).cpu().numpy()})


def make_shift_evaluator(model: nn.Module, shift: Shift, device: torch.device):
    """The ``evaluate`` callback of :func:`~robust_attn.protocols.runner.run_chunks`."""

    @torch.no_grad()
    def evaluate(images, labels, indices, todo) -> Iterator[tuple[str, pd.DataFrame]]:
        images, labels = images.to(device), labels.to(device)
        for name in todo:
            shifted = images if name == CLEAN else shift(name, images, indices, labels)
            yield name, prediction_records(model(shifted), labels, indices)

    return evaluate


def run_shift(protocol: str, model: nn.Module, dataset, out_dir, *, conditions: list[dict], shift: Shift,
              parameters: dict, batch_size: int = 64, device="cpu", run_info: dict | None = None, rank: int = 0,
              world_size: int = 1, num_workers: int = 0, progress: bool = True, repair: bool = False):
    """Run (or resume) ``protocol`` on ``model`` over ``dataset`` into ``out_dir``: every
    condition (``conditions``: dicts with a ``name``; ``clean`` is the unshifted image) on
    every image. Returns the :class:`~robust_attn.runs.store.RunStore`."""
    device = torch.device(device)
    model = model.to(device).eval()
    store = open_run(out_dir, dict(run_info or {}), protocol=protocol, parameters=parameters,
                     conditions=conditions, num_images=len(dataset), chunk_size=batch_size, rank=rank,
                     repair=repair, device=device)
    run_chunks(store, dataset, [c["name"] for c in conditions], make_shift_evaluator(model, shift, device),
               chunk_size=batch_size, rank=rank, world_size=world_size, num_workers=num_workers,
               progress=progress and rank == 0, desc=protocol)
    barrier()
    return store


def accuracy_by_condition(records: pd.DataFrame) -> pd.DataFrame:
    """Per condition (in record order): ``n``, ``top1``, ``top5`` (percent)."""
    grouped = records.groupby("condition", sort=False)
    out = pd.DataFrame({"n": grouped.size(), "top1": grouped["top1"].mean() * 100, "top5": grouped["top5"].mean() * 100})
    out.index.name = "condition"
    return out.reset_index()
