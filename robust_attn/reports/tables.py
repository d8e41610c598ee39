"""Tables 9 and 10 of the SAN paper (section 5.4) from stored runs, as data frames (written as CSV,
and as Markdown and LaTeX by :mod:`robust_attn.reports.formats`).

Everything here is computed from the per-image records of the run directories
(:func:`robust_attn.runs.store.load_records`). Where a run's model and dataset match a row of the
published tables (``reports/reference``; ImageNet only, since the paper evaluates on ImageNet
val-original), the published numbers are placed in the row below ours, marked ``paper``.

Layouts follow the paper: Table 9 shows top-1 and top-5 per condition with the drop from the
unrotated result in brackets, ``51.8(23.1)``; Table 10 shows clean top-1 and, for n = 2
(``{eps, step, n} = {8, 4, 2}``) and n = 4 (``{8, 2, 4}``), the attack success rate and top-1.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from robust_attn.protocols.pgd import CLEAN, PAPER_SETTINGS, summarize_pgd
from robust_attn.protocols.rotation import summarize_rotation
from robust_attn.reports.runs import Run, model_key, run_labels
from robust_attn.reports.stats import bootstrap_mean_ci
from robust_attn.shifts.rotation import PAPER_CONDITIONS

__all__ = ["TOP5_NA", "rotation_table", "pgd_table", "rotation_sweep", "pgd_sweep", "headline_ci", "format_rotation",
           "format_pgd", "TABLE9_CONDITIONS", "TABLE10_SETTINGS"]

TABLE9_CONDITIONS = [("none", "no rotation"), ("cw90", "clockwise 90°"), ("cw180", "clockwise 180°"),
                     ("cw270", "clockwise 270°"), ("flip_ud", "upside-down")]
# reference CSV prefixes of the Table 9 conditions
_REF_PREFIX = {"none": "no_rotation", "cw90": "cw90", "cw180": "cw180", "cw270": "cw270", "flip_ud": "upside_down"}
# Table 10 columns: paper setting -> reference CSV prefix
TABLE10_SETTINGS = [(PAPER_SETTINGS[0], "n2"), (PAPER_SETTINGS[1], "n4")]
TOP5_NA = "n/a"   # top-5 of a dataset with 5 classes or fewer: always 100%, so not shown
assert [c.name for c in PAPER_CONDITIONS] == [c for c, _ in TABLE9_CONDITIONS]


def _reference(name: str) -> dict[str, dict]:
    from robust_attn.models.reference import reference_table

    return {row["model"]: row for row in reference_table(name).to_dict("records")}


def _paper_row(run: Run, reference: dict[str, dict]) -> dict | None:
    if run.dataset != "imagenet" or run.model not in reference:
        return None
    return reference[run.model]


# --- Table 9 ---------------------------------------------------------------------------------
def rotation_table(runs: list[Run], with_reference: bool = True) -> pd.DataFrame:
    """Numeric Table 9: one row per rotation run (``source`` ours) and, where published, the
    paper's row (``source`` paper); columns ``<condition>_top1``, ``_top5``, ``_top1_drop``,
    ``_top5_drop`` for the five conditions of the paper."""
    reference = _reference("san_table9_rotation") if with_reference else {}
    chosen = [r for r in runs if r.protocol == "rotation"]
    rows, papers = [], set()
    for run, label in zip(chosen, run_labels([[r] for r in chosen])):
        summary = summarize_rotation(run.records).set_index("condition")
        row = {"model": run.model, "dataset": run.dataset, "source": "ours", "label": label, "trained": run.trained,
               "n": int(summary.loc["none", "n"]) if "none" in summary.index else 0,
               "num_classes": run.num_classes, "top5_meaningful": run.top5_meaningful, "run": str(run.path)}
        for cond, _ in TABLE9_CONDITIONS:
            for metric in ("top1", "top5", "top1_drop", "top5_drop"):
                value = summary.loc[cond, metric] if cond in summary.index else math.nan
                row[f"{cond}_{metric}"] = math.nan if metric.startswith("top5") and not run.top5_meaningful else value
        rows.append(row)
        paper = _paper_row(run, reference)
        if paper is not None and run.model not in papers:   # the published row once per model
            papers.add(run.model)
            prow = {"model": run.model, "dataset": run.dataset, "source": "paper", "label": f"{run.model} (paper)",
                    "trained": True, "n": 50000, "num_classes": 1000, "top5_meaningful": True, "run": ""}
            for cond, _ in TABLE9_CONDITIONS:
                for k in ("top1", "top5"):
                    prow[f"{cond}_{k}"] = paper[f"{_REF_PREFIX[cond]}_{k}"]
                    prow[f"{cond}_{k}_drop"] = paper[f"no_rotation_{k}"] - paper[f"{_REF_PREFIX[cond]}_{k}"]
            rows.append(prow)
    return pd.DataFrame(rows)


def _cell(value: float, drop: float | None = None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.1f}" if drop is None else f"{value:.1f}({drop:.1f})"


def _label(row) -> str:
    if isinstance(row.get("label"), str) and row["label"]:
        return row["label"]
    label = row["model"] if row["source"] == "ours" else f"{row['model']} (paper)"
    if row["source"] == "ours" and not row.get("trained", True):
        label += " [random weights]"
    return label if row["dataset"] == "imagenet" or row["source"] == "paper" else f"{label} [{row['dataset']}]"


def format_rotation(table: pd.DataFrame) -> pd.DataFrame:
    """Table 9 as the paper prints it: ``accuracy(drop)`` cells."""
    out = []
    for _, row in table.iterrows():
        cells = {"Method": _label(row)}
        for cond, title in TABLE9_CONDITIONS:
            for k, name in (("top1", "top-1"), ("top5", "top-5")):
                drop = None if cond == "none" else row[f"{cond}_{k}_drop"]
                meaningful = row.get("top5_meaningful", True)
                shown = k == "top1" or not (isinstance(meaningful, (bool, np.bool_)) and not meaningful)
                cells[f"{title} {name}"] = _cell(row[f"{cond}_{k}"], drop) if shown else TOP5_NA
        out.append(cells)
    return pd.DataFrame(out, columns=["Method"] + [f"{t} {k}" for _, t in TABLE9_CONDITIONS
                                                   for k in ("top-1", "top-5")])


def rotation_sweep(runs: list[Run]) -> pd.DataFrame:
    """Every rotation condition of every run (long format), with its angle: for the plots.
    Top-5 is blank (nan) for datasets of 5 classes or fewer."""
    frames = []
    chosen = [r for r in runs if r.protocol == "rotation"]
    for run, label in zip(chosen, run_labels([[r] for r in chosen])):
        summary = summarize_rotation(run.records)
        if not run.top5_meaningful:
            summary[["top5", "top5_drop"]] = math.nan
        conds = {c["name"]: c for c in run.description["conditions"]}
        summary.insert(0, "model", run.model)
        summary.insert(1, "dataset", run.dataset)
        summary.insert(2, "label", label)
        summary["kind"] = summary["condition"].map(lambda c: conds.get(c, {}).get("kind"))
        summary["angle"] = summary["condition"].map(lambda c: conds.get(c, {}).get("angle"))
        frames.append(summary)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


# --- Table 10 --------------------------------------------------------------------------------
def pgd_table(runs: list[Run], with_reference: bool = True) -> pd.DataFrame:
    """Numeric Table 10: ``clean_top1`` and ``n2_`` / ``n4_`` ``success_rate``, ``top1`` (over all
    images, as the paper) plus the same on the clean-correct subset (``..._clean_correct``)."""
    reference = _reference("san_table10_pgd") if with_reference else {}
    groups: dict[tuple, list[Run]] = {}
    for run in (r for r in runs if r.protocol == "pgd"):   # one row per model, checkpoint and image set
        groups.setdefault(model_key(run), []).append(run)
    rows, papers = [], set()
    for group, label in zip(groups.values(), run_labels(list(groups.values()))):
        summaries = [summarize_pgd(run.records).set_index("condition") for run in group]

        def pick(condition: str, metric: str) -> float:
            """The value from the first run of the group that has ``condition``."""
            return next((s.loc[condition, metric] for s in summaries if condition in s.index), math.nan)

        run = group[0]
        clean_n = pick(CLEAN, "n")
        row = {"model": run.model, "dataset": run.dataset, "source": "ours", "label": label, "trained": run.trained,
               "n": 0 if math.isnan(clean_n) else int(clean_n), "run": ", ".join(str(r.path) for r in group),
               "clean_top1": pick(CLEAN, "top1")}
        for setting, prefix in TABLE10_SETTINGS:
            for metric in ("success_rate", "top1", "success_rate_clean_correct", "top1_clean_correct"):
                row[f"{prefix}_{metric}"] = pick(setting.name, metric)
        rows.append(row)
        paper = _paper_row(run, reference)
        if paper is not None and run.model not in papers:   # the published row once per model
            papers.add(run.model)
            prow = {"model": run.model, "dataset": run.dataset, "source": "paper", "label": f"{run.model} (paper)",
                    "trained": True, "n": 50000, "run": "", "clean_top1": paper["clean_top1"]}
            for _, prefix in TABLE10_SETTINGS:
                prow[f"{prefix}_success_rate"] = paper[f"{prefix}_success_rate"]
                prow[f"{prefix}_top1"] = paper[f"{prefix}_top1"]
            rows.append(prow)
    return pd.DataFrame(rows)


def format_pgd(table: pd.DataFrame) -> pd.DataFrame:
    out = []
    for _, row in table.iterrows():
        cells = {"Method": _label(row), "clean top-1": _cell(row["clean_top1"])}
        for _, prefix in TABLE10_SETTINGS:
            n = prefix[1:]
            cells[f"n={n} s. rate"] = _cell(row.get(f"{prefix}_success_rate", math.nan))
            cells[f"n={n} top-1"] = _cell(row.get(f"{prefix}_top1", math.nan))
        out.append(cells)
    return pd.DataFrame(out, columns=["Method", "clean top-1", "n=2 s. rate", "n=2 top-1", "n=4 s. rate",
                                      "n=4 top-1"])


def pgd_sweep(runs: list[Run]) -> pd.DataFrame:
    """Every PGD condition of every run (long format) with eps, step (1/255 units, as Table 10 and
    the condition names; the runs record image units) and steps: for the plots."""
    frames = []
    chosen = [r for r in runs if r.protocol == "pgd"]
    for run, label in zip(chosen, run_labels([[r] for r in chosen])):
        summary = summarize_pgd(run.records)
        if "top5" in summary and not run.top5_meaningful:
            summary["top5"] = math.nan
        conds = {c["name"]: c for c in run.description["conditions"]}
        summary.insert(0, "model", run.model)
        summary.insert(1, "dataset", run.dataset)
        summary.insert(2, "label", label)
        for key in ("eps", "step"):
            summary[key] = summary["condition"].map(lambda c, k=key: round(conds[c][k] * 255, 6) if c in conds
                                                    else None)
        summary["steps"] = summary["condition"].map(lambda c: conds.get(c, {}).get("steps"))
        frames.append(summary)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


# --- confidence intervals --------------------------------------------------------------------
def headline_ci(runs: list[Run], n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> pd.DataFrame:
    """Bootstrap intervals over images of the headline numbers: per rotation run the top-1 of
    each Table 9 condition and its (paired) drop; per PGD run clean top-1 and, per setting,
    success rate and top-1."""
    rows = []
    labels = {}
    for protocol in {r.protocol for r in runs}:   # labels tell apart the runs of one protocol
        same = [r for r in runs if r.protocol == protocol]
        labels.update({id(r): label for r, label in zip(same, run_labels([[r] for r in same]))})

    def add(run, metric, values):
        ci = bootstrap_mean_ci(values, n_boot=n_boot, seed=seed, level=level)
        rows.append({"model": run.model, "dataset": run.dataset, "label": labels[id(run)],
                     "protocol": run.protocol, "metric": metric,
                     "value": ci.value, "low": ci.low, "high": ci.high, "level": level, "n_boot": n_boot,
                     "n": len(values), "run": str(run.path)})

    for run in runs:
        if run.protocol == "rotation":
            hits = {c: g.set_index("index")["top1"].sort_index() for c, g in run.records.groupby("condition")}
            base = hits.get("none")
            for cond, _ in TABLE9_CONDITIONS:
                if cond in hits:
                    add(run, f"{cond}_top1", hits[cond].to_numpy())
                    if base is not None and cond != "none":
                        add(run, f"{cond}_top1_drop", (base - hits[cond]).to_numpy())
        elif run.protocol == "pgd":
            for cond, group in run.records.groupby("condition", sort=False):
                group = group.sort_values("index")
                add(run, f"{cond}_top1", group["top1"].to_numpy())
                if cond != CLEAN:
                    add(run, f"{cond}_success_rate", group["success"].to_numpy())
    return pd.DataFrame(rows)
