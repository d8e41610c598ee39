"""The study's plan and estimated cost (robust_attn/study/estimate.py), its presets
(robust_attn/study/presets.py) and the study command's --preset and --plan."""
import json
import math
from pathlib import Path

import pytest
import torch

import robust_attn
from robust_attn.cli import main
from robust_attn.models.wrapper import NormalizedModel
from robust_attn.runs.study_file import load_study_file
from robust_attn.study.config import StudyConfig
from robust_attn.study.estimate import (Passes, StudyClock, format_plan, format_seconds, plan_rows, probe_model,
                                        protocol_passes, study_total)
from robust_attn.study.presets import FULL, PRESETS, preset_values
from test_study import tiny_zoo  # noqa: F401  (the fixture: a zoo of two tiny synthetic-data models)

ROOT = Path(__file__).resolve().parents[1]


def test_pass_counts_follow_the_protocols_settings():
    # rotation: Table 9's five conditions, the left-right flip, and 30..330 without 90, 180, 270
    assert protocol_passes("rotation", StudyConfig(angle_step=30.0)) == Passes(forward=5 + 1 + 8)
    assert protocol_passes("rotation", StudyConfig(angle_step=90.0)).forward == 6
    # pgd: Table 10 (eps 8: 2 steps of 4, 4 steps of 2) and the sweep 2/255 and 8/255 at 4 steps, where
    # 8/255 at 4 steps is Table 10's second setting again: 3 settings, 2 + 4 + 4 iterations
    pgd = protocol_passes("pgd", StudyConfig(sweep_eps=(2 / 255, 8 / 255), sweep_steps=4))
    assert (pgd.forward, pgd.backward, pgd.bound) == (1 + 3, 10, False)
    # APGD-CE: 100 iterations per radius unless attack_steps says otherwise, on the attack subset
    apgd = protocol_passes("apgd", StudyConfig(apgd_eps=(1 / 255, 2 / 255), attack_steps=7))
    assert (apgd.backward, apgd.images, apgd.bound) == (14, "attack", True)
    # AutoAttack per radius: APGD-CE, APGD-T and FAB-T on 9 targets each, Square's queries
    aa = protocol_passes("autoattack", StudyConfig(autoattack_eps=(4 / 255, 8 / 255), square_queries=50))
    assert (aa.backward, aa.forward) == (2 * 100 * 19, 1 + 2 * 51)
    # ... of which APGD-CE runs on every image whatever the others do
    assert (aa.least.backward, aa.least.forward) == (2 * 100, 1 + 2)
    # corruption: clean and 2 corruptions x 3 severities
    assert protocol_passes("corruption", StudyConfig(corruptions="gaussian_noise,contrast",
                                                     severities=(1, 3, 5))).forward == 1 + 6
    assert protocol_passes("no-such-protocol", StudyConfig()) is None


def test_every_built_in_study_protocol_declares_its_cost_in_its_own_file():
    """Each study step registers its passes beside itself (study_protocol's ``passes``), so the plan
    times every built-in protocol and a new one adds its cost in its own file."""
    from robust_attn.protocols.study_step import STUDY_PROTOCOLS

    built_in = ["rotation", "pgd", "corruption", "occlusion", "shuffle", "apgd", "autoattack", "square", "transfer",
                "masking"]
    for name in built_in:
        step = STUDY_PROTOCOLS[name]
        assert step.passes is not None, name
        assert step.passes.__module__ == step.step.__module__, name
        assert isinstance(protocol_passes(name, StudyConfig()), Passes), name


def test_plan_lists_every_protocol_and_model_with_its_arithmetic():
    config = StudyConfig(protocols=("rotation", "pgd", "transfer"), angle_step=0.0, sweep_eps=(), attack_limit=10)
    probes = {"a": (0.01, 0.03), "b": (0.02, 0.05)}
    rows = plan_rows(config, ["a", "b"], probes, num_images=100, num_attack_images=10, workers=2)
    assert [(r.protocol, r.model) for r in rows] == [("rotation", "a"), ("pgd", "a"), ("rotation", "b"),
                                                     ("pgd", "b"), ("transfer", "a"), ("transfer", "b")]
    by = {(r.protocol, r.model): r for r in rows}
    # rotation: 6 forward passes on 100 images, shared by 2 processes
    assert by[("rotation", "a")].seconds == pytest.approx(100 * 6 * 0.01 / 2)
    # pgd, Table 10 alone: clean + 2 evaluations forward, 2 + 4 iterations forward-backward
    assert by[("pgd", "b")].seconds == pytest.approx(100 * (3 * 0.02 + 6 * 0.05) / 2)
    # transfer from a: 14 iterations on a, then 3 forward passes per image through every model
    assert by[("transfer", "a")].images == 10
    assert by[("transfer", "a")].seconds == pytest.approx(10 * (3 * 0.01 + 14 * 0.03 + 3 * (0.01 + 0.02)) / 2)
    total, bound = study_total(rows)
    assert total == pytest.approx(sum(r.seconds for r in rows)) and not bound
    text = "\n".join(format_plan(rows, device="cpu", workers=2))
    for name in ("rotation (100 img)", "pgd (100 img)", "transfer (10 img)", "  a ", "  b "):
        assert name in text
    assert f"about {format_seconds(total)}" in text


def test_attack_bounds_and_unknown_protocols_are_said():
    config = StudyConfig(protocols=("apgd",), apgd_eps=(8 / 255,))
    rows = plan_rows(config, ["a"], {"a": (0.001, 0.002)}, 50, 20)
    assert rows[0].bound and rows[0].seconds == pytest.approx(20 * (2 * 0.001 + 100 * 0.002))
    assert "at most" in "\n".join(format_plan(rows, device="cpu", workers=1))
    aa = plan_rows(StudyConfig(protocols=("autoattack",), autoattack_eps=(8 / 255,), square_queries=10), ["a"],
                   {"a": (0.001, 0.002)}, 50, 20)[0]
    assert aa.seconds == pytest.approx(20 * (12 * 0.001 + 1900 * 0.002))
    assert aa.least == pytest.approx(20 * (2 * 0.001 + 100 * 0.002))
    said = "\n".join(format_plan([aa], device="cpu", workers=1))
    assert f"between {format_seconds(aa.least)} and {format_seconds(aa.seconds)}" in said
    unprobed = plan_rows(config, ["a"], {}, 50, 20)
    assert unprobed[0].seconds is None and "?" in "\n".join(format_plan(unprobed, device="cpu", workers=1))


def test_format_seconds_picks_a_readable_unit():
    assert [format_seconds(s) for s in (None, 12.4, 600, 3 * 3600, 5 * 86400)] == ["?", "12 s", "10 min", "3.0 h",
                                                                                    "5.0 days"]
    # the unit changes at 90 s, 90 min and 2 days
    assert [format_seconds(s) for s in (89, 90, 5399, 5400, 2 * 86400 - 360, 2 * 86400)] == \
        ["89 s", "2 min", "90 min", "1.5 h", "47.9 h", "2.0 days"]


def test_clock_scales_what_is_left_by_how_the_finished_steps_went():
    config = StudyConfig(protocols=("rotation", "transfer"), angle_step=0.0)
    rows = plan_rows(config, ["a", "b"], {"a": (0.01, 0.01), "b": (0.01, 0.01)}, 100, 10)
    clock = StudyClock(rows)
    planned = {(r.protocol, r.model): r.seconds for r in rows}
    clock.finished("rotation", "a", 2 * planned[("rotation", "a")])   # twice as slow as the probe said
    left = planned[("rotation", "b")] + planned[("transfer", "a")] + planned[("transfer", "b")]
    assert clock.remaining() == pytest.approx(2 * left)   # transfer, not computed yet, at rotation's pace
    clock.finished("transfer", None, 0.0)   # a step across models: every model's row at once, in no time
    # each protocol is scaled by its own steps: rotation's pace stays twice the probe's
    assert clock.remaining() == pytest.approx(2 * planned[("rotation", "b")])
    # the lines: the first step (helper processes starting) leaves the plan unscaled
    fresh = StudyClock(rows)
    assert "about " + format_seconds(left) + " left" in fresh.line("rotation", "a", 100 * planned[("rotation", "a")])
    assert fresh.remaining() == pytest.approx(left)


def test_clock_gives_a_range_while_the_plan_holds_bounds_and_narrows_it_as_the_attacks_run():
    """AutoAttack's plan row is an upper bound with a lower end (every image fooled at once): the
    time left is the range between the two, until AutoAttack's own steps set its pace."""
    config = StudyConfig(protocols=("rotation", "autoattack"), angle_step=0.0, autoattack_eps=(8 / 255,),
                         square_queries=10)
    rows = plan_rows(config, ["a", "b"], {m: (0.01, 0.01) for m in "ab"}, 100, 10)
    upper = {(r.protocol, r.model): r.seconds for r in rows}
    lower = {(r.protocol, r.model): r.least if r.bound else r.seconds for r in rows}
    assert lower[("autoattack", "a")] < 0.5 * upper[("autoattack", "a")]
    clock = StudyClock(rows)
    clock.finished("rotation", "a", upper[("rotation", "a")])   # at the probe's pace
    rest = [("rotation", "b"), ("autoattack", "a"), ("autoattack", "b")]
    assert clock.remaining() == pytest.approx(sum(upper[k] for k in rest))
    assert clock.remaining(least=True) == pytest.approx(sum(lower[k] for k in rest))
    line = clock.line("rotation", "b", upper[("rotation", "b")])
    aa = [("autoattack", "a"), ("autoattack", "b")]
    assert f"between {format_seconds(sum(lower[k] for k in aa))} and {format_seconds(sum(upper[k] for k in aa))} left" \
        in line
    # AutoAttack of a took 3x its lower end: b's, estimated alike, takes as long by either end
    line = clock.line("autoattack", "a", 3 * lower[("autoattack", "a")])
    b_takes = 3 * lower[("autoattack", "b")]
    assert clock.remaining() == pytest.approx(clock.remaining(least=True)) == pytest.approx(b_takes)
    assert f"about {format_seconds(b_takes)} left" in line


def test_clock_of_a_resumed_study_counts_only_what_each_step_computed():
    """A run found complete (no chunk written now) says nothing of the pace; one found half done
    took its seconds for half its estimate; a bound (AutoAttack) is scaled by its own steps, and
    until it has any, by the pace of the exact estimates."""
    config = StudyConfig(protocols=("rotation", "autoattack"), angle_step=0.0, autoattack_eps=(8 / 255,),
                         square_queries=10)
    rows = plan_rows(config, ["a", "b", "c"], {m: (0.01, 0.01) for m in "abc"}, 100, 10)
    planned = {(r.protocol, r.model): r.seconds for r in rows}
    clock = StudyClock(rows)
    clock.finished("rotation", "a", 0.0, computed=0.0)            # resumed: already complete
    clock.finished("autoattack", "a", 0.0, computed=0.0)
    untouched = sum(planned[(p, m)] for p in ("rotation", "autoattack") for m in "bc")
    assert clock.remaining() == pytest.approx(untouched)
    clock.finished("rotation", "b", 1.5 * planned[("rotation", "b")], computed=0.5)   # half of it, 3x slower
    aa_left = planned[("autoattack", "b")] + planned[("autoattack", "c")]
    assert clock.remaining() == pytest.approx(3 * (planned[("rotation", "c")] + aa_left))
    clock.finished("autoattack", "b", 0.01 * planned[("autoattack", "b")])   # the bound was 100x loose
    assert clock.remaining() == pytest.approx(3 * planned[("rotation", "c")] + 0.01 * planned[("autoattack", "c")])


def test_plan_of_a_resumed_study_counts_what_its_runs_do_not_hold():
    config = StudyConfig(protocols=("rotation", "apgd"), angle_step=0.0, apgd_eps=(1 / 255,))
    probes = {"a": (0.01, 0.02), "b": (0.01, 0.02)}
    fresh = plan_rows(config, ["a", "b"], probes, 100, 10)
    resumed = plan_rows(config, ["a", "b"], probes, 100, 10, done={("rotation", "a"): 1.0, ("apgd", "a"): 0.25})
    by = {(r.protocol, r.model): r for r in fresh}
    for row in resumed:
        share = {("rotation", "a"): 0.0, ("apgd", "a"): 0.75}.get((row.protocol, row.model), 1.0)
        assert row.seconds == pytest.approx(share * by[(row.protocol, row.model)].seconds)
        assert row.least == pytest.approx(share * by[(row.protocol, row.model)].least)
    said = "\n".join(format_plan(resumed, device="cpu", workers=1))
    assert "resumed" in said and said.splitlines()[-4].split()[:2] == ["a", "done"]
    assert "resumed" not in "\n".join(format_plan(fresh, device="cpu", workers=1))


def test_probe_measures_both_passes_per_image():
    torch.manual_seed(0)
    model = NormalizedModel(robust_attn.create_model("resnet26", 10, "cifar", width=0.25, stem_downsample=4),
                            (0.5,) * 3, (0.25,) * 3)
    forward, backward = probe_model(model, torch.rand(4, 3, 32, 32), torch.device("cpu"), repeats=1)
    assert 0 < forward < math.inf and 0 < backward < math.inf
    assert all(p.grad is None for p in model.parameters())   # the probe leaves no gradients behind


def test_presets_are_valid_study_configs():
    for dataset in ("cifar10", "fashion_mnist"):
        for name in [*PRESETS, "full"]:
            StudyConfig(dataset=dataset, **preset_values(name, dataset))
    with pytest.raises(ValueError, match="the presets are"):
        preset_values("huge", "cifar10")
    with pytest.raises(ValueError, match="no.*|there is none"):
        preset_values("full", "imagenet")


@pytest.mark.parametrize("dataset", sorted(FULL))
def test_full_preset_is_the_committed_reports_study(dataset):
    study = ROOT / "reports" / f"study-{dataset}" / "study.json"
    if not study.is_file():
        pytest.skip(f"{study} is not in this checkout")
    committed = load_study_file(study)["config"]   # an older study.json migrated to today's units
    config = StudyConfig(dataset=dataset, **preset_values("full", dataset)).describe()
    for key, value in committed.items():
        if key in config:
            assert config[key] == (tuple(value) if isinstance(value, list) and key != "models" else value) or \
                   (key == "models" and list(config[key]) == value), key


def test_study_plan_prints_every_protocol_and_model_and_runs_nothing(tmp_path, tiny_zoo, capsys):
    runs = tmp_path / "runs"
    assert main(["study", "--dataset", "synthetic", "--manifest", str(tiny_zoo), "--preset", "quick", "--limit", "8",
                 "--attack-limit", "4", "--plan", "--device", "cpu", "--runs", str(runs), "--out",
                 str(tmp_path / "out"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    for protocol in PRESETS["quick"]["protocols"]:
        assert f"{protocol} (" in out
    assert "resnet26 " in out and "sasa_resnet26 " in out and "estimated time of the study" in out
    assert not (tmp_path / "out").exists() and not list(runs.glob("*/run.json"))


def test_study_runs_the_preset_with_options_over_it_and_says_the_time_left(tmp_path, tiny_zoo, capsys):
    runs = tmp_path / "runs"
    assert main(["study", "--dataset", "synthetic", "--manifest", str(tiny_zoo), "--limit", "6", "--attack-limit", "2",
                 "--protocols", "rotation,apgd", "--attack-steps", "2", "--apgd-eps", "8/255", "--batch-size", "3",
                 "--bootstrap", "20", "--device", "cpu", "--workers", "1", "--runs", str(runs), "--out",
                 str(tmp_path / "out"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    config = json.loads((tmp_path / "out" / "study.json").read_text())["config"]
    # the CPU's default preset, under the options given
    assert config["angle_step"] == PRESETS["quick"]["angle_step"] and config["limit"] == 6
    assert config["protocols"] == ["rotation", "apgd"]
    assert "rotation (6 img)" in out and "apgd (2 img)" in out
    assert out.count("left (ETA") == 4   # after each of the 2 protocols of the 2 models
    # run again: every run is complete, so the plan says done and the study computes nothing
    assert main(["study", "--dataset", "synthetic", "--manifest", str(tiny_zoo), "--limit", "6", "--attack-limit", "2",
                 "--protocols", "rotation,apgd", "--attack-steps", "2", "--apgd-eps", "8/255", "--batch-size", "3",
                 "--bootstrap", "20", "--device", "cpu", "--workers", "1", "--runs", str(runs), "--out",
                 str(tmp_path / "out"), "--no-progress", "--plan"]) == 0
    plan = capsys.readouterr().out
    rows = [line.split() for line in plan.splitlines() if line.split()[:1] in (["resnet26"], ["sasa_resnet26"])]
    assert "resumed" in plan and len(rows) == 2 and all(row[1:] == ["done", "done"] for row in rows)


def test_a_timed_step_says_which_part_of_its_run_it_computed(tmp_path):
    """The study's clock learns the pace only from chunks written now, as a part of what the run
    lacked (what a resumed plan's seconds count): a step that finds 3 of its 4 chunks written and
    writes the last computed all of its planned work; one that finds all, none. At the pace the
    plan assumed, the resumed step leaves the clock's pace unchanged."""
    import numpy as np
    import pandas as pd

    from robust_attn.runs.store import RunStore
    from robust_attn.study.run import _timed

    out = tmp_path / "rotation-a"
    store = RunStore(out)
    store.open({"model": "a", "protocol": "rotation", "dataset": {"name": "synthetic", "split": "test", "limit": None},
                "parameters": {}, "conditions": [{"name": "none"}, {"name": "cw90"}], "num_images": 4,
                "chunk_size": 2})

    def write(condition, start):
        frame = pd.DataFrame({"index": np.arange(start, start + 2), "label": 0, "pred": 0, "top1": 1})
        store.write_chunk(condition, start, start + 2, frame)

    write("none", 0), write("none", 2), write("cw90", 0)
    _, computed = _timed(tmp_path, "a", "rotation", out, "cpu", 0, lambda: write("cw90", 2))
    assert computed == pytest.approx(1.0)
    _, found_complete = _timed(tmp_path, "a", "rotation", out, "cpu", 0, lambda: None)
    assert found_complete == 0.0
    timings = pd.read_csv(tmp_path / "timings.csv")
    assert timings["chunks_written"].tolist() == [1, 0] and timings["chunks_total"].tolist() == [4, 4]

    config = StudyConfig(protocols=("rotation",), angle_step=0.0)
    rows = plan_rows(config, ["a", "b"], {m: (0.01, 0.01) for m in "ab"}, 100, 10, done={("rotation", "a"): 0.75})
    planned = {r.model: r.seconds for r in rows}
    clock = StudyClock(rows)
    clock.finished("rotation", "a", planned["a"], computed=computed)   # the last quarter, at the planned pace
    assert clock.remaining() == pytest.approx(planned["b"])
