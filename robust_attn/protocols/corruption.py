"""Common corruptions (Hendrycks & Dietterich, ICLR 2019): top-1 under each corruption and
severity, per image, with the clean images as the first condition.

Conditions: ``clean`` then ``<corruption>_s<severity>`` (e.g. ``gaussian_noise_s3``) for every
corruption and severity asked for, each with its ``corruption`` and ``severity`` in run.json.
The images come from a source (:mod:`robust_attn.shifts.cache`): made on the fly per chunk
(:class:`~robust_attn.shifts.cache.OnTheFly`, seeded per image), read from a corrupted copy
made once per study (:class:`~robust_attn.shifts.cache.CorruptionCache`: the same bytes), or
read from the published CIFAR-10-C / ImageNet-C files
(:class:`~robust_attn.shifts.published.PublishedCorruptions`). CE and mCE against a baseline
model: :mod:`robust_attn.shifts.metrics`, in the report (:mod:`robust_attn.reports.shifts`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

from robust_attn.protocols.eval_step import eval_protocol
from robust_attn.protocols.study_step import Passes, study_protocol
from robust_attn.protocols.settings import ProtocolSettings, is_eval, setting
from robust_attn.runs.store import RunStore
from robust_attn.shifts.cache import CorruptionCache, OnTheFly, to_float
from robust_attn.shifts.corruptions import SEVERITIES, check_severity, corruption_names
from robust_attn.protocols.shift_runner import CLEAN, accuracy_by_condition, run_shift

__all__ = ["PROTOCOL", "corruption_conditions", "run_corruption", "summarize_corruption", "check_frost"]

PROTOCOL = "corruption"
IMPLEMENTATION = "robust_attn.shifts.corruptions (ImageNet-C parameters as in imagecorruptions 1.1.2; uint8 truncation)"


def corruption_conditions(names, severities=SEVERITIES) -> list[dict]:
    """``clean`` then every (corruption, severity); ``names`` as :func:`corruption_names` takes
    them (a string such as ``common`` or ``noise,frost``, or a list of names)."""
    names = corruption_names(names) if isinstance(names, str) else [corruption_names(n)[0] for n in names]
    severities = [check_severity(s) for s in severities]
    if not severities:
        raise ValueError("give at least one severity (1-5)")
    return [{"name": CLEAN, "corruption": CLEAN, "severity": 0}] + [
        {"name": f"{n}_s{s}", "corruption": n, "severity": s} for n in names for s in severities]


def check_frost(conditions: list[dict]) -> None:
    """A clear error before any work when frost is asked for without its photographs."""
    if any(c["corruption"] == "frost" for c in conditions):
        from robust_attn.shifts.corruptions.weather import frost_dir

        frost_dir()


def run_corruption(model: nn.Module, dataset, out_dir, *, conditions: list[dict], seed: int = 0, source=None,
                   images: str = "generated", batch_size: int = 64, device="cpu", run_info: dict | None = None,
                   rank: int = 0, world_size: int = 1, num_workers: int = 0, progress: bool = True,
                   repair: bool = False):
    """Run (or resume) the corruption protocol; returns the RunStore. ``source``: where the
    corrupted images come from (default: made on the fly with ``seed``); ``images`` names it in
    run.json (``generated`` for on the fly and the study's cache alike, which are the same
    images; ``cifar10-c`` / ``imagenet-c`` for the published files)."""
    if images == "generated" and not isinstance(source, CorruptionCache):   # a cache made its images already
        check_frost(conditions)
    source = source or OnTheFly(seed)
    by_name = {c["name"]: c for c in conditions}

    def shift(name, batch, indices, labels):
        c = by_name[name]
        kwargs = {"labels": labels} if images != "generated" else {}
        return to_float(source(c["corruption"], c["severity"], batch, indices, **kwargs), batch.device)

    parameters = {"images": images, "seed": seed if images == "generated" else None,
                  "implementation": IMPLEMENTATION if images == "generated" else None}
    return run_shift(PROTOCOL, model, dataset, out_dir, conditions=conditions, shift=shift, parameters=parameters,
                     batch_size=batch_size, device=device, run_info=run_info, rank=rank, world_size=world_size,
                     num_workers=num_workers, progress=progress, repair=repair)


def summarize_corruption(records, conditions: list[dict]):
    """Per condition: corruption, severity, n, top1, top5 (percent)."""
    summary = accuracy_by_condition(records)
    by_name = {c["name"]: c for c in conditions}
    summary.insert(1, "corruption", [by_name[n]["corruption"] for n in summary["condition"]])
    summary.insert(2, "severity", [by_name[n]["severity"] for n in summary["condition"]])
    return summary


def _describe(config) -> str:
    return (f"Corruptions: `{config.corruptions}` at severities {', '.join(map(str, config.severities))} "
            f"(seed {config.shift_seed}).")


@dataclass(frozen=True)
class CorruptionSettings(ProtocolSettings):
    """The study makes the corrupted images once per study, in ``<runs>/corruptions``, with its
    ``shift_seed``; ``eval corruption`` makes them on the fly, in ``--cache`` or reads the
    published ones, and may print mCE against a baseline run."""

    corruptions: str = setting("common", "common (the 15 of ImageNet-C), extra (speckle_noise, gaussian_blur, "
                                         "spatter, saturate), all, a family (noise, blur, weather, digital) or names, "
                                         "comma list (frost needs `pip install imagecorruptions` for its photographs)")
    severities: tuple[int, ...] = setting(SEVERITIES, "corruption severities 1-5, comma list")
    shift_seed: int = setting(0, "seed of the per-image corruptions (the study's: shift_seed)", scope="eval")
    cache: str | None = setting(None, "make the corrupted images once in this folder and read them from there "
                                      "(reused by every model evaluated with the same folder, data and seed)",
                                scope="eval")
    published: str | None = setting(None, "read the corrupted images from the published CIFAR-10-C .npy files or the "
                                          "ImageNet-C folder tree in this folder instead of making them", scope="eval")
    baseline: str | None = setting(None, "a finished corruption run of the baseline model: print CE and mCE against "
                                         "it", scope="eval")

    def check(self, study) -> None:
        conditions = corruption_conditions(self.corruptions, self.severities)   # ValueError naming what is wrong
        if not is_eval(study):
            return   # the study checks frost where it makes the images
        if self.published and self.cache:
            raise ValueError("--published reads the published files; --cache is for images made here: give one")
        if self.published:
            from robust_attn.shifts.published import published_reader

            if not Path(self.published).is_dir():
                raise ValueError(f"--published {self.published} is not a folder")
            published_reader(study.dataset, self.published)
        else:
            check_frost(conditions)
        if self.baseline and not (Path(self.baseline) / "run.json").is_file():
            raise ValueError(f"--baseline {self.baseline} is not a run directory (no run.json)")


def _passes(config) -> Passes:
    return Passes(forward=len(corruption_conditions(config.corruptions, config.severities)))


@study_protocol("corruption", summary="Hendrycks & Dietterich's common corruptions at severities 1-5 (mCE against "
                                      "the baseline), from corrupted images made once per study", describe=_describe,
                settings=CorruptionSettings, passes=_passes)
def study_corruption(ctx, entry, model):
    """The study's corruption step: ``config.corruptions`` (default the 15 common ones) at
    ``config.severities`` (default 1-5) with ``config.shift_seed`` (default 0), every image of
    the study; the corrupted images are made once, in ``<runs>/corruptions``, for every model."""
    config = ctx.config
    conditions = corruption_conditions(config.corruptions, config.severities)
    seed = config.shift_seed
    run_info = ctx.run_info(entry, model)
    out = ctx.run_dir(PROTOCOL, entry.name)
    store = RunStore(out)   # only the conditions still missing need corrupted images (a finished run: none)
    todo = {c for c, _, _ in store.missing()} if store.exists() else {c["name"] for c in conditions}
    needed = [c for c in conditions[1:] if c["name"] in todo]
    check_frost(needed)
    key = {**ctx.base_info["dataset"], "preprocessing": run_info.get("preprocessing")}   # one cache per preprocessing
    cache = CorruptionCache(ctx.runs_dir / "corruptions", ctx.dataset, key, seed=seed, batch_size=config.batch_size)
    if needed:
        cache.ensure([(c["corruption"], c["severity"]) for c in needed], log=ctx.log if ctx.rank == 0 else None)
    run_corruption(model, ctx.dataset, out, conditions=conditions, seed=seed, source=cache,
                   batch_size=config.batch_size, device=ctx.device, run_info=run_info,
                   progress=ctx.progress, **ctx.shard)
    return out


def _images(ctx, settings) -> tuple:
    """The corrupted-image source of ``eval corruption`` and its name in run.json."""
    data = ctx.data
    if settings.published:
        from robust_attn.data import build_dataset
        from robust_attn.data.splits import subset_indices
        from robust_attn.shifts.published import PublishedCorruptions, published_reader

        reader = published_reader(data["name"], settings.published)
        full = len(build_dataset(data["name"], root=data["root"], split=data["split"])) if data["limit"] else None
        positions = subset_indices(full, data["limit"]) if full else None
        return PublishedCorruptions(reader, positions), ("imagenet-c" if data["name"] == "imagenet"
                                                         else f"{data['name']}-c")
    if settings.cache:
        key = {k: data[k] for k in ("name", "split", "limit")}
        return CorruptionCache(settings.cache, ctx.dataset, key, seed=settings.shift_seed,
                               batch_size=ctx.batch_size), "generated"
    return OnTheFly(settings.shift_seed), "generated"


def _summary(ctx, settings, store) -> str:
    from robust_attn.runs.store import load_records
    from robust_attn.shifts.baseline import mce_line

    conditions = corruption_conditions(settings.corruptions, settings.severities)
    records = load_records(store.root)
    summary = summarize_corruption(records, conditions)
    corrupted = summary[summary["severity"] > 0]
    per_severity = corrupted.groupby("severity")["top1"].mean()
    line = (f"clean top-1 {summary.loc[0, 'top1']:.1f}; mean top-1 over {corrupted['corruption'].nunique()} "
            f"corruption(s): " + ", ".join(f"s{s} {v:.1f}" for s, v in per_severity.items()))
    if settings.baseline:
        line += "\n" + mce_line(records, conditions, Path(settings.baseline))
    return line


@eval_protocol("corruption", settings=CorruptionSettings, summary=_summary,
               help="common corruptions (Hendrycks & Dietterich 2019) at severities 1-5")
def eval_corruption(ctx, model, settings):
    """``robust-attn eval corruption`` on one model."""
    from robust_attn.shifts.baseline import check_baseline

    conditions = corruption_conditions(settings.corruptions, settings.severities)
    source, images = _images(ctx, settings)
    if settings.baseline:
        check_baseline(Path(settings.baseline), ctx.run_info, images, settings.shift_seed)
    if hasattr(source, "ensure"):
        source.ensure([(c["corruption"], c["severity"]) for c in conditions[1:]], repair=ctx.repair,
                      log=print if ctx.rank == 0 else None)
    return run_corruption(model, ctx.dataset, ctx.out, conditions=conditions, seed=settings.shift_seed,
                          source=source, images=images, **ctx.loop)
