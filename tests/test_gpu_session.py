"""benchmarks/gpu_session.sh, the one command a session with a lent GPU runs: its syntax, every step's
options (its dry run, which needs no GPU: bench_efficiency.py --dry-run, pytest --collect-only), the
files it leaves (the device tool brings back at most 8), and, slow, a real run of its measuring steps
on the CPU with tiny shapes, in which a step stopped by its time limit is recorded and the rows it
finished are kept."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import subprocess_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_session.sh"
STEPS = ["env", "eff32", "eff224", "eff224-compiled", "pytest-cuda", "eff32-compiled"]


def _run(out: Path, **settings: str) -> subprocess.CompletedProcess:
    env = {**subprocess_env(), "PYTHON": sys.executable, "OUT": str(out), "OMP_NUM_THREADS": "1",
           **{f"GPU_SESSION_{k.upper()}": v for k, v in settings.items()}}
    return subprocess.run(["bash", str(SCRIPT)], cwd="/", env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)


def _steps(out: Path) -> dict[str, str]:
    with open(out / "steps.tsv") as f:
        return {row["step"]: row["status"] for row in csv.DictReader(f, delimiter="\t")}


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_checks_every_step_without_a_gpu(tmp_path):
    done = _run(tmp_path, dry_run="1")
    assert done.returncode == 0, done.stdout
    assert _steps(tmp_path) == {step: "ok" for step in STEPS}
    # the CUDA command lines were checked as such, with the CUDA-only variants
    assert "would measure san10_pairwise at 224 px width 1.0, batch 64, on cuda: lean,reference,bf16,cuda_graph," \
           "cuda_graph_reference" in done.stdout
    assert "would measure ea_resnet26 at 32 px, batch 64, on cuda: default,compiled" in done.stdout
    assert "test_native_pgd_fast_mode_ends_on_the_exact_modes_predictions[san10_pairwise-cuda]" in done.stdout
    results = [line.split()[-1] for line in done.stdout.splitlines() if line.startswith("would write ")]
    assert len(results) == 4 and all(r.startswith(str(tmp_path)) for r in results)
    assert len(set(results)) + 2 <= 8                  # with session.log and steps.tsv: what comes back
    assert sorted(os.listdir(tmp_path)) == ["session.log", "steps.tsv"]      # nothing measured


@pytest.mark.slow
def test_cpu_run_of_the_measuring_steps_keeps_a_timed_out_steps_rows(tmp_path):
    done = _run(tmp_path, device="cpu", batch="2", batch_224="2", size_224="64", width_224="0.25", repeats="1",
                families="resnet26,gsa_resnet26", families_224="resnet26,gsa_resnet26", budget_s="90",
                skip="pytest-cuda eff32-compiled")
    steps = _steps(tmp_path)
    assert done.returncode == (0 if steps["eff224-compiled"] == "ok" else 1), done.stdout
    assert {s: steps[s] for s in ("env", "eff32", "eff224")} == {"env": "ok", "eff32": "ok", "eff224": "ok"}
    assert steps["pytest-cuda"] == steps["eff32-compiled"] == "skipped"
    eff32 = json.loads((tmp_path / "efficiency_cpu.json").read_text())
    assert eff32["device"] == "cpu" and eff32["complete"]
    assert [r["family"] for r in eff32["rows"]] == ["resnet26", "gsa_resnet26"]
    assert "SUMMARY cpu 64px gsa_resnet26: best " in done.stdout
    compiled = tmp_path / "efficiency_224_compiled_cpu.json"
    if steps["eff224-compiled"] == "ok":
        assert json.loads(compiled.read_text())["complete"]
    else:   # stopped by its limit (compiling on this CPU is slow): the rows it finished, if any, are kept
        assert steps["eff224-compiled"] == "timeout"
        assert not compiled.exists() or not json.loads(compiled.read_text())["complete"]
    assert len(os.listdir(tmp_path)) <= 8
