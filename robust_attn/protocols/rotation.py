"""The rotation protocol (SAN, Zhao et al. 2020, section 5.4 and Table 9): every image under each
condition of :mod:`robust_attn.shifts.rotation` (the paper's rotations and flip, the left-right
flip and an angle sweep), top-1 / top-5 with the drop from the unrotated result in points."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import pandas as pd
import torch
import torch.nn as nn

from robust_attn.distributed import barrier
from robust_attn.protocols.eval_step import eval_protocol
from robust_attn.protocols.study_step import Passes, study_protocol
from robust_attn.protocols.settings import ProtocolSettings, setting
from robust_attn.protocols.runner import finite_logits, open_run, run_chunks, topk_hits
from robust_attn.shifts.rotation import DEFAULT_ANGLE_STEP, RotationCondition, apply_condition, rotation_conditions

__all__ = ["make_evaluator", "summarize_rotation", "run_rotation", "PROTOCOL"]

PROTOCOL = "rotation"


def make_evaluator(model: nn.Module, conditions: list[RotationCondition], device: torch.device):
    """The ``evaluate`` callback of :func:`robust_attn.protocols.runner.run_chunks`: per-image
    records ``index, label, pred, top1, top5`` for each asked condition."""
    by_name = {c.name: c for c in conditions}

    @torch.no_grad()
    def evaluate(images, labels, indices, todo) -> Iterator[tuple[str, pd.DataFrame]]:
        images = images.to(device)
        labels = labels.to(device)
        for name in todo:
            logits = finite_logits(model(apply_condition(images, by_name[name])), indices, f"condition {name}")
            pred = logits.argmax(dim=1)
            yield name, pd.DataFrame({
                "index": indices.numpy(),
                "label": labels.cpu().numpy(),
                "pred": pred.cpu().numpy(),
                "top1": (pred == labels).long().cpu().numpy(),
                "top5": topk_hits(logits, labels, 5).cpu().numpy(),
            })

    return evaluate


def summarize_rotation(records: pd.DataFrame, baseline: str = "none") -> pd.DataFrame:
    """Per condition: ``n``, ``top1``, ``top5`` (percent) and ``top1_drop``, ``top5_drop``
    (percentage points below ``baseline``, as in the brackets of Table 9), from the records."""
    grouped = records.groupby("condition", sort=False)
    summary = pd.DataFrame({"n": grouped.size(), "top1": grouped["top1"].mean() * 100,
                            "top5": grouped["top5"].mean() * 100})
    if baseline in summary.index:
        summary["top1_drop"] = summary.loc[baseline, "top1"] - summary["top1"]
        summary["top5_drop"] = summary.loc[baseline, "top5"] - summary["top5"]
    summary.index.name = "condition"
    return summary.reset_index()


def run_rotation(model: nn.Module, dataset, out_dir, *, conditions: list[RotationCondition] | None = None,
                 batch_size: int = 64, device: str | torch.device = "cpu", run_info: dict | None = None,
                 rank: int = 0, world_size: int = 1, num_workers: int = 0, progress: bool = True,
                 model_info=None):
    """Run (or resume) the rotation protocol on ``model`` (any module taking [0, 1] images, e.g.
    a :class:`NormalizedModel`) over ``dataset`` into ``out_dir``; returns the :class:`RunStore`.

    ``run_info`` adds what the caller knows (model, checkpoint, dataset, command line); the
    protocol adds its own parameters, conditions, image count and chunk size. ``model_info``
    says where the model came from (a :class:`~robust_attn.sources.LoadedModel`, a dict such as
    ``{"name": "my_vit", "weights_origin": "pretrained", "weights": "..."}`` or a string); the run
    records it with the weights' sha256 and the parameter count
    (:func:`robust_attn.sources.provenance.with_provenance`; without it: ``user module``).
    """
    from robust_attn.sources.provenance import with_provenance

    conditions = list(conditions) if conditions is not None else rotation_conditions()
    device = torch.device(device)
    model = model.to(device).eval()
    store = open_run(out_dir, with_provenance(model, run_info, model_info, dataset), protocol=PROTOCOL,
                     parameters={"angle_interpolation": "bilinear", "angle_fill": "zeros",
                                 "direction": "clockwise"},
                     conditions=[c.as_dict() for c in conditions], num_images=len(dataset),
                     chunk_size=batch_size, rank=rank, device=device)
    run_chunks(store, dataset, [c.name for c in conditions], make_evaluator(model, conditions, device),
               chunk_size=batch_size, rank=rank, world_size=world_size, num_workers=num_workers,
               progress=progress and rank == 0, desc="rotation")
    barrier()
    return store


def _describe(config) -> str:
    sweep = f" and a sweep every {config.angle_step:g}° (bilinear, zero fill)" if config.angle_step else ""
    return f"Rotation: SAN Table 9's conditions, the left-right flip{sweep}."


@dataclass(frozen=True)
class RotationSettings(ProtocolSettings):
    """Table 9's conditions always run (90, 180 and 270 degrees, upside-down); the sweep's default
    of 30 degrees holds them and is the study's and ``eval rotation``'s."""

    angle_step: float = setting(DEFAULT_ANGLE_STEP, "rotation sweep every this many degrees, bilinear with zero fill "
                                      "(0: none)")
    no_hflip: bool = setting(False, "leave out the left-right flip (the study always runs it)", scope="eval")

    def check(self, study) -> None:
        if not 0 <= self.angle_step < 360:
            raise ValueError(f"angle_step must be in [0, 360) degrees (0: no sweep), got {self.angle_step}")


def _passes(config) -> Passes:
    return Passes(forward=len(rotation_conditions(config.angle_step)))


@study_protocol("rotation", summary="SAN Table 9's rotations and flips, the left-right flip and an angle sweep",
                describe=_describe, default_order=0, settings=RotationSettings, passes=_passes)
def study_rotation(ctx, entry, model):
    """The study's rotation step: every image of the study, ``config.angle_step`` sweep."""
    out = ctx.run_dir("rotation", entry.name)
    run_rotation(model, ctx.dataset, out, conditions=rotation_conditions(ctx.config.angle_step),
                 batch_size=ctx.config.batch_size, device=ctx.device, run_info=ctx.run_info(entry, model),
                 progress=ctx.progress, **ctx.shard)
    return out


def _summary(ctx, settings, store) -> str:
    from robust_attn.runs.store import load_records

    summary = summarize_rotation(load_records(store.root)).set_index("condition")
    parts = [f"{c} {summary.loc[c, 'top1']:.1f}({summary.loc[c, 'top1_drop']:.1f})"
             for c in ("cw90", "cw180", "cw270", "flip_ud")]
    return (f"top-1 {summary.loc['none', 'top1']:.1f}, top-1(drop): {', '.join(parts)}")


@eval_protocol("rotation", settings=RotationSettings, summary=_summary,
               help="test-time rotations and flips (SAN Table 9) plus an angle sweep")
def eval_rotation(ctx, model, settings):
    """``robust-attn eval rotation``: Table 9's conditions, the flip and the sweep on one model."""
    conditions = rotation_conditions(settings.angle_step, hflip=not settings.no_hflip)
    return run_rotation(model, ctx.dataset, ctx.out, conditions=conditions, **ctx.loop)
