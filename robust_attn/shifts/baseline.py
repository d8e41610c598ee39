"""A corruption run measured against a baseline model's corruption run: the check that both saw
the same images, and the CE / mCE line (Hendrycks & Dietterich 2019, section 3;
:mod:`robust_attn.shifts.metrics`)."""
from __future__ import annotations

from pathlib import Path

__all__ = ["check_baseline", "mce_line"]


def _corruption_run(baseline: Path) -> dict:
    from robust_attn.runs.store import load_description

    base = load_description(baseline)
    if base.get("protocol") != "corruption":
        raise ValueError(f"--baseline {baseline} is a {base.get('protocol')} run, not a corruption run")
    return base


def check_baseline(baseline: Path, run_info: dict, images: str, seed: int) -> None:
    """Before any work: the baseline was measured on the same images (dataset, variant, split,
    subset, and the corrupted images' source and seed); a relative mCE against another image set
    means nothing. (Models of different preprocessing see the same images resized differently, as
    in a study's corruption step: allowed.)"""
    base = _corruption_run(baseline)
    params = base.get("parameters", {})

    def images_of(dataset) -> dict:
        return {k: (dataset or {}).get(k) for k in ("name", "split", "limit")}

    mine = {"dataset": images_of(run_info.get("dataset")), "data variant": run_info.get("data_variant"),
            "corrupted images": images, "corruption seed": seed if images == "generated" else None}
    theirs = {"dataset": images_of(base.get("dataset")),
              "data variant": base.get("data_variant", mine["data variant"]),
              "corrupted images": params.get("images"), "corruption seed": params.get("seed")}
    differ = [k for k in mine if mine[k] != theirs[k]]
    if differ:
        shown = "; ".join(f"{k}: baseline {theirs[k]!r}, this run {mine[k]!r}" for k in differ)
        raise ValueError(f"--baseline {baseline} was measured on other images ({shown}); give a corruption run of "
                         f"the baseline model on the same --dataset, --split, --limit and corrupted images")


def mce_line(records, conditions, baseline: Path) -> str:
    """``against MODEL (DIR): mCE .., relative mCE ..`` of ``records`` against the baseline run."""
    from robust_attn.runs.store import load_records
    from robust_attn.shifts.metrics import error_table, mce_summary

    base_desc = _corruption_run(baseline)
    base_records = load_records(baseline)
    key = ["index", "label"]
    mine = records.loc[records["condition"] == "clean", key].sort_values("index").reset_index(drop=True)
    theirs = base_records.loc[base_records["condition"] == "clean", key].sort_values("index").reset_index(drop=True)
    if not mine.equals(theirs):
        raise ValueError(f"--baseline {baseline} holds other images than this run (its clean records' image "
                         f"indices and labels differ); give a corruption run of the baseline on the same images")
    summary = mce_summary(error_table(records, conditions), error_table(base_records, base_desc["conditions"]))
    return (f"against {base_desc.get('model')} ({baseline}): mCE {summary['mCE']:.1f}, relative mCE "
            f"{summary['relative_mCE']:.1f} over {summary['corruptions']} corruption(s)")
