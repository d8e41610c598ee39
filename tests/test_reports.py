"""Reports: Tables 9 and 10 in the paper's layout beside the published numbers, intervals, plots."""
from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn

from robust_attn.cli import main
from robust_attn.data import build_dataset
from robust_attn.protocols.pgd import AttackSetting, run_pgd
from robust_attn.protocols.rotation import run_rotation
from robust_attn.shifts.rotation import rotation_conditions
from robust_attn.models.reference import reference_table
from robust_attn.reports import make_report
from robust_attn.reports.stats import bootstrap_mean_ci
from robust_attn.runs.store import load_records
from robust_attn.reports.formats import to_latex, to_markdown
from robust_attn.reports.runs import load_runs
from robust_attn.reports.tables import format_rotation, rotation_table
from robust_attn.utils.hardware import hardware_label
from robust_attn.models.wrapper import NormalizedModel


def _tiny():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(4, 10))
    return NormalizedModel(net, (0.5,) * 3, (0.25,) * 3).eval()


def _info(model, dataset):
    """A run of random weights drawn with seed 0 (``init_seed``: the report labels it so)."""
    return {"model": model, "dataset": {"name": dataset, "split": "test", "limit": 8}, "checkpoint": None,
            "init_seed": 0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A rotation and a PGD run described as ImageNet resnet26 (tiny model, synthetic images), so
    the report places the published rows beside them."""
    root = tmp_path_factory.mktemp("runs")
    data = build_dataset("synthetic", split="test", limit=8)
    rot = run_rotation(_tiny(), data, root / "rot", conditions=rotation_conditions(45), batch_size=4,
                       run_info=_info("resnet26", "imagenet"), progress=False)
    pgd = run_pgd(_tiny(), data, root / "pgd", num_classes=10, batch_size=4, run_info=_info("resnet26", "imagenet"),
                  settings=[AttackSetting(8, 4, 2), AttackSetting(8, 2, 4), AttackSetting(4, 2, 2)],
                  progress=False, checks=False)
    other = run_rotation(_tiny(), data, root / "rot_syn", conditions=rotation_conditions(0), batch_size=4,
                         run_info=_info("resnet26", "synthetic"), progress=False)
    return [rot.root, pgd.root, other.root]


def test_table9_layout_and_reference_rows(runs):
    table = rotation_table(load_runs(runs))
    assert table["source"].tolist() == ["ours", "paper", "ours"]  # no paper row for non-ImageNet data
    paper = table.iloc[1]
    ref = reference_table("san_table9_rotation").set_index("model").loc["resnet26"]
    assert paper["cw90_top1"] == ref["cw90_top1"]
    assert paper["cw90_top1_drop"] == pytest.approx(24.5)  # 73.6 - 49.1, the paper's bracket
    shown = format_rotation(table)
    assert shown.loc[1, "clockwise 90° top-1"] == "49.1(24.5)"
    assert shown.loc[1, "no rotation top-1"] == "73.6"
    assert shown.loc[0, "Method"] == "resnet26 [random weights]"
    ours = table.iloc[0]
    assert ours["cw180_top1_drop"] == pytest.approx(ours["none_top1"] - ours["cw180_top1"])


def test_report_files(runs, tmp_path, capsys):
    assert main(["report", *map(str, runs), "--out", str(tmp_path), "--bootstrap", "200"]) == 0
    assert "files in" in capsys.readouterr().out
    for name in ("table9_rotation.md", "table9_rotation.tex", "table9_rotation.csv", "table10_pgd.md",
                 "table10_pgd.tex", "table10_pgd.csv", "headline_ci.csv", "report.md", "rotation_conditions.csv",
                 "pgd_conditions.csv"):
        assert (tmp_path / name).stat().st_size > 0, name
    for name in ("rotation_angle.png", "pgd_steps.png", "pgd_eps.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    t10 = pd.read_csv(tmp_path / "table10_pgd.csv")
    ref = reference_table("san_table10_pgd").set_index("model").loc["resnet26"]
    paper = t10[t10["source"] == "paper"].iloc[0]
    assert paper["n4_success_rate"] == ref["n4_success_rate"] and paper["n2_top1"] == ref["n2_top1"]
    md = (tmp_path / "table10_pgd.md").read_text()
    assert "| resnet26 (paper) | 73.6 | 49.0 | 26.6 | 98.2 | 1.0 |" in md
    tex = (tmp_path / "table9_rotation.tex").read_text()
    assert r"\multicolumn{2}{c}{clockwise 90$^\circ$}" in tex and "49.1(24.5)" in tex
    sweep = pd.read_csv(tmp_path / "pgd_conditions.csv")
    assert set(sweep["condition"]) == {"clean", "pgd_eps8_step4_n2", "pgd_eps8_step2_n4", "pgd_eps4_step2_n2"}
    rot = pd.read_csv(tmp_path / "rotation_conditions.csv")
    assert sorted(rot.loc[rot["kind"] == "angle", "angle"].unique()) == [45, 135, 225, 315]


def test_headline_intervals_come_from_the_records(runs, tmp_path):
    make_report(runs, tmp_path, n_boot=300, seed=3, plots=False)
    ci = pd.read_csv(tmp_path / "headline_ci.csv")
    assert ((ci["low"] <= ci["value"] + 1e-9) & (ci["value"] <= ci["high"] + 1e-9)).all()
    t9 = pd.read_csv(tmp_path / "table9_rotation.csv")
    ours = t9[(t9["source"] == "ours") & (t9["dataset"] == "imagenet")].iloc[0]
    row = ci[(ci["metric"] == "cw90_top1_drop") & (ci["dataset"] == "imagenet")].iloc[0]
    assert row["value"] == pytest.approx(ours["cw90_top1_drop"])
    make_report(runs, tmp_path / "again", n_boot=300, seed=3, plots=False)
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "again" / "headline_ci.csv").drop(columns="run"),
                                  ci.drop(columns="run"))  # seeded


def test_headline_intervals_recomputed_from_the_record_files(runs, tmp_path):
    """Every headline interval, recomputed here from the per-image record files (pandas) with the
    seeded percentile bootstrap written out (numpy): ``n_boot`` resamples of the images drawn at
    once by ``default_rng(seed).integers``, the mean of each, the (1 - level) / 2 quantiles."""
    n_boot, seed = 300, 3
    make_report(runs, tmp_path, n_boot=n_boot, seed=seed, plots=False)
    ci = pd.read_csv(tmp_path / "headline_ci.csv")
    for run in runs:
        records = pd.concat(pd.read_csv(f) for f in sorted(run.glob("records/*/*.csv")))
        hits = {c: g.set_index("index").sort_index() for c, g in records.groupby("condition")}
        rows = ci[ci["run"] == str(run)]
        expected = set()
        for cond, frame in hits.items():
            if "success" in frame:              # a PGD run: top-1 everywhere, success where attacked
                expected |= {f"{cond}_top1"} | ({f"{cond}_success_rate"} if cond != "clean" else set())
        if not expected:                        # a rotation run
            assert {"none_top1", "cw90_top1", "cw90_top1_drop"} <= set(rows["metric"])
        else:
            assert set(rows["metric"]) == expected
        for _, row in rows.iterrows():
            cond, column = next((row["metric"][:-len(suffix)], suffix) for suffix in
                                ("_top1_drop", "_success_rate", "_top1") if row["metric"].endswith(suffix))
            if column == "_top1_drop":
                values = (hits["none"]["top1"] - hits[cond]["top1"]).to_numpy(float)
            else:
                values = hits[cond]["success" if column == "_success_rate" else "top1"].to_numpy(float)
            idx = np.random.default_rng(seed).integers(0, len(values), size=(n_boot, len(values)))
            alpha = (1 - row["level"]) / 2
            low, high = np.quantile(values[idx].mean(axis=1), [alpha, 1 - alpha])
            assert row["level"] == 0.95 and row["n"] == len(values) == 8
            expected = [100 * values.mean(), 100 * low, 100 * high]
            assert [row["value"], row["low"], row["high"]] == pytest.approx(expected, abs=1e-9), row["metric"]


@pytest.mark.parametrize("p", [0.3, 0.9])
def test_bootstrap_interval_is_the_exact_bootstrap_of_binary_hits(p):
    """For 0/1 values the bootstrap distribution of the mean is exactly Binomial(n, p_hat) / n (the
    limit of infinitely many resamples): its 2.5% and 97.5% quantiles, to the Monte Carlo error of
    40,000 resamples (about 0.02 points here) plus one step of 1/n. A 90% interval is 0.3 points
    narrower at p = 0.3, a 97% one 0.2 points wider: both fail."""
    from scipy import stats

    n = 2000
    hits = (np.random.default_rng(0).random(n) < p).astype(float)
    ci = bootstrap_mean_ci(hits, n_boot=40000, seed=1)
    p_hat = hits.mean()
    exact_low, exact_high = stats.binom.ppf([0.025, 0.975], n, p_hat) / n * 100
    assert ci.value == pytest.approx(100 * p_hat) and ci.level == 0.95
    assert ci.low == pytest.approx(exact_low, abs=0.08) and ci.high == pytest.approx(exact_high, abs=0.08)


def test_bootstrap_interval_edge_cases():
    assert bootstrap_mean_ci(np.ones(10)).low == 100.0  # no spread, no interval
    with pytest.raises(ValueError, match="empty"):
        bootstrap_mean_ci([])


def test_markdown_and_latex_formatting():
    frame = pd.DataFrame({"Method": ["san10_pairwise", "a|b"], "x": [1.234, float("nan")]})
    md = to_markdown(frame)
    assert md.splitlines()[0] == "| Method | x |" and "| san10_pairwise | 1.2 |" in md and "a\\|b" in md
    assert "| - |" in md
    tex = to_latex(frame, caption="50% of it")
    assert r"san10\_pairwise & 1.2 \\" in tex and r"50\% of it" in tex and tex.count(r"\toprule") == 1


def test_unfinished_runs_are_not_reported(tmp_path):
    data = build_dataset("synthetic", split="test", limit=4)
    store = run_rotation(_tiny(), data, tmp_path / "r", conditions=rotation_conditions(0), batch_size=2,
                         run_info=_info("resnet26", "synthetic"), progress=False)
    next((store.root / "records" / "cw90").iterdir()).unlink()
    with pytest.raises(ValueError, match="unfinished.*running its command again"):
        make_report([store.root], tmp_path / "out")


def test_report_pack_copies_the_runs_and_rederives_from_them(runs, tmp_path, capsys):
    """``--pack``: the runs are copied packed under OUT/runs, the report is built from the copies,
    and reporting again from the copies alone gives the same tables."""
    out = tmp_path / "rep"
    assert main(["report", *map(str, runs), "--out", str(out), "--no-plots", "--bootstrap", "50", "--pack"]) == 0
    assert "runs packed into" in capsys.readouterr().out
    copies = sorted((out / "runs").iterdir())
    assert [c.name for c in copies] == sorted(r.name for r in runs)
    assert all((c / "records.csv.gz").is_file() and (c / "checksums.json").is_file() for c in copies)
    assert f"`{out / 'runs'}" in (out / "report.md").read_text()   # the report names the copies
    again = tmp_path / "again"
    assert main(["report", *map(str, copies), "--out", str(out), "--no-plots", "--bootstrap", "50", "--pack"]) == 0
    assert main(["report", *map(str, copies), "--out", str(again), "--no-plots", "--bootstrap", "50"]) == 0
    for name in ("table9_rotation.csv", "table10_pgd.csv", "headline_ci.csv", "models.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(again / name).drop(columns="run", errors="ignore"),
                                      pd.read_csv(out / name).drop(columns="run", errors="ignore"))
    # where the records were computed survives packing (per chunk; these ran on this CPU)
    assert pd.read_csv(again / "models.csv")["computed_on"].tolist() == [hardware_label("cpu")] * 2
    assert "| Computed on |" in (again / "report.md").read_text()


def test_report_pack_refuses_unfinished_runs_and_name_clashes(runs, tmp_path, capsys):
    data = build_dataset("synthetic", split="test", limit=4)
    store = run_rotation(_tiny(), data, tmp_path / "r", conditions=rotation_conditions(0), batch_size=2,
                         run_info=_info("resnet26", "synthetic"), progress=False)
    next((store.root / "records" / "cw90").iterdir()).unlink()
    assert main(["report", str(store.root), "--out", str(tmp_path / "o1"), "--pack", "--no-plots"]) == 2
    assert "unfinished" in capsys.readouterr().err
    assert not (tmp_path / "o1" / "runs" / "r" / "records.csv.gz").exists()   # nothing half-packed
    clash = [str(runs[0]), str(tmp_path / "x" / runs[0].name)]
    shutil.copytree(runs[1], clash[1])
    assert main(["report", *clash, "--out", str(tmp_path / "o2"), "--pack", "--no-plots"]) == 2
    assert "collide" in capsys.readouterr().err


def test_report_pack_leaves_no_run_packed_when_a_later_one_is_unfinished(runs, tmp_path, capsys):
    data = build_dataset("synthetic", split="test", limit=4)
    store = run_rotation(_tiny(), data, tmp_path / "r", conditions=rotation_conditions(0), batch_size=2,
                         run_info=_info("resnet26", "synthetic"), progress=False)
    next((store.root / "records" / "cw90").iterdir()).unlink()
    out = tmp_path / "o"
    assert main(["report", str(runs[0]), str(store.root), "--out", str(out), "--pack", "--no-plots"]) == 2
    assert f"{store.root} is unfinished" in capsys.readouterr().err
    assert not (out / "runs").exists() and not out.exists()


@pytest.mark.parametrize("flags, message", [(["--level", "5"], "--level takes a confidence level in (0, 1)"),
                                            (["--bootstrap", "0"], "--bootstrap takes the number of resamples")])
def test_report_refuses_bad_options_before_writing_anything(runs, tmp_path, capsys, flags, message):
    out = tmp_path / "o"
    assert main(["report", str(runs[0]), "--out", str(out), "--no-plots", *flags]) == 2
    assert message in capsys.readouterr().err and not out.exists()
    with pytest.raises(ValueError, match="confidence level"):   # the API checks before writing too
        make_report([runs[0]], out, level=1.5, plots=False)
    assert not out.exists()


def test_a_report_into_the_folder_of_an_earlier_one_names_the_files_it_did_not_write(runs, tmp_path):
    make_report(runs, tmp_path, n_boot=20, plots=False)
    assert (tmp_path / "table10_pgd.csv").is_file()
    (tmp_path / "timings.csv").write_text("the caller's own file\n")
    with pytest.warns(UserWarning) as caught:   # rotation only now: the PGD tables are an earlier report's
        make_report([runs[0]], tmp_path, n_boot=20, plots=False, keep=("timings.csv",))
    message = str(caught[0].message)
    assert "pgd_conditions.csv, table10_pgd.csv, table10_pgd.md, table10_pgd.tex" in message
    assert "timings.csv" not in message and "table9_rotation" not in message


def test_pgd_runs_of_one_model_merge_into_one_table10_row(runs, tmp_path):
    from robust_attn.reports.tables import pgd_table

    data = build_dataset("synthetic", split="test", limit=8)
    sweep = run_pgd(_tiny(), data, tmp_path / "sweep", num_classes=10, batch_size=4,
                    run_info=_info("resnet26", "imagenet"), settings=[AttackSetting(8, 2, 4), AttackSetting(16, 4, 4)],
                    progress=False, checks=False)
    table = pgd_table(load_runs([runs[1], sweep.root]))
    ours = table[table["source"] == "ours"]
    assert len(ours) == 1                                   # same weights, same images: one row
    alone = pgd_table(load_runs([runs[1]]))
    pd.testing.assert_frame_equal(ours.drop(columns="run").reset_index(drop=True),
                                  alone[alone["source"] == "ours"].drop(columns="run").reset_index(drop=True))
    other_images = run_pgd(_tiny(), build_dataset("synthetic", split="test", limit=4), tmp_path / "other",
                           num_classes=10, batch_size=4, settings=[AttackSetting(8, 4, 2)], progress=False,
                           checks=False, run_info={**_info("resnet26", "imagenet"),
                                                   "dataset": {"name": "imagenet", "split": "test", "limit": 4}})
    assert (pgd_table(load_runs([runs[1], other_images.root]))["source"] == "ours").sum() == 2


def test_autoattack_by_that_disagrees_with_the_record_is_reported(tmp_path):
    """An AutoAttack record whose ``by`` names a member while the record classifies the image
    correctly (or ``none`` while it misclassifies it) is listed, and the report says so; the
    robust accuracy stays the records' top-1. Consistent records add no such section."""
    from robust_attn.reports.attacks import attack_sections, autoattack_disagreements
    from robust_attn.reports.runs import Run

    condition = {"name": "autoattack_linf_eps1", "attack": "autoattack", "norm": "linf", "eps": 1 / 255}
    description = {"protocol": "attack", "model": "m", "dataset": {"name": "synthetic"},
                   "conditions": [{"name": "clean", "attack": "none", "eps": 0.0}, condition]}
    records = pd.DataFrame({"condition": "autoattack_linf_eps1", "index": range(6), "label": 0,
                            "clean_pred": [0, 0, 0, 0, 0, 1], "top1": [0, 1, 1, 0, 1, 0],
                            "by": ["apgd-ce", "apgd-t", "none", "none", "none", "clean"]})
    bad = autoattack_disagreements([Run(tmp_path, description, records)])
    assert bad.to_dict("records") == [{"model": "m", "attack": "AutoAttack 1/255", "named_but_correct": 1,
                                       "none_but_wrong": 1, "indices": "1 3"}]
    md, _ = attack_sections([Run(tmp_path, description, records)], tmp_path, n_boot=10, plots=False)
    assert any("2 images' `by` disagrees with their record" in line for line in md)
    fixed = records.assign(top1=[0, 0, 1, 1, 1, 0])
    assert autoattack_disagreements([Run(tmp_path, description, fixed)]).empty
    md, _ = attack_sections([Run(tmp_path, description, fixed)], tmp_path, n_boot=10, plots=False)
    assert not any("disagrees" in line for line in md)


def test_partial_report_shows_the_finished_radii_of_unfinished_attack_runs(runs, tmp_path, capsys):
    """``--partial``: an unfinished attack run contributes each radius whose every chunk is
    written, on all of its images, with the numbers a finished run of those radii gives; the
    report names the radii left out. Without it the run is an error; an unfinished run whose
    protocol combines its conditions (rotation) is left out whole, and named; ``--pack`` refuses
    ``--partial``."""
    from robust_attn.attacks.base import AttackConfig
    from robust_attn.protocols.attack import run_attack
    from robust_attn.runs.store import RunStore

    data = build_dataset("synthetic", split="test", limit=8)
    configs = [AttackConfig("pgd", eps=e / 255, steps=2, step=e / 510) for e in (2, 8)]
    done, cut = [run_attack(_tiny(), data, tmp_path / name, configs=configs, num_classes=10, batch_size=4,
                            run_info={**_info(model, "synthetic"), "model": model}, progress=False, checks=False)
                 for name, model in (("done", "resnet26"), ("cut", "aa_resnet26"))]
    whole = load_records(cut.root)
    chunk = cut.chunk_path(configs[0].name, 4, 8)       # the 2/255 radius lacks its second chunk
    chunk.unlink()
    RunStore.checksum_path(chunk).unlink()
    out, whole_out = tmp_path / "partial", tmp_path / "whole"
    assert main(["report", str(done.root), str(cut.root), "--out", str(out), "--no-plots"]) == 2
    assert "unfinished" in capsys.readouterr().err
    assert main(["report", str(done.root), str(cut.root), "--out", str(out), "--no-plots", "--bootstrap", "50",
                 "--partial"]) == 0
    md = (out / "report.md").read_text()
    assert "**Partial report" in md and f"- `{cut.root}`: {configs[0].name}" in md
    table = pd.read_csv(out / "robust_accuracy.csv")
    cut_rows = table[table["model"] == "aa_resnet26"].set_index("column")
    assert list(cut_rows.index) == ["clean", "pgd 8/255"] and (cut_rows["n"] == 8).all()
    top1 = whole[whole["condition"] == configs[1].name]["top1"].mean() * 100
    assert cut_rows.loc["pgd 8/255", "top1"] == pytest.approx(top1)
    assert "| model | dataset | clean | pgd 2/255 | pgd 8/255 | images |" in md   # by radius, whoever has it
    # the finished run's rows are those of its report alone
    assert main(["report", str(done.root), "--out", str(whole_out), "--no-plots", "--bootstrap", "50"]) == 0
    full = pd.read_csv(whole_out / "robust_accuracy.csv")
    pd.testing.assert_frame_equal(table[table["model"] == "resnet26"].reset_index(drop=True),
                                  full[full["model"] == "resnet26"].reset_index(drop=True))
    comparison = pd.read_csv(out / "comparison.csv")
    assert set(comparison.loc[comparison["measure"] == f"attack_drop:{configs[0].name}", "model"]) == {"resnet26"}
    assert set(comparison.loc[comparison["measure"] == f"attack_drop:{configs[1].name}", "model"]) == {
        "resnet26", "aa_resnet26"}
    # an unfinished rotation run (its protocol averages its conditions) is left out whole, and named;
    # alone it leaves nothing to report; --pack does not go with --partial
    rot = run_rotation(_tiny(), data, tmp_path / "rot", conditions=rotation_conditions(0), batch_size=4,
                       run_info=_info("resnet26", "synthetic"), progress=False)
    rot.chunk_path("cw90", 4, 8).unlink()
    with_rot = tmp_path / "with_rot"
    assert main(["report", str(done.root), str(cut.root), str(rot.root), "--out", str(with_rot), "--no-plots",
                 "--bootstrap", "50", "--partial"]) == 0
    md = (with_rot / "report.md").read_text()
    assert f"- `{rot.root}`: the whole run (its protocol combines its conditions)" in md
    assert not (with_rot / "table9_rotation.csv").exists()
    pd.testing.assert_frame_equal(pd.read_csv(with_rot / "robust_accuracy.csv"), table)
    assert main(["report", str(rot.root), "--out", str(tmp_path / "o"), "--no-plots", "--partial"]) == 2
    assert "nothing finished to report" in capsys.readouterr().err
    assert main(["report", str(cut.root), "--out", str(tmp_path / "o"), "--partial", "--pack"]) == 2
    assert "does not go with --partial" in capsys.readouterr().err


def test_model_row_takes_each_key_from_whichever_run_records_it(tmp_path):
    """Runs of one model's weights recorded before spec and params existed lack them: the model
    table fills them from the model's other runs, whatever the order the runs are given in."""
    from robust_attn.reports.models import model_table
    from robust_attn.reports.runs import Run

    base = {"model": "resnet26", "dataset": {"name": "fashion_mnist"}, "zoo_entry": "resnet26",
            "checkpoint": {"sha256": "ab" * 32}}
    old = Run(tmp_path / "old", {**base, "protocol": "rotation"}, pd.DataFrame())
    new = Run(tmp_path / "new", {**base, "protocol": "attack", "spec": "zoo:resnet26", "params": 740000,
                                 "source": "zoo"}, pd.DataFrame())
    rows = [model_table(runs).drop(columns="computed_on").to_dict("records") for runs in ([old, new], [new, old])]
    assert rows[0] == rows[1]
    assert len(rows[0]) == 1 and rows[0][0]["spec"] == "zoo:resnet26" and rows[0][0]["params"] == 740000
    assert rows[0][0]["protocols"] == "attack, rotation" and rows[0][0]["weights_sha256"] == "ab" * 32



def _attack_runs(tmp_path, specs, radii=(2, 8), **extra):
    """Attack runs (PGD at ``radii``/255, 8 synthetic images) of ``specs``: (folder, model name,
    weight seed, checkpoint sha256 or None); ``extra``: more of run.json."""
    from robust_attn.attacks.base import AttackConfig
    from robust_attn.protocols.attack import run_attack

    data = build_dataset("synthetic", split="test", limit=8)
    configs = [AttackConfig("pgd", eps=e / 255, steps=2, step=e / 510) for e in radii]
    made = []
    for name, model, seed, sha in specs:
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                            nn.Linear(4, 10))
        info = {**_info(model, "synthetic"), "model": model,
                "checkpoint": {"path": f"{name}.safetensors", "sha256": sha} if sha else None, **extra}
        made.append(run_attack(NormalizedModel(net, (0.5,) * 3, (0.25,) * 3).eval(), data, tmp_path / name,
                               configs=configs, num_classes=10, batch_size=4, run_info=info, progress=False,
                               checks=False).root)
    return made


def test_two_runs_holding_one_result_are_refused_and_a_folder_given_twice_is_one(tmp_path, capsys):
    """A run beside its packed copy (or any two runs holding one condition of one model, with the
    same weights, on the same images) is an error naming both and the fix, before anything is
    written: the report would count the images twice or keep the first. Each run's own clean
    condition is exempt, and one folder given twice (overlapping globs) is one run."""
    from robust_attn.runs.store import RunStore

    run, other = _attack_runs(tmp_path, [("run", "resnet26", 0, None), ("sasa", "sasa_resnet26", 1, None)])
    copy = RunStore(run).pack(tmp_path / "packed" / "run").root
    out = tmp_path / "rep"
    assert main(["report", str(run), str(other), str(copy), "--out", str(out), "--no-plots"]) == 2
    err = capsys.readouterr().err
    first = load_records(run)["condition"].unique()[1]          # after clean: the 2/255 radius
    assert f"{run} and {copy} both hold attack condition '{first}' of resnet26" in err
    assert "give one of the two runs" in err and f"robust-attn diff {run} {copy}" in err
    assert not out.exists()
    assert main(["report", str(run), str(other), str(run), "--out", str(out), "--no-plots",
                 "--bootstrap", "50"]) == 0
    table = pd.read_csv(out / "robust_accuracy.csv")
    assert (table["model"] == "resnet26").sum() == 3      # clean and two radii, once each
    assert (out / "report.md").read_text().count(f"`{run}`") == 1
    # the same model's run at another radius shares only its clean condition with the first: accepted
    wider = _attack_runs(tmp_path / "wider", [("run", "resnet26", 0, None)], radii=(4,))[0]
    make_report([run, other, wider], tmp_path / "ok", n_boot=20, plots=False)
    assert (pd.read_csv(tmp_path / "ok" / "robust_accuracy.csv")["model"] == "resnet26").sum() == 4


def test_two_checkpoints_of_one_model_stay_apart_in_the_findings_and_attack_tables(tmp_path):
    """Runs of one model name on one dataset with different weights are two rows of the attack
    tables and two columns of the paired findings, each with its own records' numbers (named
    ``resnet26 (ckpt aaaaaaaa)``), never one row that keeps whichever came first."""
    from robust_attn.reports.attacks import robust_accuracy_table
    from robust_attn.reports.comparison import compare_models

    dirs = _attack_runs(tmp_path, [("a", "resnet26", 0, "a" * 64), ("b", "resnet26", 1, "b" * 64),
                                   ("s", "sasa_resnet26", 2, "c" * 64)])
    table = robust_accuracy_table(load_runs(dirs), n_boot=20)
    findings = compare_models(load_runs(dirs), n_boot=20)
    names = {"resnet26 (ckpt aaaaaaaa)": dirs[0], "resnet26 (ckpt bbbbbbbb)": dirs[1], "sasa_resnet26": dirs[2]}
    assert set(table["model"]) == set(findings["model"]) == set(names)
    for name, path in names.items():
        records = load_records(path)
        top1 = records.groupby("condition")["top1"].mean() * 100
        assert sorted(table.loc[table["model"] == name, "top1"]) == pytest.approx(sorted(top1))
        clean = records[records["condition"] == "clean"].set_index("index")["top1"]
        for condition in set(records["condition"]) - {"clean"}:
            attacked = records[records["condition"] == condition].set_index("index")["top1"]
            row = findings[(findings["model"] == name) & (findings["measure"] == f"attack_drop:{condition}")]
            assert row["value"].item() == pytest.approx((clean - attacked).mean() * 100)
    assert (findings.loc[findings["model"] == "sasa_resnet26", "family"] == "sasa").all()
    assert (findings.loc[findings["model"].str.startswith("resnet26"), "family"] == "resnet").all()


def test_pgd_runs_of_one_model_name_with_other_weights_from_elsewhere_are_two_table10_rows(tmp_path):
    """Two models from elsewhere under one name (no checkpoint: told apart by the sha256 of their
    state) are two Table 10 rows, each with its own run's numbers, not one row of the first."""
    from robust_attn.reports.tables import pgd_table

    data = build_dataset("synthetic", split="test", limit=8)
    dirs = []
    for seed, sha in ((0, "a" * 64), (3, "b" * 64)):
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                            nn.Linear(4, 10))
        info = {**_info("resnet26", "imagenet"), "init_seed": None, "weights_sha256": sha}
        dirs.append(run_pgd(NormalizedModel(net, (0.5,) * 3, (0.25,) * 3).eval(), data, tmp_path / str(seed),
                            num_classes=10, batch_size=4, run_info=info, settings=[AttackSetting(8, 4, 2)],
                            progress=False, checks=False).root)
    table = pgd_table(load_runs(dirs)).set_index("label")
    ours = table[table["source"] == "ours"]
    assert sorted(ours.index) == ["resnet26 (weights aaaaaaaa)", "resnet26 (weights bbbbbbbb)"]
    for label, path in zip(("resnet26 (weights aaaaaaaa)", "resnet26 (weights bbbbbbbb)"), dirs):
        records = load_records(path)
        clean = records.loc[records["condition"] == "clean", "top1"]
        assert ours.loc[label, "clean_top1"] == pytest.approx(clean.mean() * 100)


def test_runs_of_one_dataset_that_read_different_data_are_refused(tmp_path, capsys):
    """CIFAR-10's canonical pixels and its JPEG copy are one dataset name but other images: a
    report of runs on both would pair models image by image across them, so it is an error
    naming each variant's runs and the fix; runs on one variant are reported."""
    jpeg = _attack_runs(tmp_path / "jpeg", [("a", "resnet26", 0, None)], data_variant="cifar10-jpeg")[0]
    canonical = _attack_runs(tmp_path / "canonical", [("s", "sasa_resnet26", 1, None)], data_variant="cifar10")[0]
    same = _attack_runs(tmp_path / "same", [("s", "sasa_resnet26", 1, None)], data_variant="cifar10-jpeg")[0]
    out = tmp_path / "rep"
    assert main(["report", str(jpeg), str(canonical), "--out", str(out), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert f"(test) read different data (cifar10-jpeg: {jpeg}; cifar10: {canonical})" in err
    assert "report each variant separately" in err
    assert not out.exists()
    assert main(["report", str(jpeg), str(same), "--out", str(out), "--no-plots", "--bootstrap", "20"]) == 0
    # another split may be another variant (ImageNet's train folder and its original validation set)
    train = _attack_runs(tmp_path / "train", [("t", "sasa_resnet26", 1, None)], data_variant="cifar10",
                         dataset={"name": "synthetic", "split": "train", "limit": 8})[0]
    assert main(["report", str(jpeg), str(train), "--out", str(out), "--no-plots", "--bootstrap", "20"]) == 0


def test_a_report_that_fails_part_way_leaves_the_earlier_report_as_it_was(runs, tmp_path, monkeypatch):
    """The report's files are moved into its folder only once all are written: an error (or an
    interrupt) after some tables were written leaves the earlier report's files byte for byte,
    no new file beside them, and no hidden staging folder."""
    import robust_attn.reports as reports

    out = tmp_path / "rep"
    make_report(runs, out, n_boot=20, plots=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "table10_pgd.csv" in before and not any(n.startswith(".report-") for n in before)

    def broken(*args, **kwargs):
        raise KeyboardInterrupt   # after Tables 9 and 10 and the findings were written

    monkeypatch.setattr(reports, "headline_ci", broken)
    with pytest.raises(KeyboardInterrupt):
        make_report(runs[1:2], out, n_boot=30, plots=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_the_robust_accuracy_table_orders_radii_by_value_and_names_columns_on_fewer_images():
    """The wide RobustBench table: radii in numeric order (16/255 after 2/255, not before it as text
    sorts), and a model whose attacks ran on different numbers of images says so (AutoAttack at 2/255
    on a seeded 500 of the 1,000 attack images) instead of giving the largest count alone."""
    from robust_attn.reports.attacks import format_robust_accuracy

    def row(model, column, n, top1):
        return {"model": model, "dataset": "cifar10", "column": column, "n": n, "top1": top1, "low": top1 - 2,
                "high": top1 + 2}

    long = pd.DataFrame([row("a", "clean", 1000, 80.0), row("a", "AutoAttack 16/255", 1000, 0.0),
                         row("a", "AutoAttack 2/255", 500, 5.0), row("a", "APGD-CE 8/255", 1000, 1.0),
                         row("b", "clean", 1000, 70.0), row("b", "AutoAttack 2/255", 1000, 4.0)])
    wide = format_robust_accuracy(long).set_index("model")
    assert list(wide.columns) == ["dataset", "clean", "APGD-CE 8/255", "AutoAttack 2/255", "AutoAttack 16/255",
                                  "images"]
    assert wide.loc["a", "images"] == "1000 (AutoAttack 2/255: 500)"
    assert wide.loc["b", "images"] == 1000
    assert wide.loc["a", "AutoAttack 2/255"] == "5.0 [3.0, 7.0]"
