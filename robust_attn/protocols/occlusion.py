"""Occlusion (Naseer et al., NeurIPS 2021, section 3.1): top-1 with a random square covering k%
of each image, and with a random fraction of the cells of a g x g grid dropped ("PatchDrop"),
filled with zeros or with the dataset's mean colour; per image, with the clean images as the
first condition. The occlusions themselves: :mod:`robust_attn.shifts.occlusion`.

Conditions: ``clean``; ``square<k>_<fill>`` (e.g. ``square25_zeros``) for every area k and fill;
``drop<g>x<g>_<f>_<fill>`` (e.g. ``drop4x4_50_mean``) for every grid g and dropped percentage f.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from robust_attn.protocols.eval_step import eval_protocol
from robust_attn.protocols.study_step import Passes, study_protocol
from robust_attn.protocols.settings import ProtocolSettings, setting, study_image_size
from robust_attn.protocols.shift_runner import CLEAN, accuracy_by_condition, run_shift
from robust_attn.shifts.occlusion import check_area, check_grid, drop_patches, occlude_square, square_side

__all__ = ["PROTOCOL", "DEFAULT_AREAS", "DEFAULT_DROP", "FILLS", "occlusion_conditions", "run_occlusion",
           "summarize_occlusion"]

PROTOCOL = "occlusion"
DEFAULT_AREAS = (10.0, 25.0, 50.0, 75.0)
DEFAULT_DROP = (25.0, 50.0, 75.0)       # percent of grid cells dropped, as Naseer et al.'s Figure 3
DEFAULT_DROP_GRID = 4
FILLS = ("zeros", "mean")


def occlusion_conditions(areas=DEFAULT_AREAS, fills=FILLS, drop=DEFAULT_DROP, drop_grid: int = DEFAULT_DROP_GRID,
                         image_size: tuple[int, int] | None = None) -> list[dict]:
    """``clean``, then the squares and the grid drops; ``image_size`` (H, W) checks that the
    squares fit and the grid divides the image."""
    for fill in fills:
        if fill not in FILLS:
            raise ValueError(f"fill must be one of {FILLS}, got {fill!r}")
    conditions = [{"name": CLEAN, "kind": CLEAN}]
    for k in areas:
        k = check_area(k)
        side = square_side(k, *image_size) if image_size else None
        conditions += [{"name": f"square{k:g}_{fill}", "kind": "square", "percent": k, "fill": fill, "side": side}
                       for fill in fills]
    if drop:
        if image_size:
            check_grid(drop_grid, *image_size)
        for f in drop:
            f = check_area(f, "dropped fraction")
            conditions += [{"name": f"drop{drop_grid}x{drop_grid}_{f:g}_{fill}", "kind": "drop", "grid": int(drop_grid),
                            "percent": f, "fill": fill} for fill in fills]
    return conditions


def run_occlusion(model: nn.Module, dataset, out_dir, *, conditions: list[dict], mean, seed: int = 0,
                  batch_size: int = 64, device="cpu", run_info: dict | None = None, rank: int = 0, world_size: int = 1,
                  num_workers: int = 0, progress: bool = True, repair: bool = False):
    """Run (or resume) the occlusion protocol; ``mean``: the per-channel colour of ``fill="mean"``
    (the dataset's mean). Returns the RunStore."""
    by_name = {c["name"]: c for c in conditions}
    mean = [float(m) for m in mean]

    def shift(name, images, indices, labels):
        c = by_name[name]
        fill = "zeros" if c["fill"] == "zeros" else mean
        if c["kind"] == "square":
            return occlude_square(images, c["percent"], indices.tolist(), seed, fill)
        return drop_patches(images, c["grid"], c["percent"], indices.tolist(), seed, fill)

    return run_shift(PROTOCOL, model, dataset, out_dir, conditions=conditions, shift=shift,
                     parameters={"seed": seed, "mean_fill": mean}, batch_size=batch_size, device=device,
                     run_info=run_info, rank=rank, world_size=world_size, num_workers=num_workers, progress=progress,
                     repair=repair)


def summarize_occlusion(records, conditions: list[dict]):
    """Per condition: kind, percent, fill, n, top1, top5."""
    summary = accuracy_by_condition(records)
    by_name = {c["name"]: c for c in conditions}
    for pos, key in enumerate(("kind", "percent", "fill"), start=1):
        summary.insert(pos, key, [by_name[n].get(key, 0.0 if key == "percent" else "") for n in summary["condition"]])
    return summary


def _describe(config) -> str:
    areas = ", ".join(f"{a:g}" for a in config.occlusion_areas)
    return f"Occlusion: a square of {areas}% and PatchDrop, zero and mean fill (seed {config.shift_seed})."


@dataclass(frozen=True)
class OcclusionSettings(ProtocolSettings):
    """The study runs both fills and PatchDrop of 25, 50 and 75% of a 4 x 4 grid; ``eval
    occlusion`` may change them. The seed: ``--shift-seed`` (the study's ``shift_seed``)."""

    occlusion_areas: tuple[float, ...] = setting(DEFAULT_AREAS, "occlusion: percent of the image one square covers, "
                                                                "comma list", eval_option="areas")
    fill: tuple[str, ...] = setting(FILLS, "zeros and/or mean (the dataset's mean colour), comma list", scope="eval")
    drop: str = setting(",".join(f"{d:g}" for d in DEFAULT_DROP), "percent of grid cells dropped, comma list; "
                                                                  "'none' for no PatchDrop", scope="eval")
    drop_grid: int = setting(DEFAULT_DROP_GRID, "PatchDrop grid: g x g cells", scope="eval")
    shift_seed: int = setting(0, "seed of the per-image positions (the study's: shift_seed)", scope="eval")

    def drop_percents(self) -> list[float]:
        text = str(self.drop).strip().lower()
        if text in ("none", "0", ""):
            return []
        try:
            return [float(d) for d in text.split(",")]
        except ValueError:
            raise ValueError(f"--drop takes percents, comma list (e.g. 25,50,75), or 'none'; got {self.drop!r}") \
                from None

    def conditions(self, image_size) -> list[dict]:
        return occlusion_conditions(self.occlusion_areas, self.fill, self.drop_percents(), self.drop_grid,
                                    image_size=image_size)

    def check(self, study) -> None:
        self.conditions(study_image_size(study))


@eval_protocol("occlusion", settings=OcclusionSettings,
               help="random square occlusion and grid PatchDrop (Naseer et al. 2021)")
def eval_occlusion(ctx, model, settings):
    """``robust-attn eval occlusion`` on one model."""
    return run_occlusion(model, ctx.dataset, ctx.out, conditions=settings.conditions((ctx.info.image_size,) * 2),
                         mean=ctx.info.mean, seed=settings.shift_seed, **ctx.loop)


def _passes(config) -> Passes:
    return Passes(forward=len(occlusion_conditions(config.occlusion_areas)))


@study_protocol("occlusion", summary="Naseer et al.'s random occlusion: a square of k% and grid PatchDrop, zero "
                                     "and mean fill", describe=_describe, settings=OcclusionSettings, passes=_passes)
def study_occlusion(ctx, entry, model):
    """The study's occlusion step: ``config.occlusion_areas`` (default 10, 25, 50, 75%), both
    fills, PatchDrop of 25/50/75% of a 4 x 4 grid, seed ``config.shift_seed``."""
    config = ctx.config
    conditions = occlusion_conditions(config.occlusion_areas, image_size=(ctx.info.image_size, ctx.info.image_size))
    out = ctx.run_dir(PROTOCOL, entry.name)
    run_occlusion(model, ctx.dataset, out, conditions=conditions, mean=ctx.info.mean,
                  seed=config.shift_seed, batch_size=config.batch_size, device=ctx.device,
                  run_info=ctx.run_info(entry, model), progress=ctx.progress, **ctx.shard)
    return out
