"""The report's model table: where each model came from.

One row per model (the runs of the same weights on the same data share it), labelled as in the
other tables: its source and spec (:mod:`robust_attn.sources`), where its weights came from with
their sha256 (shortened), the preprocessing its images went through, and its parameter count,
all read from the runs' ``run.json`` (:mod:`robust_attn.sources.provenance`), and the hardware
that computed its records (per chunk, :meth:`robust_attn.runs.store.RunStore.computed_on`: a run
started on a GPU and finished on a CPU, or resumed on another machine, says so). Runs recorded
before these keys existed show what they have (a zoo entry, a checkpoint hash) and ``-`` or "not
recorded" elsewhere.
"""
from __future__ import annotations

from collections import Counter

import pandas as pd

from robust_attn.reports.runs import Run, run_labels
from robust_attn.runs.store import RunStore

__all__ = ["model_table", "format_model_table", "computed_on", "MODELS_CAPTION", "describe_preprocessing"]

MODELS_CAPTION = ("Where each model came from: source and spec, weights (origin and sha256, first 12 hex "
                  "digits), the preprocessing of its images (resize of the shorter side, centre crop; the "
                  "normalization is inside the model), its parameters, and the hardware that computed its "
                  "records (the CPU's kernel level, fingerprint and threads, or the GPU; the record chunks of "
                  "each where there are several; runs started with the SAN and SASA layers on their "
                  "reference path say so).")


def describe_preprocessing(preprocessing: dict | None) -> str:
    """``resize 256 (bilinear), crop 224; mean 0.485/0.456/0.406, std ...``; ``None``: the dataset's
    own evaluation images."""
    if not preprocessing:
        return "the dataset's images"
    mean = "/".join(f"{m:.3g}" for m in preprocessing["mean"])
    std = "/".join(f"{s:.3g}" for s in preprocessing["std"])
    return (f"resize {preprocessing['resize_size']} ({preprocessing.get('interpolation', 'bilinear')}), "
            f"crop {preprocessing['crop_size']}; mean {mean}, std {std}")


def _source(description: dict) -> str:
    if description.get("source"):
        return str(description["source"])
    return "zoo" if description.get("zoo_entry") else "-"


def _weights(description: dict) -> tuple[str, str]:
    """(origin, sha256) of a run's weights."""
    checkpoint, sha = description.get("checkpoint"), description.get("weights_sha256")
    if not sha and isinstance(checkpoint, dict):
        sha = checkpoint.get("sha256")
    if not sha and isinstance(checkpoint, list):   # an ensemble (transfer sources)
        sha = "+".join((c or {}).get("sha256", "")[:12] for c in checkpoint)
    origin = description.get("weights_origin")
    if origin is None:   # recorded before weights_origin: a checkpoint, or random weights
        origin = "zoo" if description.get("zoo_entry") else "checkpoint" if sha else "random"
    return str(origin), sha or ""


def computed_on(runs: list[Run]) -> str:
    """The hardware that computed the runs' records (:meth:`robust_attn.runs.store.RunStore.computed_on`:
    ``cpu AVX512 96ccc860eb 1 thread``, or plain ``cpu`` for chunks written before entries named
    the hardware), with the chunks of each where there are several (``cpu ...: 4 chunks, cuda
    NVIDIA H200: 1 chunk``); ``not recorded`` for runs written before chunks named their device.
    Runs whose first start put the SAN / SASA layers on another than the default lean path
    (``attention_path`` in run.json, :mod:`robust_attn.layers.paths`) add ``; started on the
    reference attention path``."""
    counts = sum((Counter(RunStore(run.path).computed_on()) for run in runs), Counter())
    if not counts:
        where = "not recorded"
    elif len(counts) == 1:
        where = next(iter(counts))
    else:
        where = ", ".join(f"{d}: {n} chunk{'s' if n != 1 else ''}" for d, n in sorted(counts.items()))
    paths = sorted({getattr(run, "description", {}).get("attention_path") for run in runs} - {None, "lean"})
    return where + "".join(f"; started on the {p} attention path" for p in paths)


def model_table(runs: list[Run]) -> pd.DataFrame:
    """One row per model of ``runs``: ``label, model, source, spec, weights_origin,
    weights_sha256, preprocessing, params, protocols, computed_on``."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        origin, sha = _weights(run.description)
        key = (run.model, run.dataset, sha or run.description.get("init_seed"), origin)
        groups.setdefault(key, []).append(run)
    rows = []
    for label, group in zip(run_labels(list(groups.values())), groups.values()):
        d = _merged_description(group)
        origin, sha = _weights(d)
        params = d.get("params")
        rows.append({"label": label, "model": group[0].model, "source": _source(d), "spec": d.get("spec") or "",
                     "weights_origin": origin, "weights_sha256": sha,
                     "preprocessing": describe_preprocessing(d.get("preprocessing")),
                     "params": int(params) if params is not None else None,
                     "protocols": ", ".join(sorted({r.protocol for r in group})), "computed_on": computed_on(group)})
    return pd.DataFrame(rows, columns=["label", "model", "source", "spec", "weights_origin", "weights_sha256",
                                       "preprocessing", "params", "protocols", "computed_on"])


def _merged_description(group: list[Run]) -> dict:
    """The runs' descriptions merged, each key from the first run that records it: the runs of
    one model's weights describe the same model, but runs recorded before a key existed lack it,
    so the row does not depend on which of its runs comes first."""
    merged: dict = {}
    for run in group:
        for key, value in run.description.items():
            if merged.get(key) in (None, ""):
                merged[key] = value
    return merged


def format_model_table(table: pd.DataFrame) -> pd.DataFrame:
    """The table as the report prints it: the weights' origin with their short hash, parameters
    in millions (as they are below 100,000)."""
    return pd.DataFrame({
        "Model": table["label"], "Source": table["source"], "Spec": table["spec"].map(lambda s: f"`{s}`" if s else "-"),
        "Weights": [f"{o} {s[:12]}".strip() for o, s in zip(table["weights_origin"], table["weights_sha256"])],
        "Preprocessing": table["preprocessing"],
        "Params": table["params"].map(lambda p: "-" if pd.isna(p) else f"{p / 1e6:.2f}M" if p >= 1e5 else f"{int(p):,}"),
        "Protocols": table["protocols"], "Computed on": table["computed_on"]})
