"""Zero-shot rotation and flipping (SAN, Zhao et al. 2020, section 5.4 and Table 9).

The paper tests on the validation images unchanged, rotated *clockwise* by 90, 180 and 270
degrees, and flipped upside-down (about the horizontal axis), and reports top-1 / top-5 with the
drop from the unrotated result in percentage points. Beyond the paper this module adds the
left-right flip and an angle sweep.

Choices where the paper is silent:

* The exact conditions use index permutations (no interpolation): clockwise by 90 degrees is
  ``out[i, j] = in[H - 1 - j, i]``. Note ``torch.rot90(x, 1, (H, W))`` turns *counter*-clockwise,
  so clockwise is ``k = -1``.
* The rotation is applied to the already preprocessed (resized and centre-cropped) test image,
  so the 90-degree conditions permute exactly the pixels the unrotated condition sees.
* Angle sweep: rotation about the image centre with bilinear interpolation and zeros (black,
  before normalization) filling the corners that fall outside the source; the output keeps the
  input size (corners of the source are cut). Angles that are multiples of 90 are the exact
  conditions and are not repeated in the sweep.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterator

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F

from robust_attn.distributed import barrier
from robust_attn.protocols.study_step import study_protocol
from robust_attn.protocols.runner import finite_logits, open_run, run_chunks, topk_hits

__all__ = ["RotationCondition", "PAPER_CONDITIONS", "rotation_conditions", "rotate_clockwise",
           "flip_upside_down", "flip_left_right", "rotate_angle", "apply_condition",
           "make_evaluator", "summarize_rotation", "run_rotation", "PROTOCOL"]

PROTOCOL = "rotation"


@dataclass(frozen=True)
class RotationCondition:
    """One test-time manipulation. ``kind``: ``identity``, ``rot90`` (exact, clockwise by
    ``angle`` in {90, 180, 270}), ``flip_ud``, ``flip_lr`` or ``angle`` (interpolated, clockwise
    by ``angle`` degrees)."""

    name: str
    kind: str
    angle: float = 0.0
    interpolation: str = "none"
    fill: str = "none"

    def as_dict(self) -> dict:
        return asdict(self)


PAPER_CONDITIONS = (
    RotationCondition("none", "identity", 0.0),
    RotationCondition("cw90", "rot90", 90.0),
    RotationCondition("cw180", "rot90", 180.0),
    RotationCondition("cw270", "rot90", 270.0),
    RotationCondition("flip_ud", "flip_ud", 0.0),
)


def rotation_conditions(angle_step: float = 15.0, hflip: bool = True) -> list[RotationCondition]:
    """The paper's five conditions (Table 9), then the left-right flip (if ``hflip``), then the
    sweep ``angle_step, 2 * angle_step, ... < 360`` without multiples of 90 (``angle_step=0``:
    no sweep)."""
    conditions = list(PAPER_CONDITIONS)
    if hflip:
        conditions.append(RotationCondition("flip_lr", "flip_lr", 0.0))
    if angle_step < 0 or angle_step >= 360:
        raise ValueError(f"--angle-step must be in [0, 360) degrees (0 turns the sweep off), got {angle_step}")
    if angle_step:
        k = 1
        while k * angle_step < 360 - 1e-9:
            angle = round(k * angle_step, 6)
            if abs(angle / 90 - round(angle / 90)) > 1e-9:
                conditions.append(RotationCondition(f"angle{angle:g}", "angle", float(angle),
                                                    "bilinear", "zeros"))
            k += 1
    return conditions


def rotate_clockwise(images: torch.Tensor, quarter_turns: int) -> torch.Tensor:
    """Rotate (..., H, W) images clockwise by ``quarter_turns`` x 90 degrees, exactly."""
    return torch.rot90(images, k=-quarter_turns, dims=(-2, -1))


def flip_upside_down(images: torch.Tensor) -> torch.Tensor:
    """Mirror about the horizontal axis (top row becomes the bottom row)."""
    return images.flip(-2)


def flip_left_right(images: torch.Tensor) -> torch.Tensor:
    return images.flip(-1)


def rotate_angle(images: torch.Tensor, degrees: float) -> torch.Tensor:
    """Rotate (N, C, H, W) images clockwise by ``degrees`` about the centre; bilinear, zero fill.

    Output pixel at centred pixel coordinates p (x right, y down) takes the input at R(-theta) p,
    where R(theta) = [[cos, -sin], [sin, cos]] turns clockwise on screen (y points down).
    Works in pixel units, so non-square images rotate without shearing.
    """
    n, _, h, w = images.shape
    t = math.radians(degrees)
    c, s = math.cos(t), math.sin(t)
    # normalized coords u = x / (W/2), v = y / (H/2); x_in = c x + s y, y_in = -s x + c y.
    theta = torch.tensor([[c, s * h / w, 0.0], [-s * w / h, c, 0.0]], dtype=images.dtype,
                         device=images.device).expand(n, 2, 3)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def apply_condition(images: torch.Tensor, condition: RotationCondition) -> torch.Tensor:
    if condition.kind == "identity":
        return images
    if condition.kind == "rot90":
        return rotate_clockwise(images, int(round(condition.angle / 90)))
    if condition.kind == "flip_ud":
        return flip_upside_down(images)
    if condition.kind == "flip_lr":
        return flip_left_right(images)
    if condition.kind == "angle":
        return rotate_angle(images, condition.angle)
    raise ValueError(f"unknown rotation condition kind {condition.kind!r}")


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


@study_protocol("rotation", summary="SAN Table 9's rotations and flips, the left-right flip and an angle sweep",
                describe=_describe)
def study_rotation(ctx, entry, model):
    """The study's rotation step: every image of the study, ``config.angle_step`` sweep."""
    out = ctx.run_dir("rotation", entry.name)
    run_rotation(model, ctx.dataset, out, conditions=rotation_conditions(ctx.config.angle_step),
                 batch_size=ctx.config.batch_size, device=ctx.device, run_info=ctx.run_info(entry, model),
                 progress=ctx.progress, **ctx.shard)
    return out
