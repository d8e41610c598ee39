"""Reports from stored runs: SAN Tables 9 and 10 (CSV, Markdown, LaTeX) beside the published
numbers, long-format sweeps, bootstrap intervals of the headline numbers, and PNG plots.

    >>> from robust_attn.reports import make_report
    >>> files = make_report(["runs/rotation-resnet26-imagenet-test"], "reports/out")
"""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path


from robust_attn.protocols.report_section import ReportContext, report_sections, reported_protocols
from robust_attn.reports.comparison import (DEFAULT_BASELINE, HEADLINE_MEASURES, agreement_findings, compare_models,
                                            findings_text)
from robust_attn.reports.formats import to_markdown, write_csv
from robust_attn.reports.models import MODELS_CAPTION, format_model_table, model_table
from robust_attn.reports.plots import plot_comparison
from robust_attn.reports.runs import (check_one_result_per_condition, check_one_variant_per_dataset,
                                     load_finished, load_runs)
from robust_attn.reports.stats import bootstrap_mean_ci
from robust_attn.reports.tables import headline_ci, pgd_table, rotation_table
from robust_attn.utils.io import atomic_write_text

__all__ = ["make_report", "bootstrap_mean_ci", "load_runs", "rotation_table", "pgd_table"]

REPORT_SUFFIXES = (".csv", ".md", ".tex", ".png")   # what a report writes at its folder's top level


def make_report(run_dirs, out_dir, n_boot: int = 1000, seed: int = 0, level: float = 0.95,
                plots: bool = True, baseline: str = DEFAULT_BASELINE, preamble: list[str] | None = None,
                partial: bool = False, keep: tuple[str, ...] = ()) -> list[Path]:
    """Write the tables, sweeps, intervals and plots of ``run_dirs`` into ``out_dir``; returns
    the files written. ``report.md`` gathers everything: ``preamble`` lines first, then, when
    two or more models ran on the same images, the findings (which model loses least, paired
    bootstrap; :mod:`robust_attn.reports.comparison`), then the tables. ``partial``: unfinished
    attack runs contribute their finished conditions, other unfinished runs are left out, and the
    report opens by naming what it leaves out (:func:`~robust_attn.reports.runs.load_finished`).
    Files of an earlier report in ``out_dir`` that this one does not write again are named in a
    warning (``keep``: the names the caller writes there itself).

    The files are written into a hidden folder inside ``out_dir`` and moved into place only once
    all of them are: a report that fails or is interrupted part-way leaves an earlier report there
    as it was, never a mix of the two."""
    if not 0 < level < 1:   # before anything is written
        raise ValueError(f"--level takes a confidence level in (0, 1), e.g. 0.95; got {level:g}")
    if n_boot < 1:
        raise ValueError(f"--bootstrap takes the number of resamples, at least 1 (default 1000); got {n_boot}")
    unique: dict[Path, object] = {}
    for run_dir in run_dirs:   # a folder given twice (overlapping globs) is one run
        unique.setdefault(Path(run_dir).resolve(), run_dir)
    run_dirs = list(unique.values())
    runs, left_out = load_finished(run_dirs) if partial else (load_runs(run_dirs), [])
    check_one_variant_per_dataset(runs)
    check_one_result_per_condition(runs)
    if not runs:
        raise ValueError("nothing finished to report: every run given is unfinished, and none is an attack run "
                         "with a finished condition; finish one by running its command again"
                         if left_out else "give at least one run directory")
    known = reported_protocols()
    unknown = sorted({r.protocol for r in runs} - set(known))
    if unknown:
        raise ValueError(f"runs of unknown protocol(s) {unknown}; the report knows {', '.join(known)}")
    final = Path(out_dir)
    final.mkdir(parents=True, exist_ok=True)
    earlier = {p.name for p in final.iterdir() if p.is_file() and p.suffix in REPORT_SUFFIXES}
    staging = Path(tempfile.mkdtemp(prefix=".report-", dir=final))   # same file system: os.replace moves
    try:
        staged = _write_report(runs, left_out, staging, n_boot, seed, level, plots, baseline, preamble)
        files = []
        for path in dict.fromkeys(staged):
            dest = final / path.relative_to(staging)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, dest)
            files.append(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    stale = sorted(earlier - {f.name for f in files} - set(keep))
    if stale:
        warnings.warn(f"{final} still holds {len(stale)} file(s) of an earlier report that this one did not "
                      f"write: {', '.join(stale)}; delete them, or report into an empty folder")
    return files


def _write_report(runs, left_out, out: Path, n_boot, seed, level, plots, baseline, preamble) -> list[Path]:
    """Every file of the report of ``runs`` into ``out`` (:func:`make_report`); returns them."""
    files: list[Path] = []
    md = ["# Robustness report", "", "Runs: " + ", ".join(f"`{r.path}`" for r in runs), ""]
    unfinished = [r for r in runs if r.unfinished]
    if unfinished or left_out:
        md += ["**Partial report: some runs are unfinished.** What they have not finished is left out; every "
               "number below is over finished conditions, each on all of its images:", ""]
        md += [f"- `{r.path}`: {', '.join(r.unfinished)}" for r in unfinished]
        md += [f"- `{p}`: the whole run (its protocol combines its conditions)" for p in left_out] + [""]
    if any(not r.trained for r in runs):
        md += ["**Warning: some runs used random weights (no checkpoint); their numbers say nothing "
               "about the architectures.**", ""]
    md += list(preamble or [])
    models = model_table(runs)
    files.append(write_csv(models, out / "models.csv"))
    md += ["## Models", "", MODELS_CAPTION, "", to_markdown(format_model_table(models)), ""]

    comparison = compare_models(runs, n_boot=n_boot, seed=seed, level=level, baseline=baseline)
    if not comparison.empty and comparison["model"].nunique() > 1:
        files.append(write_csv(comparison, out / "comparison.csv"))
        md += ["## Findings: which model loses least", ""] + findings_text(comparison, baseline) + [
            "Every number above, with its interval: `comparison.csv`.", ""]
        if plots:
            drawn = plot_comparison(comparison, HEADLINE_MEASURES, out)
            files += drawn
            md += ["![each model's loss with its interval](comparison.png)", ""] if drawn else []

    md += agreement_findings(runs, n_boot=n_boot, seed=seed, level=level)

    context = ReportContext(runs, out, n_boot=n_boot, seed=seed, level=level, plots=plots, baseline=baseline)
    for section in report_sections():
        section_md, section_files = section.write(context)
        md += section_md
        files += section_files

    ci = headline_ci(runs, n_boot=n_boot, seed=seed, level=level)
    if not ci.empty:
        files.append(write_csv(ci, out / "headline_ci.csv"))
        shown_ci = ci.assign(interval=[f"{v:.1f} [{lo:.1f}, {hi:.1f}]" for v, lo, hi in
                                       zip(ci["value"], ci["low"], ci["high"])])[["label", "metric", "interval",
                                                                                   "n"]]
        md += [f"## {level:.0%} bootstrap intervals over images ({n_boot} resamples, seed {seed})", "",
               to_markdown(shown_ci)]
    atomic_write_text(out / "report.md", "\n".join(md))
    files.append(out / "report.md")
    return [f for f in files if f is not None]
