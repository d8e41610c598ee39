"""``robust-attn eval rotation|pgd``: arguments, errors, checkpoints, kill-and-resume, torchrun."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from robust_attn.models.checkpoint import save_checkpoint
from robust_attn.cli import main
from robust_attn.models.registry import create_model
from robust_attn.runs.store import load_records
from robust_attn.models.wrapper import NormalizedModel
from helpers import subprocess_env

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "resnet26", "--model-args", "width=0.25", "--dataset", "synthetic", "--no-progress"]




def test_rotation_cli_writes_a_run_and_prints_a_summary(tmp_path, capsys):
    out = tmp_path / "rot"
    assert main(["eval", "rotation", *TINY, "--limit", "4", "--batch-size", "2", "--angle-step", "0",
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "RANDOM weights" in captured.err
    line = captured.out.strip().splitlines()[-1]
    assert line.startswith("rotation resnet26 on synthetic/test (4 images)") and str(out) in line
    desc = json.loads((out / "run.json").read_text())
    assert desc["checkpoint"] is None and desc["arch"]["overrides"] == {"width": 0.25}
    assert desc["dataset"] == {"name": "synthetic", "split": "test", "limit": 4}
    assert [c["name"] for c in desc["conditions"]] == ["none", "cw90", "cw180", "cw270", "flip_ud", "flip_lr"]
    assert len(load_records(out)) == 4 * 6
    # the same command again computes nothing and gives the same records
    before = {p: p.stat().st_mtime_ns for p in (out / "records").rglob("*.csv")}
    assert main(["eval", "rotation", *TINY, "--limit", "4", "--batch-size", "2", "--angle-step", "0",
                 "--out", str(out)]) == 0
    assert before == {p: p.stat().st_mtime_ns for p in (out / "records").rglob("*.csv")}


def test_attention_path_reaches_the_model_and_run_json(tmp_path, monkeypatch):
    from robust_attn.layers import san

    calls = []
    unfold = san.san_attention_unfold
    monkeypatch.setattr(san, "san_attention_unfold", lambda *a, **k: calls.append(1) or unfold(*a, **k))
    args = ["eval", "rotation", "--model", "san10_pairwise", "--model-args", "width=0.25", "stem_downsample=4",
            "--dataset", "synthetic", "--no-progress", "--limit", "2", "--batch-size", "2", "--angle-step", "0"]
    assert main([*args, "--out", str(tmp_path / "lean")]) == 0
    assert not calls and json.loads((tmp_path / "lean" / "run.json").read_text())["attention_path"] == "lean"
    assert main([*args, "--attention-path", "reference", "--out", str(tmp_path / "ref")]) == 0
    assert calls and json.loads((tmp_path / "ref" / "run.json").read_text())["attention_path"] == "reference"
    pd.testing.assert_series_equal(load_records(tmp_path / "ref")["pred"], load_records(tmp_path / "lean")["pred"])


def test_pgd_cli_sweep_lists(tmp_path, capsys):
    out = tmp_path / "pgd"
    assert main(["eval", "pgd", *TINY, "--limit", "2", "--batch-size", "2", "--eps", "2,8", "--steps", "1",
                 "--no-checks", "--out", str(out)]) == 0
    desc = json.loads((out / "run.json").read_text())
    assert [c["name"] for c in desc["conditions"]] == ["clean", "pgd_eps2_step2_n1", "pgd_eps8_step8_n1"]
    assert desc["parameters"]["targets"] == {"seed": 0, "rule": "uniform over the wrong classes"}
    assert (out / "targets.csv").is_file()
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("pgd resnet26 on synthetic/test (2 images): clean top-1") and "pgd_eps8_step8_n1" in line


@pytest.mark.parametrize("argv, message", [
    (["eval", "rotation", "--model", "resnet262", "--dataset", "synthetic"], "unknown model 'resnet262'"),
    (["eval", "rotation", "--dataset", "synthetic"], "give --model"),
    (["eval", "pgd", *TINY, "--eps", "8,x"], "--eps takes a comma-separated list"),
    (["eval", "rotation", *TINY[:3], "width", "--dataset", "synthetic"], "key=value"),
    (["eval", "rotation", *TINY, "--batch-size", "0"], "--batch-size must be positive"),
    (["eval", "rotation", "--model", "resnet26", "--dataset", "cifar100", "--root", "/nonexistent"],
     "not found"),
    (["eval", "rotation", "--checkpoint", "/nonexistent.safetensors", "--dataset", "synthetic"], "does not exist"),
    (["eval", "rotation", *TINY, "--dataset", "imagenet2"], "unknown dataset"),
    (["report", "/nonexistent-run", "--out", "/tmp/x"], "not a run directory"),
    (["eval", "pgd", *TINY, "--eps", "nan"], "--eps takes finite numbers"),
    (["eval", "pgd", *TINY, "--eps", "2,,8"], "--eps has an empty item"),
    (["eval", "pgd", *TINY, "--eps", "8/255"], "(in 1/255 units: 8 means 8/255)"),
    (["eval", "rotation", *TINY, "--num-workers", "-1"], "--num-workers must be 0"),
    (["eval", "transfer", "--source", "resnet26", "--target", "resnet26", "--dataset", "synthetic",
      "--num-workers", "-1"], "--num-workers must be 0"),
])
def test_bad_input_is_a_clear_error(argv, message, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path / "o")] if argv[0] == "eval" else argv) == 2
    assert message in capsys.readouterr().err


def test_bad_input_leaves_no_run_folder(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["eval", "rotation", *TINY, "--num-workers", "-1", "--out", str(out)]) == 2
    assert not out.exists()


def test_a_file_where_a_folder_is_written_is_a_one_line_error(tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    assert main(["eval", "rotation", *TINY, "--limit", "2", "--angle-step", "0", "--out", str(blocker)]) == 2
    err = capsys.readouterr().err
    assert f"{blocker}: a file is in the way where a folder is needed" in err and "Traceback" not in err
    assert main(["eval", "rotation", *TINY, "--limit", "2", "--angle-step", "0", "--out", str(blocker / "x")]) == 2
    assert "a file is in the way" in capsys.readouterr().err


def test_pgd_eps_below_one_is_warned_to_be_in_1_255_units(tmp_path, capsys):
    assert main(["eval", "pgd", *TINY, "--limit", "2", "--batch-size", "2", "--eps", "0.03", "--steps", "1",
                 "--no-checks", "--out", str(tmp_path / "o")]) == 0
    assert "warning: --eps 0.03 is in 1/255 units" in capsys.readouterr().err


def test_rerun_with_other_settings_in_the_same_dir_is_refused(tmp_path, capsys):
    args = ["eval", "rotation", *TINY, "--limit", "2", "--batch-size", "2", "--angle-step", "0", "--no-hflip",
            "--out", str(tmp_path / "r")]
    assert main(args) == 0
    assert main(args[:-2] + ["--model-args", "width=0.5", "--out", str(tmp_path / "r")]) == 2
    assert "holds a different run" in capsys.readouterr().err


def test_checkpoint_is_described_by_sha256(tmp_path, capsys):
    torch.manual_seed(0)
    model = NormalizedModel(create_model("resnet26", num_classes=10, resolution="cifar", width=0.25),
                            (0.5,) * 3, (0.25,) * 3)
    sha = save_checkpoint(tmp_path / "m.safetensors", model)
    out = tmp_path / "r"
    common = ["--dataset", "synthetic", "--limit", "2", "--batch-size", "2", "--angle-step", "0", "--no-progress"]
    assert main(["eval", "rotation", "--checkpoint", str(tmp_path / "m.safetensors"), *common, "--out", str(out)]) == 0
    desc = json.loads((out / "run.json").read_text())
    assert desc["checkpoint"]["sha256"] == sha and desc["model"] == "resnet26"
    assert main(["eval", "rotation", "--model", "san10_pairwise", "--checkpoint", str(tmp_path / "m.safetensors"),
                 *common, "--out", str(tmp_path / "r2")]) == 2
    assert "holds resnet26" in capsys.readouterr().err


def test_real_cifar100_sample_if_present(tmp_path, shared_dir):
    from robust_attn.data import build_dataset

    try:
        build_dataset("cifar100", root=shared_dir / "data", split="test", limit=2)
    except FileNotFoundError as err:
        pytest.skip(f"CIFAR-100 test set not readable here: {str(err)[:80]}")
    assert main(["eval", "rotation", "--model", "resnet26", "--model-args", "width=0.25", "--dataset", "cifar100",
                 "--root", str(shared_dir / "data"), "--limit", "4", "--batch-size", "2", "--angle-step", "0",
                 "--no-progress", "--out", str(tmp_path / "c")]) == 0
    assert load_records(tmp_path / "c")["label"].between(0, 99).all()


@pytest.mark.slow  # ~20 s on a busy machine; test_results.py interrupts a run in-process by default
def test_sigkill_midway_then_resume_equals_an_uninterrupted_run(tmp_path):
    args = ["eval", "rotation", *TINY, "--limit", "12", "--batch-size", "1", "--angle-step", "90"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "robust_attn.cli", *args, "--out", str(killed)], env=subprocess_env(),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list((killed / "records").rglob("*.csv"))) < 10:
        time.sleep(0.05)
        assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = {p: p.stat().st_mtime_ns for p in (killed / "records").rglob("*.csv")}
    total = 12 * 6  # 12 one-image chunks x (5 paper conditions + flip_lr)
    assert 10 <= len(done_before) < total
    assert main([*args, "--no-progress", "--out", str(killed)]) == 0
    after = {p: p.stat().st_mtime_ns for p in (killed / "records").rglob("*.csv")}
    assert len(after) == total
    assert all(after[p] == t for p, t in done_before.items())  # nothing recomputed
    assert main([*args, "--no-progress", "--out", str(tmp_path / "clean")]) == 0
    pd.testing.assert_frame_equal(load_records(killed), load_records(tmp_path / "clean"))


@pytest.mark.parametrize("protocol", ["rotation", pytest.param("pgd", marks=pytest.mark.slow)])
def test_torchrun_two_gloo_ranks_merge_to_the_single_process_run(tmp_path, protocol):
    extra = ["--angle-step", "90"] if protocol == "rotation" else ["--eps", "4", "--steps", "1"]
    args = ["eval", protocol, *TINY, "--limit", "6", "--batch-size", "2", "--device", "cpu", *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "robust_attn.cli", *args, "--out", str(tmp_path / "ddp")]
    result = subprocess.run(cmd, env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(f"{protocol} resnet26 on synthetic/test (6 images)") == 1  # rank 0 only
    assert main([*args, "--out", str(tmp_path / "single")]) == 0
    pd.testing.assert_frame_equal(load_records(tmp_path / "ddp"), load_records(tmp_path / "single"))
    desc = json.loads((tmp_path / "ddp" / "run.json").read_text())
    assert desc["world_size"] == 2


def test_a_reader_that_goes_away_ends_the_command_without_a_traceback():
    """``robust-attn zoo list | head -1``: the pipe's reader closes before the command writes; the
    command ends as a program ended by SIGPIPE (exit 141), with nothing on stderr."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "robust_attn.cli", "zoo", "list"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()   # before the child has imported anything: its first write finds no reader
    _, err = proc.communicate(timeout=300)
    assert err.decode() == "" and proc.returncode == 141
