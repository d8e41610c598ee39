"""benchmarks/calibrate_recipe.py and plot_calibration.py: the queue file, run names, resuming
with the CPU time of earlier invocations added, and the CSV the plot is made from."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import calibrate_recipe  # noqa: E402
import plot_calibration  # noqa: E402


def test_the_committed_queue_is_valid_and_its_recipe_loads():
    from robust_attn.train import load_recipe

    recipe, runs = calibrate_recipe.read_queue(REPO / "benchmarks" / "calibration_queue.toml")
    names = [calibrate_recipe.run_name(r) for r in runs]
    assert len(set(names)) == len(names)  # every run has its own folder
    for run in runs:
        load_recipe(REPO / recipe, [f"model={run['model']}", f"model_args.width={run['width']}",
                                    f"model_args.stem_downsample={run['stem']}", f"epochs={run['epochs']}",
                                    *run["overrides"]], check_data=False)


@pytest.mark.parametrize("text,message", [
    ('recipe = "x.toml"\n', "a queue has"),
    ('recipe = "x.toml"\n[[run]]\nmodel = "resnet26"\nwidth = 0.25\nstem = 2\n', "missing \\['epochs'\\]"),
    ('recipe = "x.toml"\n[[run]]\nmodel = "resnet26"\nwidth = 0.25\nstem = 2\nepochs = 1\n'
     'overrides = ["data.translate=4"]\n', "a tag exactly when it has overrides"),
])
def test_a_bad_queue_says_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "queue.toml"
    path.write_text(text)
    with pytest.raises(SystemExit, match=message):
        calibrate_recipe.read_queue(path)


def test_progress_adds_the_cpu_time_of_a_resumed_run(tmp_path, monkeypatch):
    """A run killed after epoch 1 and resumed: progress.csv keeps epoch 1's row and adds epoch 2's
    CPU seconds to it; the plot CSV has both rows with the cumulative hours."""
    import robust_attn.train as train_pkg
    import robust_attn.train.checkpoints as checkpoints

    run = {"model": "resnet26", "width": 0.25, "stem": 2, "epochs": 2, "overrides": []}
    out = tmp_path / calibrate_recipe.run_name(run)
    calls = []
    clock = iter([100.0, 103.0, 200.0, 205.0])  # process_time at start and after each epoch line

    monkeypatch.setattr(calibrate_recipe.time, "process_time", lambda: next(clock))

    def fake_train(recipe, out_dir, resume, progress, log):
        calls.append(resume)
        epoch = 2 if resume else 1
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = [{"epoch": e, "train_loss": 2.0 / e, "eval_top1": 40.0 * e} for e in range(1, epoch + 1)]
        with (out_dir / "metrics.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["epoch", "train_loss", "eval_top1"])
            writer.writeheader()
            writer.writerows(rows)
        log(f"epoch {epoch}/2: loss 1.0, lr 0.1, 10 img/s, test top-1 {40.0 * epoch}% top-5 90%")
        if resume:
            (out_dir / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(train_pkg, "train", fake_train)
    monkeypatch.setattr(train_pkg, "load_recipe", lambda path, overrides: None)
    monkeypatch.setattr(checkpoints, "latest_checkpoint", lambda folder: folder if calls else None)
    calibrate_recipe.train_one(REPO / "x.toml", run, tmp_path, None)
    calibrate_recipe.train_one(REPO / "x.toml", run, tmp_path, None)
    calibrate_recipe.train_one(REPO / "x.toml", run, tmp_path, None)  # finished: skipped
    assert calls == [False, True]
    rows = calibrate_recipe.read_progress(out / "progress.csv")
    assert [r["epoch"] for r in rows] == [1, 2] and [r["test_top1"] for r in rows] == [40.0, 80.0]
    assert [r["epoch_cpu_s"] for r in rows] == [3.0, 5.0] and [r["cum_cpu_s"] for r in rows] == [3.0, 8.0]

    plotted = plot_calibration.collect(tmp_path)
    assert [(r["run"], r["epoch"], r["finished"]) for r in plotted] == [(out.name, 1, True), (out.name, 2, True)]
    assert plotted[1]["cum_cpu_hours"] == pytest.approx(8.0 / 3600)


def test_a_run_is_trained_by_one_worker_at_a_time(tmp_path, monkeypatch):
    """Two workers on one queue: a run whose worker.lock names a live other process is passed over;
    a lock of a killed worker (a dead process id, or a live id with another start time: the id was
    reused) is taken over and removed when the run ends."""
    import os

    import robust_attn.train as train_pkg

    run = {"model": "resnet26", "width": 0.25, "stem": 2, "epochs": 1, "overrides": []}
    out = tmp_path / calibrate_recipe.run_name(run)
    out.mkdir()
    lock = out / "worker.lock"
    other = calibrate_recipe._process_identity(os.getppid())  # a live process that is not this one
    assert other is not None and other != calibrate_recipe._process_identity(os.getpid())
    trained = []

    def fake_train(recipe, out_dir, resume, progress, log):
        assert lock.read_text() == calibrate_recipe._process_identity(os.getpid())  # held while training
        trained.append(resume)

    monkeypatch.setattr(train_pkg, "train", fake_train)
    monkeypatch.setattr(train_pkg, "load_recipe", lambda path, overrides: None)

    lock.write_text(other)
    calibrate_recipe.train_one(REPO / "x.toml", run, tmp_path, None)
    assert trained == [] and lock.read_text() == other  # passed over, the other worker's lock kept

    pid, start = other.split(":")
    for stale in (f"{pid}:{int(start) + 1}", "999999999:5"):
        lock.write_text(stale)
        calibrate_recipe.train_one(REPO / "x.toml", run, tmp_path, None)
        assert not lock.exists()
    assert trained == [False, False]

    with calibrate_recipe.claim(out) as mine:
        assert mine and lock.is_file()
    assert not lock.exists()


def test_the_zoo_curves_read_each_tagged_entrys_training_log(tmp_path):
    """`plot_calibration.py --zoo TAG`: the entries named <architecture>-TAG, one row per epoch of
    their logs, CPU-hours summed where the log records them and left empty where it does not."""
    logs = {"resnet26-efficient": "epoch,eval_top1,epoch_seconds\n1,50.0,7.0\n2,60.0,7.0\n",
            "sasa_resnet26-efficient": "epoch,eval_top1,epoch_seconds,epoch_cpu_s\n1,40.0,9.0,1800\n2,55.5,9.0,3600\n",
            "resnet26-adv": "epoch,eval_top1,epoch_seconds,epoch_cpu_s\n1,30.0,5.0,5.0\n"}
    models = []
    for name, text in logs.items():
        (tmp_path / f"{name}.csv").write_text(text)
        arch = name.split("-")[0]
        models.append({"name": name, "arch": {"name": arch, "overrides": {"width": 0.25, "stem_downsample": 2}},
                       "log": f"{name}.csv"})
    models.append({"name": "gsa_resnet26-efficient", "arch": {"name": "gsa_resnet26"}})   # no log: left out
    (tmp_path / "manifest.json").write_text(json.dumps({"models": models}))
    rows = plot_calibration.collect_zoo(tmp_path / "manifest.json", "efficient")
    assert [(r["run"], r["epoch"], r["test_top1"]) for r in rows] == [
        ("resnet26-efficient", 1, 50.0), ("resnet26-efficient", 2, 60.0),
        ("sasa_resnet26-efficient", 1, 40.0), ("sasa_resnet26-efficient", 2, 55.5)]
    assert [r["cum_cpu_hours"] for r in rows] == [None, None, 0.5, 1.5]
    assert {(r["model"], r["width"], r["stem"], r["epochs"]) for r in rows} == {("resnet26", 0.25, 2, 2),
                                                                                ("sasa_resnet26", 0.25, 2, 2)}
    out = tmp_path / "curves"
    plot_calibration.main(["--zoo", "efficient", "--manifest", str(tmp_path / "manifest.json"), "--out", str(out)])
    assert out.with_suffix(".png").is_file()
    with out.with_suffix(".csv").open() as f:
        assert [row["cum_cpu_hours"] for row in csv.DictReader(f)] == ["", "", "0.5", "1.5"]
