"""The one-command study (robust_attn/study/run.py) and the findings it writes
(robust_attn/reports/comparison.py)."""
import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch

import robust_attn
from robust_attn.models.checkpoint import save_checkpoint
from robust_attn.cli import main
from robust_attn.reports.comparison import compare_models, findings_text, per_image_losses
from robust_attn.reports.runs import Run
from robust_attn.runs.store import RunStore
from robust_attn.study.config import StudyConfig
from robust_attn.study.run import TIMINGS_FILE, run_study
from robust_attn.models.wrapper import NormalizedModel


# --- comparison on hand-made records --------------------------------------------------------
def _rotation_run(model: str, base: np.ndarray, rotated: np.ndarray) -> Run:
    """A rotation run whose 'none' hits are ``base`` and all four rotated conditions ``rotated``."""
    n = len(base)
    frames = [pd.DataFrame({"condition": "none", "index": range(n), "top1": base, "top5": 1})]
    frames += [pd.DataFrame({"condition": c, "index": range(n), "top1": rotated, "top5": 1})
               for c in ("cw90", "cw180", "cw270", "flip_ud")]
    description = {"protocol": "rotation", "model": model, "dataset": {"name": "synthetic", "split": "test",
                                                                       "limit": None}}
    return Run(path=f"runs/{model}", description=description, records=pd.concat(frames, ignore_index=True))


def test_comparison_finds_the_model_that_loses_least_with_paired_intervals():
    rng = np.random.default_rng(0)
    n = 4000
    base = np.ones(n, dtype=int)
    # model a loses on 10% of the images, b on 10% plus 3% more; c swaps 3 of a's wins for 2 losses
    loses_a = rng.random(n) < 0.10
    loses_b = loses_a | (rng.random(n) < 0.03)
    loses_c = loses_a.copy()
    loses_c[np.flatnonzero(~loses_a)[:3]] = True
    loses_c[np.flatnonzero(loses_a)[:2]] = False
    runs = [_rotation_run(m, base, (~loses).astype(int))
            for m, loses in (("resnet26", loses_b), ("sasa_resnet26", loses_a), ("san10_pairwise", loses_c))]
    table = compare_models(runs, n_boot=300, seed=0)
    rows = table[table["measure"] == "rotation_drop"].set_index("model")
    assert list(table.sort_values("rank")["model"]) == ["sasa_resnet26", "san10_pairwise", "resnet26"]
    assert rows.loc["sasa_resnet26", "value"] == pytest.approx(100 * loses_a.mean())
    assert rows.loc["sasa_resnet26", "family"] == "sasa"
    # b's extra 3 points are resolved: the paired interval excludes 0 and contains the truth
    true_b = 100 * (loses_b.mean() - loses_a.mean())
    assert rows.loc["resnet26", "minus_best"] == pytest.approx(true_b)
    assert 0 < rows.loc["resnet26", "minus_best_low"] < true_b < rows.loc["resnet26", "minus_best_high"]
    # c is one image worse out of 4000 and differs on 5: its interval contains 0
    assert rows.loc["san10_pairwise", "minus_best"] == pytest.approx(100 / n)
    assert rows.loc["san10_pairwise", "minus_best_low"] < 0 < rows.loc["san10_pairwise", "minus_best_high"]
    # versus the convolutional baseline (resnet26): negative = attention loses less
    assert rows.loc["sasa_resnet26", "minus_baseline"] == pytest.approx(-true_b)
    assert np.isnan(rows.loc["resnet26", "minus_baseline"])
    # the paired interval is much narrower than the two separate intervals would suggest
    width_paired = rows.loc["resnet26", "minus_best_high"] - rows.loc["resnet26", "minus_best_low"]
    width_own = rows.loc["resnet26", "high"] - rows.loc["resnet26", "low"]
    assert width_paired < width_own
    text = "\n".join(findings_text(table))
    assert "sasa_resnet26 loses least" in text and "the lead is not established" in text


def test_a_small_drop_from_a_low_clean_top1_is_named_as_such():
    """A drop ranks what a model loses, not what it keeps: a model that starts from 40% and keeps
    30% under rotation loses least, and the finding says that its rotated top-1 is 20 points below
    that of the model that starts from 100% and keeps 50%. Where the model that loses least also
    keeps most, nothing is added."""
    n = 1000
    idx = np.arange(n)
    strong = _rotation_run("resnet26", np.ones(n, dtype=int), (idx % 2 == 0).astype(int))      # 100% -> 50%
    weak = _rotation_run("resnet26-adv", (idx % 10 < 4).astype(int), (idx % 10 < 3).astype(int))   # 40% -> 30%
    table = compare_models([strong, weak], n_boot=200, seed=0)
    rows = table.set_index("model")
    assert rows.loc["resnet26-adv", "rank"] == 1
    assert rows.loc["resnet26-adv", ["clean", "kept"]].tolist() == pytest.approx([40.0, 30.0])
    assert rows.loc["resnet26", ["clean", "kept"]].tolist() == pytest.approx([100.0, 50.0])
    assert (rows["kept_top"] == "resnet26").all()
    assert rows.loc["resnet26-adv", "kept_minus_top"] == pytest.approx(-20.0)
    low, high = rows.loc["resnet26-adv", ["kept_minus_top_low", "kept_minus_top_high"]]
    assert low < -20.0 < high < 0
    text = findings_text(table)[2]
    assert text.startswith("**rotation: mean top-1 drop over 90°, 180°, 270° and upside-down**: "
                           "resnet26-adv loses least")
    assert ("its own clean top-1 (40.00%): resnet26-adv's rotated top-1 (mean over the four rotations) itself, "
            "30.00%, is 20.00 points [") in text and "below resnet26's 50.00%, the highest." in text
    both = compare_models([strong, _rotation_run("resnet26-adv", np.ones(n, dtype=int), (idx % 10 < 6).astype(int))],
                          n_boot=200, seed=0)
    assert "its own clean top-1" not in findings_text(both)[2]
    close = _rotation_run("resnet26-adv", (idx % 100 < 51).astype(int), (idx < 499).astype(int))   # 51% -> 49.9%
    near = compare_models([strong, close], n_boot=200, seed=0).set_index("model")
    assert near.loc["resnet26-adv", "rank"] == 1 and near.loc["resnet26-adv", "kept_minus_top"] == pytest.approx(-0.1)
    assert near.loc["resnet26-adv", "kept_minus_top_low"] < 0 < near.loc["resnet26-adv", "kept_minus_top_high"]
    assert "its own clean top-1" not in findings_text(near.reset_index())[2]   # keeps less, but not resolved


def _attack_run(model: str, clean: np.ndarray, attacked: dict[str, np.ndarray]) -> Run:
    """An attack run: 'clean' hits ``clean``, each attack condition its own hits."""
    n = len(clean)
    frames = [pd.DataFrame({"condition": "clean", "index": range(n), "top1": clean})]
    frames += [pd.DataFrame({"condition": c, "index": range(n), "top1": hits}) for c, hits in attacked.items()]
    conditions = [{"name": "clean", "attack": "none", "eps": 0.0}]
    conditions += [{"name": c, "attack": "autoattack", "norm": "linf", "eps": int(c[-1]) / 255, "targeted": False}
                   for c in attacked]
    description = {"protocol": "attack", "model": model, "conditions": conditions,
                   "dataset": {"name": "synthetic", "split": "test", "limit": None}}
    return Run(path=f"runs/attack-{model}", description=description, records=pd.concat(frames, ignore_index=True))


def test_findings_give_each_attacks_drop_and_its_paired_difference_from_the_baseline():
    """An attack-only comparison (no rotation, no Table 10) still has findings: per attack and
    model the drop with its interval, and the paired difference from resnet26."""
    rng = np.random.default_rng(1)
    n = 2000
    clean = np.ones(n, dtype=int)
    fooled_base = rng.random(n) < 0.5
    fooled_other = fooled_base & (rng.random(n) < 0.8)   # 20% of resnet26's losses kept: about 10 points less
    runs = [_attack_run("resnet26", clean, {"autoattack_linf_eps1": (~fooled_base).astype(int),
                                            "autoattack_linf_eps2": np.zeros(n, dtype=int)}),
            _attack_run("ea_resnet26", clean, {"autoattack_linf_eps1": (~fooled_other).astype(int),
                                               "autoattack_linf_eps2": np.zeros(n, dtype=int)})]
    table = compare_models(runs, n_boot=200, seed=0)
    lines = findings_text(table)
    text = "\n".join(lines)
    assert "under each evaluation attack, on 2000 attacked images" in text
    header = next(line for line in lines if line.startswith("| model | AutoAttack"))
    assert header == "| model | AutoAttack 1/255 | AutoAttack 2/255 |"
    rows = [line for line in lines if line.startswith("| ea_resnet26 |")]
    assert len(rows) == 2   # the drop table and the difference table
    drop, diff = (r.split(" | ") for r in rows)
    assert drop[1].startswith(f"{100 * fooled_other.mean():.1f} [")
    assert drop[2].startswith("100.0 [100.0, 100.0]")
    expected = 100 * (fooled_other.mean() - fooled_base.mean())
    assert diff[1].startswith(f"{expected:+.2f} [") and "(n.s.)" not in diff[1]
    assert diff[2].strip(" |").startswith("+0.00 [+0.00, +0.00] (n.s.)")
    assert any(line.startswith("| resnet26 | - | - |") for line in lines)


def test_runs_on_different_images_are_not_compared():
    base = np.ones(10, dtype=int)
    a = _rotation_run("resnet26", base, base)
    b = _rotation_run("sasa_resnet26", base, base)
    b.description["dataset"] = {"name": "synthetic", "split": "test", "limit": 10}
    losses = per_image_losses([a, b])
    assert len(losses) == 2 and all(frame.shape[1] == 1 for frame in losses.values())


# --- the study end to end on tiny models ----------------------------------------------------
@pytest.fixture
def tiny_zoo(tmp_path):
    manifest_path = tmp_path / "zoo" / "manifest.json"
    for name in ("resnet26", "sasa_resnet26"):
        torch.manual_seed(0)
        model = robust_attn.create_model(name, 10, "cifar", width=0.25, stem_downsample=4)
        path = tmp_path / "ckpt" / f"{name}.safetensors"
        save_checkpoint(path, NormalizedModel(model, (0.5,) * 3, (0.25,) * 3).eval())
        assert main(["zoo", "add", name, "--dataset", "synthetic", "--checkpoint", str(path),
                     "--manifest", str(manifest_path)]) == 0
    return manifest_path


def test_study_runs_every_zoo_model_then_resumes_for_free(tmp_path, tiny_zoo):
    config = StudyConfig(dataset="synthetic", limit=12, angle_step=90, sweep_eps=(2 / 255, 8 / 255), sweep_steps=2,
                         batch_size=8, bootstrap=50, protocols=("rotation", "pgd"))
    runs, report = tmp_path / "runs", tmp_path / "report"
    files = run_study(config, runs, report, manifest=tiny_zoo, device="cpu", progress=False, log=lambda *_: None)
    names = {f.name for f in files}
    assert {"report.md", "table9_rotation.md", "table10_pgd.md", "comparison.csv", "study.json",
            "rotation_angle.png", "pgd_eps.png", "comparison.png"} <= names
    # both models attacked towards the same targets, with the paper's settings and the sweep
    targets = [pd.read_csv(runs / f"pgd-{m}" / "targets.csv") for m in ("resnet26", "sasa_resnet26")]
    pd.testing.assert_frame_equal(targets[0], targets[1])
    conditions = [c["name"] for c in json.loads((runs / "pgd-resnet26" / "run.json").read_text())["conditions"]]
    assert conditions == ["clean", "pgd_eps8_step4_n2", "pgd_eps8_step2_n4", "pgd_eps2_step1_n2"]
    comparison = pd.read_csv(report / "comparison.csv")
    assert set(comparison["model"]) == {"resnet26", "sasa_resnet26"}
    assert (comparison["n"] == 12).all()
    # the findings agree with the per-image records they come from
    rot = pd.concat(pd.read_csv(p) for p in sorted((runs / "rotation-resnet26" / "records").rglob("*.csv")))
    hits = rot.pivot_table(index="index", columns="condition", values="top1")
    expected = 100 * (hits["none"] - hits[["cw90", "cw180", "cw270", "flip_ud"]].mean(axis=1)).mean()
    got = comparison.query("model == 'resnet26' and measure == 'rotation_drop'")["value"].item()
    assert got == pytest.approx(expected)
    report_text = (report / "report.md").read_text()
    assert "## Findings: which model loses least" in report_text and "loses least" in report_text
    timings = pd.read_csv(runs / TIMINGS_FILE)
    assert len(timings) == 4 and (timings["chunks_written"] > 0).all()
    # the compute time per model and step: each run's chunk seconds, summed (as the packed run keeps them)
    packed = sorted((report / "runs").iterdir())
    table = report_text.split("Compute time per model and step", 1)[1].split("\n\n")[1].splitlines()
    assert table[0] == "| model | rotation (s) | pgd (s) |"
    for model in ("resnet26", "sasa_resnet26"):
        spent = [RunStore(runs / f"{step}-{model}").compute_time() for step in ("rotation", "pgd")]
        assert all(t["timed"] == t["chunks"] > 0 for t in spent)
        assert f"| {model} | {spent[0]['seconds']:.0f} | {spent[1]['seconds']:.0f} |" in table
        assert RunStore(report / "runs" / f"pgd-{model}").compute_time() == spent[1]
    # the packed runs beside the report derive the same report again
    assert [p.name for p in packed] == ["pgd-resnet26", "pgd-sasa_resnet26", "rotation-resnet26",
                                        "rotation-sasa_resnet26"]
    assert main(["report", *map(str, packed), "--out", str(tmp_path / "again"), "--bootstrap", "50"]) == 0
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "again" / "comparison.csv"), comparison)
    # a second call finds every run complete: nothing computed, same comparison
    run_study(config, runs, report, manifest=tiny_zoo, device="cpu", progress=False, log=lambda *_: None)
    timings = pd.read_csv(runs / TIMINGS_FILE)
    assert len(timings) == 8 and (timings["chunks_written"].iloc[4:] == 0).all()
    pd.testing.assert_frame_equal(pd.read_csv(report / "comparison.csv"), comparison)


def test_the_compute_table_sums_the_chunks_and_bounds_a_run_that_predates_their_timing(tmp_path):
    from robust_attn.study.run import _compute_table

    def run(name, seconds):   # two chunks, each with its seconds (None: written before chunks kept them)
        store = RunStore(tmp_path / name)
        store.open({"protocol": "rotation", "model": name, "num_images": 4, "chunk_size": 2, "command": ["x"],
                    "conditions": [{"name": "none"}]})
        for start, spent in zip((0, 2), seconds):
            store.write_chunk("none", start, start + 2, pd.DataFrame({"index": [start, start + 1], "top1": [1, 0]}),
                              seconds=spent)
        return store.root

    runs = [run("rotation-a", (10.0, 20.0)), run("rotation-b", (None, 5.0)), run("rotation-c", (None, None)),
            run("pgd-c", (None, None))]
    logged = pd.DataFrame({"model": ["b", "c", "c", "c"], "protocol": ["rotation", "rotation", "rotation", "pgd"],
                           "seconds": [2.0, 40.0, 1.0, 7.0], "chunks_written": [1, 1, 0, 1]})
    table = _compute_table(runs, logged)
    assert table[2:-1] == ["| model | rotation (s) | pgd (s) |", "|:--|--:|--:|",
                           "| a | 30 | - |",        # every chunk timed: their sum
                           "| b | >= 5 | - |",      # half timed: the larger of 5 (chunks) and 2 (timings.csv)
                           "| c | >= 40 | >= 7 |"]  # none timed: timings.csv's calls that wrote chunks
    assert _compute_table(runs[2:]) == []          # nothing known: no table


def test_study_attack_protocols_end_to_end(tmp_path, tiny_zoo):
    """AutoAttack, Square, the transfer matrix and the masking checks on two tiny models: the
    report's sections agree with the records, and `report` derives them again from the packed runs."""
    from robust_attn.protocols.study_step import list_study_protocols
    from robust_attn.runs.store import load_records

    needed = {"apgd", "autoattack", "square", "transfer", "masking"}
    if not {"apgd-ce", "apgd-t", "fab-t", "square", "pgd"} <= set(robust_attn.attacks.list_attacks()):
        pytest.skip("an attack of AutoAttack's ensemble is not registered")
    assert needed <= set(list_study_protocols())
    config = StudyConfig(dataset="synthetic", limit=8, attack_limit=6, autoattack_eps=(2 / 255, 8 / 255), apgd_eps=(1 / 255, 2 / 255),
                         square_queries=20, attack_steps=3, transfer_steps=2, masking_images=4, batch_size=8,
                         attack_batch_size=3, bootstrap=20,
                         protocols=("apgd", "autoattack", "square", "transfer", "masking"))
    runs, report = tmp_path / "runs", tmp_path / "report"
    said = []
    files = run_study(config, runs, report, manifest=tiny_zoo, device="cpu", progress=False,
                      log=lambda *a: said.append(" ".join(map(str, a))))
    # on a CPU the study says what AutoAttack costs per image it cannot fool: 3 iterations of
    # APGD-CE, and of APGD-T and FAB-T per each of 9 target classes; Square's 20 queries
    assert [line for line in said if line.startswith("study: AutoAttack on a CPU: each image it cannot fool "
                                                      "costs about 57 forward-backward and 20 forward passes "
                                                      "per radius (6 images, radii 2/8/255, 2 model(s))")]
    names = {f.name for f in files}
    assert {"robust_accuracy.csv", "transfer_matrix.csv", "transfer_matrix.png", "masking_checks.csv",
            "autoattack_members.csv"} <= names
    table = pd.read_csv(report / "robust_accuracy.csv")
    from robust_attn.reports.masking_marks import MARK

    flagged = set(pd.read_csv(report / "masking_checks.csv").query("verdict == 'flag'")["model"])

    def shown(model):   # a model a masking check flagged carries the mark in every table
        return model + MARK if model in flagged else model

    assert set(table["model"]) == {shown("resnet26"), shown("sasa_resnet26")}
    aa = load_records(runs / "autoattack-resnet26")
    for condition, group in aa.groupby("condition"):
        column = {"clean": "clean", "autoattack_linf_eps2_n3": "AutoAttack 2/255",
                  "autoattack_linf_eps8_n3": "AutoAttack 8/255"}[condition]
        row = table[(table["model"] == shown("resnet26")) & (table["column"] == column)]
        assert row["top1"].item() == pytest.approx(group["top1"].mean() * 100)
        assert row["n"].item() == 6
    # who fooled each image first, per AutoAttack radius: the records' `by`, counted
    members = pd.read_csv(report / "autoattack_members.csv")
    for condition, label in (("autoattack_linf_eps2_n3", "AutoAttack 2/255"), ("autoattack_linf_eps8_n3",
                                                                                 "AutoAttack 8/255")):
        row = members[(members["model"] == shown("resnet26")) & (members["attack"] == label)].iloc[0]
        by = aa.loc[aa["condition"] == condition, "by"].value_counts()
        assert row["images"] == 6 and sum(row[c] for c in ("clean", "apgd-ce", "apgd-t", "fab-t", "square",
                                                           "none")) == 6
        for who in ("clean", "apgd-ce", "apgd-t", "fab-t", "square", "none"):
            assert row[who] == by.get(who, 0), who
    # APGD-CE alone at its own radii, on the same images, in the same table
    apgd = load_records(runs / "apgd-resnet26")
    assert set(apgd["condition"]) == {"clean", "apgd-ce_linf_eps1_n3", "apgd-ce_linf_eps2_n3"}
    for condition, column in (("apgd-ce_linf_eps1_n3", "APGD-CE 1/255"), ("apgd-ce_linf_eps2_n3", "APGD-CE 2/255")):
        group = apgd[apgd["condition"] == condition]
        assert sorted(group["index"]) == sorted(aa.loc[aa["condition"] == "clean", "index"])
        assert (group["linf"] <= float(column.split()[1].split("/")[0]) / 255 + 1e-6).all()
        row = table[(table["model"] == shown("resnet26")) & (table["column"] == column)]
        assert row["top1"].item() == pytest.approx(group["top1"].mean() * 100)
    # AutoAttack attacks only the clean-correct images and keeps every fooled one fooled
    attacked = aa[aa["condition"] != "clean"]
    assert (attacked.loc[attacked["clean_pred"] != attacked["label"], "by"] == "clean").all()
    assert (attacked.loc[attacked["top1"] == 0, "by"] != "none").all()
    # the transfer matrix's diagonal is each model attacked with its own images
    matrix = pd.read_csv(report / "transfer_matrix.csv").set_index("source")
    transfer = load_records(runs / "transfer-resnet26")
    own = transfer[(transfer["target_model"] == "resnet26") & (transfer["target"] == -1)
                   & ~transfer["condition"].str.startswith("clean")]
    assert matrix.loc[shown("resnet26"), "resnet26"] == pytest.approx(own["top1"].mean() * 100)
    assert (own["success"] == own["source_success"]).all()
    checks = pd.read_csv(report / "masking_checks.csv")
    assert set(checks["check"]) >= {"blackbox_beats_whitebox", "unbounded_attack", "gain_with_strength",
                                    "input_gradients", "loss_saturation"}
    assert set(checks["model"]) == {"resnet26", "sasa_resnet26"}
    assert "## Robust accuracy" in (report / "report.md").read_text()
    packed = sorted((report / "runs").iterdir())
    assert main(["report", *map(str, packed), "--out", str(tmp_path / "again"), "--bootstrap", "20"]) == 0
    assert "APGD-CE alone (AutoAttack's first member)" in (report / "report.md").read_text()
    for name in ("robust_accuracy.csv", "transfer_matrix.csv", "masking_checks.csv", "autoattack_members.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "again" / name), pd.read_csv(report / name))


def test_masking_checks_gain_with_eps_on_the_apgd_sweep_when_autoattack_ran_at_one_radius(tmp_path, tiny_zoo):
    """On a CPU the study runs AutoAttack at 8/255 only; the gain-with-strength check then reads
    APGD-CE's success at its radii, from the apgd runs, and at 8/255 from AutoAttack's records
    (its first member, APGD-CE with the same iterations)."""
    from robust_attn.runs.store import load_records

    config = StudyConfig(dataset="synthetic", limit=6, attack_limit=6, autoattack_eps=(8 / 255,), apgd_eps=(1 / 255, 4 / 255),
                         square_queries=10, attack_steps=2, masking_images=3, batch_size=6, attack_batch_size=6,
                         bootstrap=10, protocols=("apgd", "autoattack", "masking"))
    runs, report = tmp_path / "runs", tmp_path / "report"
    run_study(config, runs, report, manifest=tiny_zoo, device="cpu", progress=False, log=lambda *_: None)
    for model in ("resnet26", "sasa_resnet26"):
        checks = json.loads((runs / f"masking-{model}" / "checks.json").read_text())
        gain = next(c for c in checks if c["name"] == "gain_with_strength")
        apgd = load_records(runs / f"apgd-{model}")
        expected = [apgd.loc[apgd["condition"] == f"apgd-ce_linf_eps{e}_n2", "success"].mean() for e in (1, 4)]
        aa = load_records(runs / f"autoattack-{model}")
        aa = aa[aa["condition"] == "autoattack_linf_eps8_n2"]
        first = aa["clean_pred"].ne(aa["label"]) | aa["by"].eq("apgd-ce")   # misclassified, or APGD-CE fooled it
        assert len(aa) == 6 and first.sum() >= aa["clean_pred"].ne(aa["label"]).sum()
        expected.append(first.mean())
        assert gain["evidence"]["order"] == ["APGD-CE 1/255", "APGD-CE 4/255", "APGD-CE 8/255"]
        assert gain["evidence"]["rates"] == pytest.approx(expected)


def _efficient_settings(images: int) -> StudyConfig:
    """The efficient CIFAR-10 study's attack settings, tiny: AutoAttack at 2/255, APGD-CE at 1 and
    8/255, Square and the transfer attacks at 8/255, then the masking checks, on ``images`` images."""
    return StudyConfig(dataset="synthetic", limit=images, attack_limit=images, autoattack_eps=(2 / 255,),
                       apgd_eps=(1 / 255, 8 / 255), square_eps=8 / 255, square_queries=10, attack_steps=2,
                       transfer_steps=2, masking_images=3, batch_size=images, attack_batch_size=images, bootstrap=10,
                       protocols=("apgd", "autoattack", "square", "transfer", "masking"))


def test_masking_holds_square_and_transfer_to_apgd_ce_at_their_radius_when_autoattack_ran_at_another(tmp_path,
                                                                                                    tiny_zoo):
    """AutoAttack at 2/255 and Square and the transfer attacks at 8/255 (the efficient study's
    settings): the black-box sources are compared with APGD-CE at 8/255 from the apgd runs, on the
    same images, and their names say so; AutoAttack's own Square member with AutoAttack."""
    from robust_attn.runs.store import load_records

    config = _efficient_settings(6)
    runs = tmp_path / "runs"
    run_study(config, runs, tmp_path / "report", manifest=tiny_zoo, device="cpu", progress=False,
              log=lambda *_: None)
    for model, other in (("resnet26", "sasa_resnet26"), ("sasa_resnet26", "resnet26")):
        checks = json.loads((runs / f"masking-{model}" / "checks.json").read_text())
        evidence = next(c for c in checks if c["name"] == "blackbox_beats_whitebox")["evidence"]
        square = "square 8/255 (against APGD-CE 8/255)"
        transfer = f"transfer from {other} 8/255 (against APGD-CE 8/255)"
        assert set(evidence) == {"autoattack's square", square, transfer}
        apgd = load_records(runs / f"apgd-{model}")
        fooled = apgd.loc[apgd["condition"] == "apgd-ce_linf_eps8_n2"].set_index("index")["success"].astype(bool)
        sq = load_records(runs / f"square-{model}")
        sq = sq[sq["condition"] != "clean"].set_index("index")["success"].astype(bool)
        assert evidence[square]["compared"] == 6 and evidence[square]["white_success"] == int(fooled.sum())
        assert evidence[square]["beats"] + evidence[square].get("near_misses", 0) == int((sq & ~fooled.reindex(
            sq.index)).sum())
        assert evidence[transfer]["white_success"] == int(fooled.sum())


def _blind_apgd_ce_study(tmp_path, monkeypatch):
    """The efficient study's attack settings on two tiny ResNets (a zoo in ``tmp_path``), the
    synthetic images labelled by resnet26's own prediction, and APGD-CE blind (it returns the
    clean images): every image Square fools is beyond APGD-CE. Returns the config, the manifest
    and the models."""
    from robust_attn.attacks.apgd import APGDCE
    from robust_attn.attacks.base import AttackOutput
    from robust_attn.data import synthetic
    from helpers import tiny_resnet

    manifest = tmp_path / "zoo" / "manifest.json"
    models = {"resnet26": tiny_resnet(1, stem_downsample=4), "resnet26_b": tiny_resnet(2, stem_downsample=4)}
    for name, model in models.items():   # two ResNets with random batch norm
        path = tmp_path / "ckpt" / f"{name}.safetensors"
        save_checkpoint(path, model)
        assert main(["zoo", "add", name, "--dataset", "synthetic", "--checkpoint", str(path),
                     "--manifest", str(manifest)]) == 0
    make_images = synthetic.make_images

    def labelled_by_resnet26(split, *args, **kwargs):   # resnet26 classifies every image "correctly"
        images, _ = make_images(split, *args, **kwargs)
        with torch.no_grad():
            return images, models["resnet26"](images.float() / 255).argmax(1)

    monkeypatch.setattr(synthetic, "make_images", labelled_by_resnet26)
    monkeypatch.setattr(APGDCE, "_run", lambda self, model, images, labels, targets: AttackOutput(images.clone()))
    return dataclasses.replace(_efficient_settings(12), autoattack_limit=4, models=tuple(models)), manifest, models


def test_what_the_followup_leaves_is_measured_for_near_misses_at_each_sources_radius(tmp_path, monkeypatch):
    """Where the white-box follow-up fools nothing (faked), every image a black-box source fools
    beyond the blind APGD-CE goes to the near-miss measurement at that source's radius (8/255 for
    Square and the transfer attacks, held to APGD-CE there); with every margin closed (faked) they
    are all near misses, and none flags."""
    from robust_attn.attacks.masking import followup, near_miss

    config, manifest, models = _blind_apgd_ce_study(tmp_path, monkeypatch)
    monkeypatch.setattr(followup, "whitebox_followup", lambda model, images, labels, indices, eps, **kw: pd.DataFrame(
        {"index": [int(i) for i in indices], "eps": float(eps), "by": "none"}))
    measured = []

    def closed(model, images, labels, indices, eps, **kw):
        measured.append((round(eps * 255), sorted(int(i) for i in indices)))
        return pd.DataFrame({"index": indices, "eps": eps, "clean_margin": 1.0, "margin": 0.25})

    monkeypatch.setattr(near_miss, "margins", closed)
    monkeypatch.setattr(near_miss, "RARE", 1.0)   # every image may be a near miss here (the bound: test_masking.py)
    runs = tmp_path / "runs"
    run_study(config, runs, tmp_path / "report", manifest=manifest, device="cpu", progress=False,
              log=lambda *_: None)
    assert {radius for radius, _ in measured} <= {2, 8}   # AutoAttack's own Square at its 2/255, the rest at 8
    followed = [model for model in models if (runs / f"masking-{model}" / "whitebox_followup.csv").is_file()]
    assert "resnet26" in followed   # Square fools images the blind APGD-CE cannot
    for model in followed:
        check = next(c for c in json.loads((runs / f"masking-{model}" / "checks.json").read_text())
                     if c["name"] == "blackbox_beats_whitebox")
        won = sorted(pd.read_csv(runs / f"masking-{model}" / "whitebox_followup.csv")["index"])   # all at 8/255
        assert (8, won) in measured
        assert check["verdict"] == "pass" and all(e["beats"] == 0 for e in check["evidence"].values())
        assert sum(e.get("near_misses", 0) for e in check["evidence"].values()) >= len(won) > 0


def test_images_beyond_apgd_ce_alone_are_attacked_again_by_the_other_white_box_members(tmp_path, monkeypatch):
    """With APGD-CE as the only white-box attack at Square's radius (the efficient study's
    settings) and blind here (it returns the clean images), the images Square or a transfer attack
    fools are attacked again with APGD-T and FAB-T; the check counts only those they miss too, and
    the per-image follow-up is saved beside checks.json."""
    from robust_attn.runs.store import load_records

    config, manifest, models = _blind_apgd_ce_study(tmp_path, monkeypatch)
    runs = tmp_path / "runs"
    run_study(config, runs, tmp_path / "report", manifest=manifest, device="cpu", progress=False,
              log=lambda *_: None)
    cleared = 0
    for model, other in (("resnet26", "resnet26_b"), ("resnet26_b", "resnet26")):
        apgd = load_records(runs / f"apgd-{model}")
        fooled = apgd.loc[apgd["condition"] == "apgd-ce_linf_eps8_n2"].set_index("index")["success"].astype(bool)
        sq = load_records(runs / f"square-{model}")
        sq = sq[sq["condition"] != "clean"].set_index("index")["success"].astype(bool)
        tr = load_records(runs / f"transfer-{other}")
        tr = tr[(tr["target_model"] == model) & (tr["target"] == -1) & ~tr["condition"].str.startswith("clean.")]
        tr = tr[tr["condition"] == tr["condition"].iloc[0]].set_index("index")["success"].astype(bool)
        contested = {"square 8/255 (against APGD-CE 8/255)": sorted(sq.index[sq & ~fooled.reindex(sq.index)]),
                     f"transfer from {other} 8/255 (against APGD-CE 8/255)":
                         sorted(tr.index[tr & ~fooled.reindex(tr.index)])}
        if model == "resnet26":   # Square fools what the blind APGD-CE cannot
            assert contested["square 8/255 (against APGD-CE 8/255)"]
        checks = json.loads((runs / f"masking-{model}" / "checks.json").read_text())
        check = next(c for c in checks if c["name"] == "blackbox_beats_whitebox")
        saved = runs / f"masking-{model}" / "whitebox_followup.csv"
        if not any(contested.values()):
            assert not saved.exists() and all("followup" not in e for e in check["evidence"].values())
            continue
        followup = pd.read_csv(saved)
        assert sorted(followup["index"]) == sorted(set().union(*contested.values()))
        assert np.allclose(followup["eps"], 8 / 255) and set(followup["by"]) <= {"apgd-t", "fab-t", "none"}
        by = followup.set_index("index")["by"]
        left = sorted(by.index[by == "none"])   # what the follow-up left: its margins measured at 8/255
        margins = runs / f"masking-{model}" / "whitebox_margins.csv"
        assert margins.is_file() == bool(left)
        if left:
            saved_margins = pd.read_csv(margins)
            assert sorted(saved_margins["index"]) == left and np.allclose(saved_margins["eps"], 8 / 255)
        for source, indices in contested.items():
            evidence = check["evidence"][source]
            assert evidence["beats"] + evidence.get("near_misses", 0) == int((by.loc[indices] == "none").sum())
            if indices:
                assert evidence["followup"]["beat_white_box"] == len(indices)
            else:   # nothing beyond APGD-CE: nothing to follow up
                assert "followup" not in evidence
        assert check["verdict"] == ("flag" if any(check["evidence"][s]["beats"] for s in contested) else "pass")
        cleared += int((by != "none").sum())
    assert cleared > 0   # the follow-up fooled images here, so the test tells it from a no-op


def test_two_study_workers_share_the_runs_and_equal_one_process(tmp_path, tiny_zoo):
    """Two processes of one thread claim disjoint chunks of every run; the records are those of one
    process, and the report is written once."""
    from robust_attn.runs.store import load_records

    config = StudyConfig(dataset="synthetic", limit=12, angle_step=90, sweep_eps=(2 / 255,), sweep_steps=1,
                         batch_size=2, bootstrap=20, protocols=("rotation", "pgd"))
    quiet = dict(manifest=tiny_zoo, device="cpu", progress=False, log=lambda *_: None)
    run_study(config, tmp_path / "two", tmp_path / "two_report", workers=2, **quiet)
    run_study(config, tmp_path / "one", tmp_path / "one_report", **quiet)
    for run in ("rotation-resnet26", "pgd-sasa_resnet26", "pgd-resnet26"):
        pd.testing.assert_frame_equal(load_records(tmp_path / "two" / run), load_records(tmp_path / "one" / run))
    timings = pd.read_csv(tmp_path / "two" / TIMINGS_FILE)
    assert len(timings) == 4 and (timings["workers"] == 2).all()     # one row per model and protocol
    assert not list((tmp_path / "two").rglob("*.claim*"))              # every claim released


def test_study_command_names_what_is_wrong(tmp_path, tiny_zoo, capsys):
    common = ["--dataset", "synthetic", "--manifest", str(tiny_zoo), "--runs", str(tmp_path / "r"),
              "--out", str(tmp_path / "o"), "--no-progress"]
    assert main(["study", "--models", "san10_pairwise", *common]) == 2
    assert "the zoo has ['resnet26', 'sasa_resnet26']" in capsys.readouterr().err
    assert main(["study", "--sweep-eps=-1/255", *common]) == 2
    assert "--sweep-eps -1/255: eps must be >= 0" in capsys.readouterr().err
    assert main(["study", "--apgd-eps", "1/255,8", *common]) == 2   # a bare number is in image units here too
    assert "--apgd-eps 8 is more than the whole [0, 1] pixel range" in capsys.readouterr().err
    assert main(["study", "--square-eps", "16", *common]) == 2
    assert "for 16 of 255 grey levels write 16/255" in capsys.readouterr().err
    assert main(["study", "--dataset", "cifar100", "--manifest", str(tiny_zoo), "--no-progress"]) == 2
    assert "no model trained on 'cifar100'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() and not (tmp_path / "o").exists()   # nothing half-written


@pytest.mark.slow
def test_study_under_torchrun_gives_the_single_process_records(tmp_path, tiny_zoo):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from robust_attn.runs.store import load_records

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    args = ["study", "--dataset", "synthetic", "--manifest", str(tiny_zoo), "--limit", "6", "--batch-size", "2",
            "--angle-step", "90", "--sweep-eps", "2/255", "--sweep-steps", "1", "--bootstrap", "20", "--device", "cpu",
            "--protocols", "rotation,pgd", "--no-progress"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "robust_attn.cli", *args, "--runs", str(tmp_path / "ddp"), "--out", str(tmp_path / "ddp_report")]
    result = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert main([*args, "--runs", str(tmp_path / "one"), "--out", str(tmp_path / "one_report")]) == 0
    for run in ("rotation-resnet26", "pgd-sasa_resnet26"):
        pd.testing.assert_frame_equal(load_records(tmp_path / "ddp" / run), load_records(tmp_path / "one" / run))
    assert (pd.read_csv(tmp_path / "ddp" / TIMINGS_FILE)["processes"] == 2).all()
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "ddp_report" / "comparison.csv"),
                                  pd.read_csv(tmp_path / "one_report" / "comparison.csv"))


def test_the_report_preamble_describes_only_the_protocols_that_ran(tmp_path):
    """A study of the masking checks alone must not say that AutoAttack, Square or a transfer
    matrix were run, nor one of corruptions that occlusion and shuffle were."""
    from robust_attn.study.config import StudyConfig
    from robust_attn.study.run import _preamble

    config = StudyConfig(dataset="cifar10", protocols=("masking",))
    text = "\n".join(_preamble(config, tmp_path, 2000, 1000, []))
    assert "gradient-masking checks" in text and "first 100 of these images" in text
    assert "AutoAttack" not in text and "Square" not in text and "transfer" not in text
    both = "\n".join(_preamble(StudyConfig(dataset="cifar10", protocols=("transfer", "masking")), tmp_path,
                               2000, 1000, []))
    assert "transfer matrix" in both and "AutoAttack" not in both
    shifts = "\n".join(_preamble(StudyConfig(dataset="cifar10", protocols=("rotation", "corruption")), tmp_path,
                                 2000, 1000, []))
    assert "Rotation: SAN Table 9" in shifts and "Corruptions: `common` at severities 1, 2, 3, 4, 5" in shifts
    assert "Occlusion" not in shifts and "shuffle" not in shifts and "PGD" not in shifts and "Attacks" not in shifts


def test_every_study_protocol_describes_itself_for_the_report():
    """A protocol joins the study in its own file: its registration carries the preamble's sentence."""
    from robust_attn.protocols.study_step import STUDY_PROTOCOLS, list_study_protocols
    from robust_attn.study.config import StudyConfig

    config = StudyConfig(dataset="cifar10")
    for name in list_study_protocols():
        step = STUDY_PROTOCOLS[name]
        assert step.describe is not None, name
        assert step.describe(config).strip(), name
    assert {n for n in list_study_protocols() if STUDY_PROTOCOLS[n].attack_subset} == {
        "apgd", "autoattack", "square", "transfer", "masking"}


def test_a_study_on_the_reference_attention_path_records_it_and_resumes_on_the_lean_one(tmp_path, tiny_zoo,
                                                                                        monkeypatch):
    from robust_attn.layers import sasa

    calls = []
    reference = sasa.local_attention_reference
    monkeypatch.setattr(sasa, "local_attention_reference", lambda *a, **k: calls.append(1) or reference(*a, **k))
    config = StudyConfig(dataset="synthetic", limit=8, angle_step=90, batch_size=4, bootstrap=20,
                         protocols=("rotation",), models=("sasa_resnet26",))
    quiet = dict(manifest=tiny_zoo, device="cpu", progress=False, log=lambda *_: None)
    with pytest.raises(ValueError, match="one of lean, reference"):
        run_study(config, tmp_path / "bad", tmp_path / "bad-report", attention_path="unfold", **quiet)
    runs = tmp_path / "runs"
    run_study(config, runs, tmp_path / "report", attention_path="reference", **quiet)
    assert calls, "the SASA layers did not compute on the reference path"
    run = runs / "rotation-sasa_resnet26"
    assert json.loads((run / "run.json").read_text())["attention_path"] == "reference"
    # the same records as on the lean path (one function; float rounding only)
    lean_runs = tmp_path / "lean"
    run_study(config, lean_runs, tmp_path / "lean-report", **quiet)
    assert json.loads((lean_runs / "rotation-sasa_resnet26" / "run.json").read_text())["attention_path"] == "lean"

    def records(root):
        files = sorted((root / "rotation-sasa_resnet26" / "records").rglob("*.csv"))
        return pd.concat(pd.read_csv(f) for f in files).reset_index(drop=True)

    pd.testing.assert_frame_equal(records(runs), records(lean_runs))
    # the path is how a run ran, not what it computes: a chunk lost from the reference run is
    # computed again on the lean path, and run.json keeps its first start's path
    chunk = sorted((run / "records").rglob("*.csv"))[0]
    chunk.unlink()
    calls.clear()
    run_study(config, runs, tmp_path / "report", **quiet)
    assert chunk.is_file() and not calls
    assert json.loads((run / "run.json").read_text())["attention_path"] == "reference"
    pd.testing.assert_frame_equal(records(runs), records(lean_runs))
