"""The runs a report reads: each run directory's description and merged per-image records
(:class:`Run`), finished runs (:func:`load_runs`) or what is finished of unfinished ones
(:func:`load_finished`), the checks that no condition of one model comes from two runs
(:func:`check_one_result_per_condition`) and that runs of one dataset read the same data
(:func:`check_one_variant_per_dataset`), and row labels and names that tell apart runs of one
model (:func:`run_labels`, :func:`model_names`)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from robust_attn.runs.store import RunStore, load_description, load_records

__all__ = ["Run", "PARTIAL_PROTOCOLS", "load_runs", "load_finished", "check_one_result_per_condition",
           "check_one_variant_per_dataset", "model_key", "run_labels", "distinct_labels", "model_names",
           "weights_label"]


#: The conditions every run of a protocol has as its own baseline (the unattacked, unshifted or
#: unrotated images): runs of one model may each hold theirs.
BASELINE_CONDITIONS = frozenset({"clean", "none"})

#: Protocols whose conditions each stand alone, so that a report may show the finished ones of an
#: unfinished run (:func:`load_finished`): an attack's radii. Rotation, Table 10's PGD and the
#: shifts average or pair their conditions, so a partial report leaves their unfinished runs out.
PARTIAL_PROTOCOLS = ("attack",)


@dataclass
class Run:
    """A run directory: its description and merged records (of a finished run, or of the
    finished conditions of an unfinished one, which ``unfinished`` then names)."""

    path: Path
    description: dict
    records: pd.DataFrame
    unfinished: tuple[str, ...] = ()

    @property
    def protocol(self) -> str:
        return self.description["protocol"]

    @property
    def model(self) -> str:
        return self.description["model"]

    @property
    def dataset(self) -> str:
        return self.description["dataset"]["name"]

    @property
    def trained(self) -> bool:
        """False only for a model known to have random weights (``weights_origin``; runs recorded
        before it: no checkpoint), never for a user's module of unknown origin."""
        from robust_attn.sources.provenance import is_random

        return not is_random(self.description)

    @property
    def num_classes(self) -> int | None:
        """The dataset's class count: recorded in the run, else the registered dataset's, else
        (an unregistered dataset) a lower bound from the labels and predictions seen."""
        for where in (self.description, self.description.get("dataset") or {}):
            if where.get("num_classes"):
                return int(where["num_classes"])
        from robust_attn.data import dataset_info

        try:
            return dataset_info(self.dataset).num_classes
        except (KeyError, ValueError):
            seen = [c for c in ("label", "pred", "target") if c in self.records]
            return int(self.records[seen].max().max()) + 1 if seen and len(self.records) else None

    @property
    def top5_meaningful(self) -> bool:
        """Top-5 says something only with more than 5 classes (with 5 or fewer it is 100%)."""
        return self.num_classes is None or self.num_classes > 5


def load_runs(paths) -> list[Run]:
    """The finished runs at ``paths`` (an unfinished one is an error naming the command that
    finishes it)."""
    return [Run(Path(p), load_description(p), load_records(p)) for p in paths]


def load_finished(paths) -> tuple[list[Run], list[Path]]:
    """What is finished at ``paths``: every finished run, and of an unfinished run of a
    :data:`PARTIAL_PROTOCOLS` protocol the conditions whose every chunk is written (each over all
    of its images; its ``unfinished`` names the others). Returns those runs and the unfinished
    runs of other protocols, left out whole."""
    runs, left_out = [], []
    for path in map(Path, paths):
        store = RunStore(path)
        description, missing = store.description(), store.missing()
        if missing and description["protocol"] not in PARTIAL_PROTOCOLS:
            left_out.append(path)
            continue
        records, unfinished = store.finished_records(missing)
        runs.append(Run(path, description, records, unfinished))
    return runs, left_out


def check_one_result_per_condition(runs: list[Run]) -> None:
    """Refuse runs that hold the same condition of one model, with the same weights, on the same
    dataset description (name, split, limit; a seeded attack subset of another size counts too):
    the report gives one result per model and condition, and would otherwise count the images
    twice or keep whichever run came first (e.g. a packed copy given beside the run it was packed
    from). Each run's own baseline condition (:data:`BASELINE_CONDITIONS`) is exempt."""
    seen: dict[tuple, Run] = {}
    for run in runs:
        key = (run.protocol, *model_key(run))
        conditions = run.records["condition"].unique() if len(run.records) else ()
        for condition in sorted(set(conditions) - BASELINE_CONDITIONS):
            other = seen.setdefault((*key, condition), run)
            if other is not run:
                raise ValueError(
                    f"{other.path} and {run.path} both hold {run.protocol} condition {condition!r} of "
                    f"{run.model} with the same weights on the same dataset and split; a report gives one "
                    f"result per model and condition, so give one of the two runs (a packed copy and the run it was "
                    f"packed from are the same run; `robust-attn diff {other.path} {run.path}` compares two)")


def check_one_variant_per_dataset(runs: list[Run]) -> None:
    """Refuse runs of one split of one dataset that read different data (``data_variant``, e.g.
    CIFAR-10's canonical pixels ``cifar10`` and its quality-75 JPEG copy ``cifar10-jpeg``): the
    report pairs models image by image, and the same index would be other pixels. Runs recorded
    before the variant was (none recorded) pass."""
    variants: dict[tuple[str, str], dict[str, list[Path]]] = {}
    for run in runs:
        if run.description.get("data_variant"):
            split = str((run.description.get("dataset") or {}).get("split", ""))
            variants.setdefault((run.dataset, split), {}).setdefault(
                run.description["data_variant"], []).append(run.path)
    for (dataset, split), held in variants.items():
        if len(held) > 1:
            which = "; ".join(f"{variant}: {', '.join(map(str, paths))}" for variant, paths in held.items())
            raise ValueError(
                f"runs of {dataset} ({split}) read different data ({which}); the report compares models "
                f"image by image, and these are not the same pixels: report each variant separately, or evaluate "
                f"every model on one (--root names the data)")


# --- row labels ------------------------------------------------------------------------------
def _base_label(model: str, dataset: str, trained: bool) -> str:
    label = model + ("" if trained else " [random weights]")
    return label if dataset == "imagenet" else f"{label} [{dataset}]"


def weights_label(run: Run) -> str:
    """The run's weights, short: ``ckpt 1a2b3c4d`` (checkpoints, by sha256), ``weights ...`` (a
    model from elsewhere, by the sha256 of its state) or ``init seed N`` (random weights)."""
    checkpoint = run.description.get("checkpoint")
    shas = [c.get("sha256") or "" for c in (checkpoint if isinstance(checkpoint, list) else [checkpoint or {}])]
    if any(shas):
        return "ckpt " + "+".join(sha[:8] for sha in shas)
    if run.description.get("weights_sha256"):
        return f"weights {run.description['weights_sha256'][:8]}"
    return f"init seed {run.description.get('init_seed')}"


def model_key(run: Run) -> tuple:
    """Runs with equal keys evaluated the same weights (a checkpoint's, a model from elsewhere's
    by the sha256 of its state, or a random initialization's) on the same dataset description."""
    return (run.model, json.dumps(run.description["dataset"], sort_keys=True), weights_label(run))


def _identity(runs: list[Run]) -> dict[str, str]:
    """What tells apart rows of one model on one dataset: split, image count, weights."""
    run = runs[0]
    described = run.description.get("dataset") or {}
    weights = weights_label(run)
    images = max((r.records["index"].nunique() if len(r.records) else int(r.description.get("num_images", 0)))
                 for r in runs)
    return {"split": str(described.get("split", "")), "images": f"n={images}", "weights": weights}


def distinct_labels(items: list[tuple[str, dict[str, str], str]]) -> list[str]:
    """Row labels that tell rows apart: ``items`` are (base label, identity, fallback name).

    Rows whose base label is shared get, in brackets, the identity entries that differ within
    that set (e.g. ``resnet26 [fashion_mnist] (n=2000)``, ``(ckpt 1a2b3c4d)``); rows still equal
    after that get their fallback name (the run directory)."""
    labels = [base for base, _, _ in items]
    for base in {b for b in labels if labels.count(b) > 1}:
        idx = [i for i, (b, _, _) in enumerate(items) if b == base]
        keys = [k for k in items[idx[0]][1] if len({items[i][1].get(k) for i in idx}) > 1]
        for i in idx:
            labels[i] = f"{base} ({', '.join(items[i][1][k] for k in keys)})" if keys else base
        clashing = [i for i in idx if sum(labels[j] == labels[i] for j in idx) > 1]
        for i in clashing:
            labels[i] = (labels[i][:-1] + f", {items[i][2]})") if keys else f"{base} ({items[i][2]})"
    return labels


def run_labels(groups: list[list[Run]]) -> list[str]:
    """One distinct label per group of runs (a group: runs of the same weights on the same images)."""
    return distinct_labels([(_base_label(g[0].model, g[0].dataset, g[0].trained), _identity(g),
                             "+".join(r.path.name for r in g)) for g in groups])


def model_names(runs: list[Run]) -> dict[int, str]:
    """The name the findings and the attack tables give each run's model, by ``id(run)``: the
    model's name, or, where runs of that name on one dataset hold different weights, the name
    with the weights (``resnet26 (ckpt 1a2b3c4d)``), so that two checkpoints are never merged
    into one row or one column of paired losses."""
    held: dict[tuple[str, str], set[str]] = {}
    for run in runs:
        held.setdefault((run.model, run.dataset), set()).add(weights_label(run))
    return {id(run): run.model if len(held[(run.model, run.dataset)]) == 1 else f"{run.model} ({weights_label(run)})"
            for run in runs}
