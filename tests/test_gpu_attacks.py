"""zoo/studies/gpu_attacks.sh, a study's attack steps on a lent GPU machine for the CPU study to adopt:
what comes back (finished records and run descriptions, no claims or saved attack states, which belong to
the machine that wrote them), one study process per model, and, slow, the round trip on the CPU: the
script's runs unpacked and adopted by the same study with --reuse-runs, every chunk, none computed again."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from helpers import subprocess_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "zoo" / "studies" / "gpu_attacks.sh"

#: stands in for python: `-m robust_attn.cli study ... --runs R --models M` writes a run of M under R as a
#: killed attack leaves it (a finished chunk, a claim, a saved state); `status` prints a line
FAKE_PYTHON = r"""#!/usr/bin/env bash
shift 2
command=$1; shift
[ "$command" = status ] && { echo "status of $1"; exit 0; }
while [ $# -gt 0 ]; do
    case $1 in --runs) runs=$2; shift ;; --models) model=$2; shift ;; esac
    shift
done
run="$runs/autoattack-$model"
mkdir -p "$run/records/clean" "$run/manifest/clean" "$run/claims/clean" "$run/partial"
echo '{"model": "'"$model"'"}' > "$run/run.json"
echo "index,label" > "$run/records/clean/000000000-000000002.csv"
echo '{"rows": 1}' > "$run/manifest/clean/000000000-000000002.csv.sha256"
echo "pid 1" > "$run/claims/clean/000000002-000000004.csv.claim.0"
echo state > "$run/partial/autoattack_linf_eps8-2.pt"
echo "study of $model on $DEVICE_SEEN"
"""


def _run(tmp_path: Path, **settings: str) -> subprocess.CompletedProcess:
    env = {**subprocess_env(), "OUT": str(tmp_path / "out"), "RUNS": str(tmp_path / "runs"), **settings}
    return subprocess.run(["bash", str(SCRIPT)], cwd="/", env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_what_comes_back_is_the_finished_records_of_every_model(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    done = _run(tmp_path, PYTHON=str(fake), MODELS="a-adv,b-adv", DEVICE_SEEN="x")
    assert done.returncode == 0, done.stdout
    assert "status of " in done.stdout
    with tarfile.open(tmp_path / "out" / "runs.tar.gz") as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
    for model in ("a-adv", "b-adv"):
        assert {f"autoattack-{model}/run.json", f"autoattack-{model}/records/clean/000000000-000000002.csv",
                f"autoattack-{model}/manifest/clean/000000000-000000002.csv.sha256", f"logs/{model}.log"} <= names
    assert not [n for n in names if "claims" in n or "partial" in n]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["runs.tar.gz"]     # the device tool brings <= 8


@pytest.mark.slow
def test_the_cpu_study_adopts_every_chunk_the_script_wrote(tmp_path):
    limits = ["--attack-limit", "4", "--autoattack-limit", "4", "--attack-batch-size", "2"]
    done = _run(tmp_path, PYTHON=sys.executable, DEVICE="cpu", ATTENTION_PATH="lean", MODELS="resnet26",
                STUDY="zoo/studies/cifar10_adversarial.toml", BUDGET_S="300", EXTRA=" ".join(limits))
    assert done.returncode == 0, done.stdout
    back = tmp_path / "back"
    back.mkdir()
    with tarfile.open(tmp_path / "out" / "runs.tar.gz") as tar:
        tar.extractall(back, filter="data")
    local = tmp_path / "local"
    study = subprocess.run(
        [sys.executable, "-m", "robust_attn.cli", "study", str(REPO / "zoo/studies/cifar10_adversarial.toml"),
         "--runs", str(local), "--reuse-runs", str(back), "--out", str(tmp_path / "report"), "--protocols",
         "autoattack", "--models", "resnet26", *limits, "--workers", "1", "--no-progress", "--device", "cpu"],
        cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert study.returncode == 0, study.stdout
    with open(local / "timings.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert (row["chunks_written"], row["chunks_adopted"], row["chunks_total"]) == ("0", "4", "4")
    entries = sorted((local / "autoattack-resnet26" / "manifest").rglob("*.sha256"))
    assert len(entries) == 4
    assert all(json.loads(e.read_text())["adopted_from"] == str(back / "autoattack-resnet26") for e in entries)
