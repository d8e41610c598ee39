"""The report's distribution-shift sections, from the per-image records of the
corruption, occlusion and shuffle runs:

* corruptions: top-1 per model, corruption and severity (``corruption_accuracy.csv``); per
  model the clean top-1, the mean top-1 under corruption, the mCE and relative mCE against the
  baseline model (Hendrycks & Dietterich 2019, :mod:`robust_attn.shifts.metrics`; the baseline's
  own run must cover the same corruptions and severities on the same images); plots of top-1
  against severity per model (``corruption_severity.png``) and a per-corruption heat map of
  top-1 averaged over severities (``corruption_heatmap.png``);
* occlusion: top-1 per model and condition (``occlusion_conditions.csv``) and against the
  occluded percentage (``occlusion.png``);
* shuffle: top-1 per model and grid (``shuffle_conditions.csv``) and against g (``shuffle.png``).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from robust_attn.protocols.report_section import ReportContext, report_section
from robust_attn.shifts.metrics import corruption_errors, error_table, mce_summary

__all__ = ["condition_table", "corruption_summary", "plot_severity", "plot_heatmap", "plot_against",
           "corruption_section", "occlusion_section", "shuffle_section"]


def _labelled(runs, protocol: str) -> list[tuple[str, object]]:
    from robust_attn.reports.runs import run_labels

    chosen = [r for r in runs if r.protocol == protocol]
    return list(zip(run_labels([[r] for r in chosen]), chosen)) if chosen else []


def condition_table(runs, protocol: str) -> pd.DataFrame:
    """Long format: label, model, dataset, condition, the condition's fields (corruption and
    severity, kind/percent/fill, grid), n, top1, top5 (percent)."""
    frames = []
    for label, run in _labelled(runs, protocol):
        grouped = run.records.groupby("condition", sort=False)
        acc = pd.DataFrame({"n": grouped.size(), "top1": grouped["top1"].mean() * 100,
                            "top5": grouped["top5"].mean() * 100}).reset_index()
        fields = pd.DataFrame(run.description["conditions"]).rename(columns={"name": "condition"})
        merged = fields.merge(acc, on="condition", how="right")
        merged.insert(0, "dataset", run.dataset)
        merged.insert(0, "model", run.model)
        merged.insert(0, "label", label)
        frames.append(merged)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _same_images(a, b) -> bool:
    return a.dataset == b.dataset and sorted(a.records["index"].unique()) == sorted(b.records["index"].unique())


def _baseline_run(labelled, run, baseline: str):
    """The ``baseline`` model's corruption run on ``run``'s images, or None. The baseline is named
    as the findings name it: by the run's model name (a study's label, e.g. ``resnet26`` for
    ``zoo:resnet26-efficient``) or by its zoo entry. Where runs of two weights answer to that
    name on these images (two zoos in one report) and ``run`` is not one of them, none is the
    baseline: the findings' paired differences leave it out too (``resnet26 (ckpt ...)``)."""
    from robust_attn.reports.runs import weights_label

    found = [r for _, r in labelled if baseline in (r.model, r.description.get("zoo_entry")) and _same_images(r, run)]
    if any(r is run for r in found):
        return run
    return found[0] if len({weights_label(r) for r in found}) == 1 else None


def corruption_summary(runs, baseline: str) -> pd.DataFrame:
    """Per corruption run: label, clean top1, mean corrupted top1, mCE and relative mCE against
    the ``baseline`` model's corruption run on the same images (NaN without one), corruptions."""
    labelled = _labelled(runs, "corruption")
    rows = []
    for label, run in labelled:
        errors = error_table(run.records, run.description["conditions"])
        base = _baseline_run(labelled, run, baseline)
        row = {"label": label, "model": run.model, "dataset": run.dataset,
               "clean_top1": 100 - errors.loc[errors["corruption"] == "clean", "error"].iloc[0],
               "corrupted_top1": 100 - errors.loc[errors["corruption"] != "clean", "error"].mean(),
               "mCE": float("nan"), "relative_mCE": float("nan"),
               "corruptions": errors.loc[errors["corruption"] != "clean", "corruption"].nunique()}
        if base is not None:
            summary = mce_summary(errors, error_table(base.records, base.description["conditions"]))
            row.update(mCE=summary["mCE"], relative_mCE=summary["relative_mCE"])
        rows.append(row)
    return pd.DataFrame(rows)


def corruption_ce(runs, baseline: str) -> pd.DataFrame:
    """Per run and corruption: CE and relative CE against the baseline (runs without a baseline
    run on the same images are left out)."""
    labelled = _labelled(runs, "corruption")
    frames = []
    for label, run in labelled:
        base = _baseline_run(labelled, run, baseline)
        if base is None:
            continue
        per = corruption_errors(error_table(run.records, run.description["conditions"]),
                                error_table(base.records, base.description["conditions"]))
        per.insert(0, "label", label)
        frames.append(per)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _figure(width: float, height: float, ncols: int = 1):
    from robust_attn.reports import plots  # noqa: F401  (selects the Agg backend)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), squeeze=False)
    return plt, fig, axes[0]


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_severity(table: pd.DataFrame, path: Path) -> Path:
    """Top-1 against severity (0 = clean), mean over corruptions, one line per model."""
    plt, fig, (ax,) = _figure(6.5, 4.2)
    for label, group in table.groupby("label", sort=False):
        curve = group.groupby("severity")["top1"].mean()
        ax.plot(curve.index, curve.to_numpy(), marker="o", label=label)
    ax.set_xlabel("severity (0: clean)")
    ax.set_ylabel("top-1 (%), mean over corruptions")
    ax.set_xticks(range(0, 6))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Common corruptions (Hendrycks & Dietterich 2019)")
    return _save(plt, fig, path)


def plot_heatmap(table: pd.DataFrame, path: Path) -> Path:
    """Models (rows) x corruptions (columns): top-1 averaged over severities, value in each cell."""
    corrupted = table[table["severity"] > 0]
    matrix = corrupted.pivot_table(index="label", columns="corruption", values="top1", aggfunc="mean", sort=False)
    plt, fig, (ax,) = _figure(0.75 * len(matrix.columns) + 3.0, 0.5 * len(matrix) + 2.4)
    image = ax.imshow(matrix.to_numpy(), cmap="viridis", vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(matrix.columns)), matrix.columns, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(matrix.index)), matrix.index, fontsize=7)
    for i in range(matrix.shape[0]):
        for j in range(matrix.shape[1]):
            value = matrix.iat[i, j]
            ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=6,
                    color="white" if value < 50 else "black")
    fig.colorbar(image, ax=ax, label="top-1 (%), mean over severities")
    ax.set_title("Top-1 per corruption")
    return _save(plt, fig, path)


def plot_against(table: pd.DataFrame, x: str, series: list[str], path: Path, xlabel: str, title: str,
                 log2: bool = False) -> Path:
    """Top-1 against column ``x``, one line per label and value of ``series`` columns; the
    clean top-1 of each label as a dotted line."""
    plt, fig, (ax,) = _figure(6.5, 4.2)
    shifted = table[table["condition"] != "clean"]
    keys = list(dict.fromkeys(map(tuple, shifted[series].to_numpy()))) if series else [()]
    styles = {key: ("-", "--", "-.", ":")[i % 4] for i, key in enumerate(keys)}
    for i, (label, group) in enumerate(shifted.groupby("label", sort=False)):
        colour = f"C{i % 10}"
        clean = table[(table["label"] == label) & (table["condition"] == "clean")]["top1"]
        if len(clean):
            ax.axhline(clean.iloc[0], color=colour, linestyle=":", linewidth=1)
        for key, line in (group.groupby(series, sort=False) if series else [((), group)]):
            key = key if isinstance(key, tuple) else (key,)
            line = line.sort_values(x)
            ax.plot(line[x], line["top1"], marker="o", color=colour,
                    label=" ".join([label, *map(str, key)]), linestyle=styles[key])
    if log2:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("top-1 (%)  (dotted: clean)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    ax.set_title(title)
    return _save(plt, fig, path)


def _write_table(ctx: ReportContext, frame: pd.DataFrame, name: str) -> Path:
    from robust_attn.reports.formats import write_csv

    return write_csv(frame, ctx.out / name)


@report_section("corruption", order=40, shift=True)
def corruption_section(ctx: ReportContext) -> tuple[list[str], list[Path]]:
    """Common corruptions: top-1, mCE and relative mCE against the baseline, and their plots."""
    from robust_attn.reports.formats import to_markdown

    md: list[str] = []
    files: list[Path] = []
    table = condition_table(ctx.runs, "corruption")
    if not table.empty:
        files.append(_write_table(ctx, table, "corruption_accuracy.csv"))
        summary = corruption_summary(ctx.runs, ctx.baseline)
        files.append(_write_table(ctx, summary, "corruption_summary.csv"))
        ce = corruption_ce(ctx.runs, ctx.baseline)
        if not ce.empty:
            files.append(_write_table(ctx, ce, "corruption_ce.csv"))
        shown = summary.drop(columns=["model", "dataset"]).round(1)
        baseline = ctx.baseline
        md += ["## Common corruptions", "",
               f"Hendrycks & Dietterich (ICLR 2019): top-1 (%) on the clean images and averaged over every corruption "
               f"and severity; mCE and relative mCE (%) against `{baseline}` (100: as robust as it; lower is better; "
               f"empty without a `{baseline}` run on the same images). Per corruption and severity: "
               f"`corruption_accuracy.csv`; CE per corruption: `corruption_ce.csv`.", "", to_markdown(shown)]
        if ctx.plots:
            files += [plot_severity(table, ctx.out / "corruption_severity.png"),
                      plot_heatmap(table, ctx.out / "corruption_heatmap.png")]
            md += ["![top-1 against severity](corruption_severity.png)",
                   "![top-1 per corruption](corruption_heatmap.png)", ""]
    return md, files


def _by_condition(ctx: ReportContext, protocol: str, title: str, text: str):
    """The table of ``protocol``'s runs (``<protocol>_conditions.csv``) and its section: top-1 per
    model (rows) and condition (columns) under ``title`` and ``text``; empty without runs."""
    from robust_attn.reports.formats import to_markdown

    table = condition_table(ctx.runs, protocol)
    if table.empty:
        return table, [], []
    wide = table.pivot_table(index="label", columns="condition", values="top1", sort=False).round(1).reset_index()
    files = [_write_table(ctx, table, f"{protocol}_conditions.csv")]
    return table, [f"## {title}", "", text, "", to_markdown(wide)], files


@report_section("occlusion", order=41, shift=True)
def occlusion_section(ctx: ReportContext) -> tuple[list[str], list[Path]]:
    """Occlusion: top-1 per model and condition, and against the occluded share."""
    occ, md, files = _by_condition(
        ctx, "occlusion", "Occlusion", "Naseer et al. (2021): top-1 (%) with one random square covering k% of the "
        "image (`square<k>_<fill>`) and with a random share of the cells of a grid dropped (`drop<g>x<g>_<percent>_"
        "<fill>`), filled with zeros or the dataset's mean colour.")
    if md and ctx.plots:
        occ_plot = occ[occ["condition"] != "clean"].assign(series=lambda f: f["kind"] + " " + f["fill"])
        occ_plot = pd.concat([occ_plot, occ[occ["condition"] == "clean"]])
        files.append(plot_against(occ_plot, "percent", ["series"], ctx.out / "occlusion.png",
                                  "occluded share of the image (%)", "Occlusion (Naseer et al. 2021)"))
        md += ["![top-1 against occluded share](occlusion.png)", ""]
    return md, files


@report_section("shuffle", order=42, shift=True)
def shuffle_section(ctx: ReportContext) -> tuple[list[str], list[Path]]:
    """Patch shuffle: top-1 per model and grid, and against the grid size."""
    shu, md, files = _by_condition(
        ctx, "shuffle", "Patch shuffle", "Naseer et al. (2021): top-1 (%) with the image cut into a g x g grid and "
        "the patches permuted (one seeded permutation per image; g = 1 is the unshuffled image).")
    if md and ctx.plots:
        files.append(plot_against(shu, "grid", [], ctx.out / "shuffle.png", "grid g (g x g patches)",
                                  "Patch shuffle (Naseer et al. 2021)", log2=True))
        md += ["![top-1 against grid size](shuffle.png)", ""]
    return md, files
