"""The study reports committed in ``reports/`` say what their packed runs say, and were computed
from the checkpoints the zoo ships, with their packed runs (nothing silently wrong on disk).

The numbers are recomputed here from the per-image records with plain pandas means, independent
of the report code, and compared with the committed CSV tables."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from robust_attn.reports.runs import load_runs
from robust_attn.models.manifest import Manifest

ROOT = Path(__file__).resolve().parents[1]
REPORTS = {"study-fashion_mnist": "fashion_mnist", "study-cifar10": "cifar10", "study-cifar10-full": "cifar10"}
# the reports with corruption runs and with attack runs, and how many images each covers
CORRUPTION = {"study-fashion_mnist": 10000, "study-cifar10": 2000, "study-cifar10-full": 10000}
ATTACKS = ("study-fashion_mnist", "study-cifar10")
# the reports with AutoAttack runs: their APGD-CE protocol runs too (or none), and how many models
AUTOATTACK = {"study-fashion_mnist": (("autoattack", "apgd"), 7), "study-cifar10": (("autoattack", "apgd"), 7),
              "autoattack-cifar10": (("autoattack",), 7), "autoattack-fashion_mnist": (("autoattack",), 7)}
# every report with packed runs, and the zoo dataset whose checkpoints computed them
CHECKPOINTS = {**REPORTS, "autoattack-cifar10": "cifar10", "autoattack-fashion_mnist": "fashion_mnist"}
# the AutoAttack reports at 1, 2, 4 and 8/255 beside the study they complete, the radii at which
# that study ran APGD-CE alone, and how many of the 1,000 clean predictions may differ from it
# where a GPU computed the clean chunk (on this CPU, none: the study ran here; Fashion-MNIST
# resnet26's GPU run flipped one image)
AUTOATTACK_RADII = {"autoattack-cifar10": ("study-cifar10", (1, 2, 4)),
                    "autoattack-fashion_mnist": ("study-fashion_mnist", (2, 4))}
GPU_FLIPS = 1
TABLE9 = ("none", "cw90", "cw180", "cw270", "flip_ud")


def _computed_on_a_gpu(report: str) -> set[str]:
    """The models of ``report`` some of whose records a GPU computed (its Models table)."""
    models = pd.read_csv(ROOT / "reports" / report / "models.csv")
    if "computed_on" not in models:   # written before the table named the device: this CPU
        return set()
    return set(models.loc[models["computed_on"].str.contains("cuda", na=False), "model"])


def _runs(report: str, protocol: str):
    paths = sorted((ROOT / "reports" / report / "runs").glob(f"{protocol}-*"))
    assert paths, f"no packed {protocol} runs in reports/{report}"
    return load_runs(paths)


def _percent(records: pd.DataFrame, column: str) -> pd.Series:
    return records.groupby("condition")[column].mean() * 100


@pytest.mark.parametrize("report", sorted(CHECKPOINTS))
def test_every_packed_run_was_computed_from_the_shipped_checkpoint(report):
    manifest = Manifest()
    dataset = CHECKPOINTS[report]
    runs = list((ROOT / "reports" / report / "runs").iterdir())
    assert runs
    for path in runs:
        described = json.loads((path / "run.json").read_text())
        entry = manifest.get(described["model"], dataset)
        assert described["checkpoint"]["sha256"] == entry.sha256, path.name


@pytest.mark.parametrize("report", sorted(REPORTS))
def test_table9_is_what_the_rotation_records_say(report):
    table = pd.read_csv(ROOT / "reports" / report / "table9_rotation.csv").set_index("model")
    for run in _runs(report, "rotation"):
        top1 = _percent(run.records, "top1")
        row = table.loc[run.model]
        assert row["n"] == run.records["index"].nunique()
        for condition in TABLE9:
            assert row[f"{condition}_top1"] == pytest.approx(top1[condition], abs=1e-3)
            assert row[f"{condition}_top1_drop"] == pytest.approx(top1["none"] - top1[condition], abs=1e-3)


@pytest.mark.parametrize("report", sorted(REPORTS))
def test_table10_is_what_the_pgd_records_say(report):
    table = pd.read_csv(ROOT / "reports" / report / "table10_pgd.csv").set_index("model")
    for run in _runs(report, "pgd"):
        top1, success = _percent(run.records, "top1"), _percent(run.records, "success")
        row = table.loc[run.model]
        assert row["clean_top1"] == pytest.approx(top1["clean"], abs=1e-3)
        for column, condition in (("n2", "pgd_eps8_step4_n2"), ("n4", "pgd_eps8_step2_n4")):
            assert row[f"{column}_top1"] == pytest.approx(top1[condition], abs=1e-3)
            assert row[f"{column}_success_rate"] == pytest.approx(success[condition], abs=1e-3)


@pytest.mark.parametrize("report", sorted(CORRUPTION))
def test_corruption_summary_is_what_the_records_say(report):
    """Hendrycks & Dietterich's CE_c = sum_s E_{s,c} / sum_s E^base_{s,c}, mCE its mean over the
    15 corruptions (in percent), recomputed from the records against resnet26's, on every image
    of the report (the whole test set for the full reports)."""
    table = pd.read_csv(ROOT / "reports" / report / "corruption_summary.csv").set_index("model")
    runs = {run.model: run for run in _runs(report, "corruption")}
    assert len(runs) == 7

    def errors(run) -> pd.Series:
        return 1 - run.records[run.records["condition"] != "clean"].groupby("condition")["top1"].mean()

    base = errors(runs["resnet26"])
    for model, run in runs.items():
        assert run.records.groupby("condition")["index"].nunique().eq(CORRUPTION[report]).all(), model
        err = errors(run)
        corruption = err.index.str.replace(r"_s[1-5]$", "", regex=True)
        ce = err.groupby(corruption).sum() / base.groupby(corruption).sum()
        assert len(ce) == table.loc[model, "corruptions"] == 15
        assert table.loc[model, "mCE"] == pytest.approx(ce.mean() * 100, abs=1e-3)
        assert table.loc[model, "corrupted_top1"] == pytest.approx((1 - err.mean()) * 100, abs=1e-3)


@pytest.mark.parametrize("report", sorted(AUTOATTACK))
def test_robust_accuracy_and_autoattack_members_are_what_the_attack_records_say(report):
    """The RobustBench-style table (clean, APGD-CE, AutoAttack top-1) and who fooled each image
    first, recomputed from the packed attack runs (protocols apgd and autoattack)."""
    table = pd.read_csv(ROOT / "reports" / report / "robust_accuracy.csv")
    members = pd.read_csv(ROOT / "reports" / report / "autoattack_members.csv")
    protocols, num_models = AUTOATTACK[report]
    on_gpu = _computed_on_a_gpu(report)
    seen = set()
    for protocol in protocols:
        for run in _runs(report, protocol):
            names = {c["name"]: c for c in run.description["conditions"]}
            for condition, group in run.records.groupby("condition"):
                c = names[condition]
                label = "clean" if condition == "clean" else \
                    f"{ {'autoattack': 'AutoAttack', 'apgd-ce': 'APGD-CE'}[c['attack']]} {c['eps'] * 255:.3g}/255"
                row = table[(table["model"] == run.model) & (table["column"] == label)]
                assert len(row) == 1, (run.model, label)
                assert row["n"].item() == len(group) == 1000
                # the table's clean column is one run's; another run's clean pass on a GPU may flip one image
                flipped = GPU_FLIPS if label == "clean" and run.model in on_gpu else 0
                assert row["top1"].item() == pytest.approx(group["top1"].mean() * 100, abs=flipped / 10 + 1e-3)
                assert (group["linf"] <= c["eps"] + 1e-6).all()
                if c["attack"] == "autoattack":
                    mine = members[(members["model"] == run.model) & (members["attack"] == label)].iloc[0]
                    counts = group["by"].value_counts()
                    for who in ("clean", "apgd-ce", "apgd-t", "fab-t", "square", "none"):
                        assert mine[who] == counts.get(who, 0), (run.model, who)
                    assert (group.loc[group["by"] == "none", "top1"] == 1).all()
                    # and an image a member fooled is misclassified in its record (no borderline flip)
                    assert (group.loc[~group["by"].isin(["clean", "none"]), "top1"] == 0).all(), run.model
                seen.add((protocol, run.model))
    assert len({m for _, m in seen}) == num_models


@pytest.mark.parametrize("report", ATTACKS)
def test_square_rows_are_what_the_square_records_say(report):
    """Square alone at 8/255 (score-based): top-1 in the RobustBench-style table, the
    perturbation within the budget, at most 1 + 5,000 queries per image (the clean check and the
    budget), and an image counted as fooled only when its prediction is wrong."""
    table = pd.read_csv(ROOT / "reports" / report / "robust_accuracy.csv")
    runs = _runs(report, "square")
    assert len(runs) == 7
    for run in runs:
        attacked = run.records[run.records["condition"] != "clean"]
        row = table[(table["model"] == run.model) & (table["column"] == "Square 8/255")]
        assert row["n"].item() == len(attacked) == 1000
        assert row["top1"].item() == pytest.approx(attacked["top1"].mean() * 100, abs=1e-3)
        assert (attacked["linf"] <= 8 / 255 + 1e-6).all()
        assert attacked["queries"].between(1, 5001).all()
        assert (attacked["success"] == (attacked["pred"] != attacked["label"])).all()
        # Square stops on an image once it finds it fooled (judged in its own, smaller batch): every
        # such image is misclassified in the record too (no borderline flip across batch sizes)
        assert (attacked.loc[attacked["queries"] < 5001, "top1"] == 0).all(), run.model


@pytest.mark.parametrize("report", sorted(AUTOATTACK_RADII))
def test_autoattack_at_every_radius_is_at_most_apgd_ce_alone_and_at_8_matches_the_study(report):
    """An AutoAttack report (1, 2, 4 and 8/255, the models it has finished) against its study: at
    each small radius its top-1 is not above APGD-CE alone by more than the images on which a
    differently seeded APGD-CE could differ (it should be lower: APGD-CE is its first member), and
    at 8/255 it is the study's own AutoAttack top-1 (the same images and seed: 0% on CIFAR-10,
    0-3.3% on Fashion-MNIST); clean top-1 is the study's on the same subset."""
    study_name, radii = AUTOATTACK_RADII[report]
    mine = pd.read_csv(ROOT / "reports" / report / "robust_accuracy.csv").set_index(["model", "column"])
    study = pd.read_csv(ROOT / "reports" / study_name / "robust_accuracy.csv").set_index(["model", "column"])
    models = sorted({m for m, _ in mine.index})
    assert len(models) == AUTOATTACK[report][1]
    on_gpu = _computed_on_a_gpu(report)
    for model in models:
        flipped = GPU_FLIPS if model in on_gpu else 0   # the device that may flip one
        assert mine.loc[(model, "clean"), "top1"] == pytest.approx(study.loc[(model, "clean"), "top1"],
                                                                   abs=flipped / 10 + 1e-9)
        for eps in radii:
            assert mine.loc[(model, f"AutoAttack {eps}/255"), "top1"] <= \
                study.loc[(model, f"APGD-CE {eps}/255"), "top1"] + 0.5, (model, eps)
        assert mine.loc[(model, "AutoAttack 8/255"), "top1"] == study.loc[(model, "AutoAttack 8/255"), "top1"], model
