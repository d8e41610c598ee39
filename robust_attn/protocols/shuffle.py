"""Patch shuffling (Naseer et al., NeurIPS 2021, section 3.3): top-1 with each image cut into a
g x g grid and its patches permuted (one seeded permutation per image), per image, with the
clean images as the first condition. ``shuffle1`` (one patch) is the identity: a built-in check
that it scores the clean accuracy. The shuffling itself: :mod:`robust_attn.shifts.shuffle`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from robust_attn.protocols.eval_step import eval_protocol
from robust_attn.protocols.study_step import Passes, study_protocol
from robust_attn.protocols.settings import ProtocolSettings, setting, study_image_size
from robust_attn.protocols.shift_runner import CLEAN, accuracy_by_condition, run_shift
from robust_attn.shifts.occlusion import check_grid
from robust_attn.shifts.shuffle import shuffle_patches

__all__ = ["PROTOCOL", "DEFAULT_GRIDS", "shuffle_conditions", "run_shuffle", "summarize_shuffle"]

PROTOCOL = "shuffle"
DEFAULT_GRIDS = (1, 2, 4, 8)


def shuffle_conditions(grids=DEFAULT_GRIDS, image_size: tuple[int, int] | None = None) -> list[dict]:
    """``clean``, then ``shuffle<g>`` per grid; ``image_size`` (H, W) checks that g divides it."""
    conditions = [{"name": CLEAN, "grid": 0}]
    for g in grids:
        g = check_grid(g, *(image_size or (None, None)))
        conditions.append({"name": f"shuffle{g}", "grid": g})
    if len(conditions) == 1:
        raise ValueError("give at least one grid size")
    return conditions


def run_shuffle(model: nn.Module, dataset, out_dir, *, conditions: list[dict], seed: int = 0, batch_size: int = 64,
                device="cpu", run_info: dict | None = None, rank: int = 0, world_size: int = 1, num_workers: int = 0,
                progress: bool = True, repair: bool = False):
    """Run (or resume) the patch-shuffle protocol; returns the RunStore."""
    grids = {c["name"]: c["grid"] for c in conditions}

    def shift(name, images, indices, labels):
        return shuffle_patches(images, grids[name], indices.tolist(), seed)

    return run_shift(PROTOCOL, model, dataset, out_dir, conditions=conditions, shift=shift,
                     parameters={"seed": seed}, batch_size=batch_size, device=device, run_info=run_info, rank=rank,
                     world_size=world_size, num_workers=num_workers, progress=progress, repair=repair)


def summarize_shuffle(records, conditions: list[dict]):
    """Per condition: grid (0 for clean), n, top1, top5."""
    summary = accuracy_by_condition(records)
    grids = {c["name"]: c["grid"] for c in conditions}
    summary.insert(1, "grid", [grids[n] for n in summary["condition"]])
    return summary


def _describe(config) -> str:
    grids = ", ".join(f"{g}x{g}" for g in config.shuffle_grids)
    return f"Patch shuffle: {grids} grids (seed {config.shift_seed})."


@dataclass(frozen=True)
class ShuffleSettings(ProtocolSettings):
    shuffle_grids: tuple[int, ...] = setting(DEFAULT_GRIDS, "patch shuffle: grid sizes g, comma list; each must "
                                                            "divide the image size", eval_option="grids")
    shift_seed: int = setting(0, "seed of the per-image permutations (the study's: shift_seed)", scope="eval")

    def check(self, study) -> None:
        shuffle_conditions(self.shuffle_grids, image_size=study_image_size(study))


@eval_protocol("shuffle", settings=ShuffleSettings, help="patch shuffling on a g x g grid (Naseer et al. 2021)")
def eval_shuffle(ctx, model, settings):
    """``robust-attn eval shuffle`` on one model."""
    conditions = shuffle_conditions(settings.shuffle_grids, image_size=(ctx.info.image_size,) * 2)
    return run_shuffle(model, ctx.dataset, ctx.out, conditions=conditions, seed=settings.shift_seed, **ctx.loop)


def _passes(config) -> Passes:
    return Passes(forward=len(shuffle_conditions(config.shuffle_grids)))


@study_protocol("shuffle", summary="Naseer et al.'s patch shuffling on g x g grids (g = 1, 2, 4, 8)",
                describe=_describe, settings=ShuffleSettings, passes=_passes)
def study_shuffle(ctx, entry, model):
    """The study's shuffle step: ``config.shuffle_grids`` (default 1, 2, 4, 8), seed
    ``config.shift_seed``."""
    config = ctx.config
    conditions = shuffle_conditions(config.shuffle_grids, image_size=(ctx.info.image_size, ctx.info.image_size))
    out = ctx.run_dir(PROTOCOL, entry.name)
    run_shuffle(model, ctx.dataset, out, conditions=conditions, seed=config.shift_seed,
                batch_size=config.batch_size, device=ctx.device, run_info=ctx.run_info(entry, model),
                progress=ctx.progress, **ctx.shard)
    return out
