"""PNG plots from the long-format summaries (matplotlib, Agg backend: no display needed).

* ``rotation_angle.png``: top-1 against clockwise rotation angle, one line per run; the exact
  0/90/180/270 conditions and the interpolated sweep together, 360 closing the circle.
* ``pgd_steps.png`` / ``pgd_eps.png``: attack success rate and top-1 under attack against the
  number of steps (one line per model and eps) and against eps (one line per model and steps).
* ``comparison.png``: the findings' measures (rotation drop; top-1 drop and success rate under
  Table 10's {8, 2, 4}), one bar per model with its bootstrap interval, best at the top.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

__all__ = ["plot_rotation", "plot_pgd", "plot_comparison"]


def _series_label(model: str, dataset: str, label: str | None = None) -> str:
    return label or f"{model} ({dataset})"


def _series_keys(frame: pd.DataFrame) -> list[str]:
    """One series per row label of the tables where the sweep has them (two runs of one model
    on different images or weights are two series), else per model and dataset."""
    return ["model", "dataset"] + (["label"] if "label" in frame else [])


def plot_rotation(sweep: pd.DataFrame, out: Path) -> list[Path]:
    """Top-1 and top-5 against angle; returns the files written (none without rotation runs)."""
    if sweep.empty:
        return []
    angled = sweep[sweep["kind"].isin(["identity", "rot90", "angle"])]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for series, group in angled.groupby(_series_keys(angled), sort=False):
        group = group.sort_values("angle")
        base = group[group["kind"] == "identity"]
        group = pd.concat([group, base.assign(angle=360.0)])  # close the circle
        for ax, metric in zip(axes, ("top1", "top5")):
            ax.plot(group["angle"], group[metric], marker="o", markersize=3, label=_series_label(*series))
    for ax, metric in zip(axes, ("top-1", "top-5")):
        ax.set_xlabel("clockwise rotation (degrees; bilinear, zero fill off the 90s)")
        ax.set_ylabel(f"{metric} accuracy (%)")
        ax.set_xticks(range(0, 361, 45))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Accuracy under test-time rotation")
    fig.tight_layout()
    path = out / "rotation_angle.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


_LINESTYLES = ("-", "--", ":", "-.")


def _plot_against(sweep: pd.DataFrame, x: str, line: str, path: Path, xlabel: str) -> Path:
    """One colour per model, one line style per value of ``line`` (eps or steps)."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    attacked = sweep[sweep["condition"] != "clean"]
    keys = _series_keys(attacked)
    colours = {key: f"C{i % 10}" for i, key in enumerate(attacked.groupby(keys, sort=False).groups)}
    styles = {v: _LINESTYLES[i % len(_LINESTYLES)] for i, v in enumerate(sorted(attacked[line].unique()))}
    for (*series, key), group in attacked.groupby(keys + [line], sort=False):
        # several step sizes at one (x, line) point: one line per step size
        for step, sub in group.groupby("step", sort=True) if group.duplicated(x).any() else [(None, group)]:
            sub = sub.sort_values(x)
            label = f"{_series_label(*series)} {line}={key:g}" + ("" if step is None else f" step={step:g}")
            style = dict(color=colours[tuple(series)], linestyle=styles[key], marker="o", markersize=4)
            axes[0].plot(sub[x], sub["success_rate"], label=label, **style)
            axes[1].plot(sub[x], sub["top1"], label=label, **style)
    for ax, name in zip(axes, ("attack success rate (%)", "top-1 under attack (%)")):
        if x == "steps":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle("Targeted L-inf PGD")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_pgd(sweep: pd.DataFrame, out: Path) -> list[Path]:
    """Success rate and top-1 against steps and against eps; returns the files written."""
    if sweep.empty:
        return []
    return [_plot_against(sweep, "steps", "eps", out / "pgd_steps.png", "PGD iterations n"),
            _plot_against(sweep, "eps", "steps", out / "pgd_eps.png", "eps (1/255)")]


def plot_comparison(comparison: pd.DataFrame, measures: list[str], out: Path) -> list[Path]:
    """One panel per measure of ``comparison`` (:func:`robust_attn.reports.comparison.compare_models`):
    horizontal bars of each model's mean loss with its interval; returns the files written."""
    frames = [comparison[comparison["measure"] == m].sort_values("rank", ascending=False) for m in measures]
    frames = [f for f in frames if not f.empty]
    if not frames:
        return []
    fig, axes = plt.subplots(1, len(frames), figsize=(4.2 * len(frames), 0.45 * len(frames[0]) + 1.6), squeeze=False)
    for ax, frame in zip(axes[0], frames):
        errors = [frame["value"] - frame["low"], frame["high"] - frame["value"]]
        ax.barh(frame["model"], frame["value"], xerr=errors, color="tab:blue", alpha=0.7, capsize=3)
        ax.set_title(frame["title"].iloc[0], fontsize=8)
        ax.set_xlabel(f"{frame['unit'].iloc[0]} (lower is better)")
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    path = out / "comparison.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
