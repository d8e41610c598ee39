"""Do two robustness measures rank the models the same way?

The question behind issues #14 and #17: does the ranking of the families under SAN's weak
Table 10 attack survive a strong attack (AutoAttack, Square), and does the ranking under
rotation agree with the ranking under other shifts? A measure here is a per-image loss for each
model (an image x model table, lower is better; :func:`robust_attn.reports.comparison.per_image_losses`).

Two numbers answer it, each with its uncertainty:

* Kendall's tau between the models' mean losses under the two measures (tau-b, so ties count
  as neither concordant nor discordant): 1 is the same order, -1 the reverse. Its interval is a
  percentile bootstrap over images: when both measures were taken on the same images one
  resample of image indices serves both (paired), otherwise each table is resampled on its own.
* The pairs of models whose order flips, each marked *resolved* when the paired bootstrap
  interval of the two models' difference excludes 0 under both measures: a flip between two
  models that neither measure separates is noise, a resolved flip is a finding.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations

import numpy as np
import pandas as pd

from robust_attn.reports.stats import bootstrap_mean_ci

__all__ = ["kendall_tau", "RankAgreement", "rank_agreement", "agreement_lines"]


def kendall_tau(a, b) -> float:
    """Kendall's tau-b of two equally long sequences (nan with fewer than 2 items or where one
    sequence is constant)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"kendall_tau needs sequences of one length, got {a.shape} and {b.shape}")
    i, j = np.triu_indices(len(a), k=1)
    da, db = np.sign(a[i] - a[j]), np.sign(b[i] - b[j])
    untied_a, untied_b = np.count_nonzero(da), np.count_nonzero(db)
    if untied_a == 0 or untied_b == 0:
        return float("nan")
    return float((da * db).sum() / np.sqrt(untied_a * untied_b))


@dataclass
class RankAgreement:
    """The comparison of measure ``a`` with measure ``b`` over ``models`` (module docstring)."""

    models: list[str]
    tau: float
    low: float
    high: float
    paired: bool                 # both measures on the same images
    n_a: int
    n_b: int
    level: float
    n_boot: int
    flips: list[dict] = field(default_factory=list)   # model_1, model_2, diff_a, diff_b, resolved

    @property
    def resolved_flips(self) -> list[dict]:
        return [f for f in self.flips if f["resolved"]]


def _excludes_zero(values: np.ndarray, n_boot: int, seed: int, level: float) -> tuple[float, bool]:
    ci = bootstrap_mean_ci(values, n_boot=n_boot, seed=seed, level=level)
    return ci.value, bool(ci.low > 0 or ci.high < 0)


def rank_agreement(losses_a: pd.DataFrame, losses_b: pd.DataFrame, n_boot: int = 1000, seed: int = 0,
                   level: float = 0.95) -> RankAgreement:
    """Compare two image x model loss tables over the models they share (at least 2)."""
    models = sorted(set(losses_a.columns) & set(losses_b.columns))
    if len(models) < 2:
        raise ValueError(f"rank agreement needs at least 2 models in both measures, got {models}")
    a = losses_a[models].to_numpy(dtype=float)
    b = losses_b[models].to_numpy(dtype=float)
    paired = len(losses_a) == len(losses_b) and losses_a.index.equals(losses_b.index)
    tau = kendall_tau(a.mean(0), b.mean(0))
    rng = np.random.default_rng(seed)
    taus = np.empty(n_boot)
    for k in range(n_boot):
        ia = rng.integers(0, len(a), len(a))
        ib = ia if paired else rng.integers(0, len(b), len(b))
        taus[k] = kendall_tau(a[ia].mean(0), b[ib].mean(0))
    taus = taus[~np.isnan(taus)]
    alpha = (1 - level) / 2
    low, high = (np.quantile(taus, [alpha, 1 - alpha]) if len(taus) else (np.nan, np.nan))
    flips = []
    for i, j in combinations(range(len(models)), 2):
        diff_a, resolved_a = _excludes_zero(a[:, i] - a[:, j], n_boot, seed, level)
        diff_b, resolved_b = _excludes_zero(b[:, i] - b[:, j], n_boot, seed, level)
        if np.sign(diff_a) * np.sign(diff_b) < 0:
            flips.append({"model_1": models[i], "model_2": models[j], "diff_a": diff_a, "diff_b": diff_b,
                          "resolved": resolved_a and resolved_b})
    return RankAgreement(models, tau, float(low), float(high), paired, len(a), len(b), level, n_boot, flips)


def agreement_lines(title_a: str, title_b: str, result: RankAgreement, unit: str = "points") -> list[str]:
    """A Markdown paragraph: tau with its interval, then the flipped pairs (resolved ones first)."""
    how = ("paired over the same images" if result.paired else
           f"resampled separately: {result.n_a} and {result.n_b} images")
    text = (f"**{title_a}** against **{title_b}**: Kendall's tau {result.tau:+.2f} "
            f"[{result.low:+.2f}, {result.high:+.2f}] over {len(result.models)} models "
            f"({result.level:.0%} bootstrap interval, {how}).")
    resolved = result.resolved_flips
    if not result.flips:
        text += " No pair of models changes order."
    else:
        text += (f" {len(result.flips)} of {len(result.models) * (len(result.models) - 1) // 2} pairs change "
                 f"order, {len(resolved)} of them resolved under both measures"
                 + (":" if resolved else " (the others are within the noise of at least one measure)."))
    lines = [text]
    for f in sorted(result.flips, key=lambda f: not f["resolved"]):
        if f["resolved"]:
            lines.append(f"- {f['model_1']} minus {f['model_2']}: {f['diff_a']:+.2f} {unit} under the first, "
                         f"{f['diff_b']:+.2f} under the second")
    return lines + [""]
