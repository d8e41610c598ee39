"""The test-set accuracy a zoo entry records, measured as the harness evaluates: float32, no
autocast (``robust-attn zoo add --evaluate``).

A checkpoint's sidecar carries the accuracy its trainer measured after the selected epoch, which
under a bf16 recipe (``runtime.amp``) is the accuracy under autocast, not the float32 model the
protocols attack. ``tests/test_zoo.py`` re-evaluates every shipped entry on the test set, the whole
set to 0.02 points and a seeded fifth of it to one image, so the manifest records the float32
figures: ``eval_top1`` and ``eval_top5`` of the whole test split, and
``seeded_fifth_top1_correct``, the correct top-1 count on ``subset_indices(size, size // 5,
seed=0)``. The trainer's figures, where they differ, stay beside them as ``training_eval_top1`` and
``training_eval_top5``.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Subset

__all__ = ["measure_test_accuracy", "with_measured_accuracy"]


def measure_test_accuracy(model: nn.Module, dataset: str, root: str | Path | None = None,
                          batch_size: int = 500) -> dict:
    """``eval_top1``, ``eval_top5`` (%, rounded to 0.01) on the whole test split of ``dataset`` and
    ``seeded_fifth_top1_correct``; ``model`` takes [0, 1] images (a zoo or checkpoint model)."""
    from robust_attn.data import build_dataset
    from robust_attn.data.splits import subset_indices
    from robust_attn.train import evaluate

    test_set = build_dataset(dataset, root=root, split="test")
    cpu = torch.device("cpu")
    top1, top5, _ = evaluate(model, DataLoader(test_set, batch_size=batch_size), cpu)
    fifth = Subset(test_set, subset_indices(len(test_set), len(test_set) // 5, seed=0))
    fifth_top1, _, n = evaluate(model, DataLoader(fifth, batch_size=batch_size), cpu)
    return {"eval_top1": round(top1, 2), "eval_top5": round(top5, 2),
            "seeded_fifth_top1_correct": round(fifth_top1 * n / 100)}


def with_measured_accuracy(metrics: dict, measured: dict) -> dict:
    """``metrics`` (a sidecar's) with ``measured`` (:func:`measure_test_accuracy`) in place of its test
    accuracy; the trainer's own figures kept as ``training_eval_top1/5`` where they differ."""
    out = dict(metrics)
    for key in ("eval_top1", "eval_top5"):
        if key in metrics and metrics[key] != measured[key]:
            out[f"training_{key}"] = metrics[key]
    out.update(measured)
    return out
