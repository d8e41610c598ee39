"""benchmarks/bench_efficiency.py and its variant table (benchmarks/_attack_variants.py): what a run
records for each variant, derived figures recomputed here from the timings it wrote, option checks
(``--dry-run`` accepts the CUDA command lines without a GPU), a failing variant recorded while the
others are measured, and the timing helpers of benchmarks/_measure.py. No timing is asserted.
On a GPU the same run with ``--device cuda`` (skipped without CUDA)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_efficiency  # noqa: E402
from _attack_variants import VARIANTS, Attacked, Variant, variants_for  # noqa: E402
from _measure import matmul_tf32, step_time_ms  # noqa: E402

SAME_FUNCTION = ("default", "as_is", "copy", "lean", "reference")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / "eff.json"
    assert bench_efficiency.main([*argv, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _check_derived(payload: dict, basis: str) -> None:
    """images/s, GFLOP/s, shares of the matmul rate, ratios to resnet26 and the summary, from the
    times and FLOP counts the file holds."""
    peak = payload["matmul_gflops"]["used"]
    assert peak == max(payload["matmul_gflops"]["before"], payload["matmul_gflops"]["after"])
    resnet = {row["size"]: row["variants"] for row in payload["rows"] if row["family"] == "resnet26"}
    for row in payload["rows"]:
        best = max(row["variants"], key=lambda v: row["variants"][v]["images_per_s"])
        cell = payload["summary"][str(row["size"])][row["family"]]
        assert cell["best_variant"] == best
        want_best = row["variants"][best]["images_per_s"] / max(r["images_per_s"] for r in resnet[row["size"]].values())
        assert cell["best_vs_resnet26_best"] == pytest.approx(want_best)
        for v, r in row["variants"].items():
            assert r["images_per_s"] == pytest.approx(row["batch"] / r[basis] * 1e3)
            assert r["gflops"] == pytest.approx(row["step_gflop"] / r[basis] * 1e3)
            assert r["fraction_of_matmul_peak"] == pytest.approx(r["gflops"] / peak)
            assert r["vs_resnet26"] == pytest.approx(r["images_per_s"] / resnet[row["size"]][v]["images_per_s"])
            assert r["grad_elements"] == row["batch"] * 3 * row["size"] ** 2


def test_cpu_run_records_every_variant_with_the_path_it_ran(tmp_path):
    payload = _run(tmp_path, "--device", "cpu", "--families", "resnet26,gsa_resnet26", "--sizes", "32", "64",
                   "--batch", "2", "--batch-224", "2", "--variants", "default,as_is,copy,lean,reference,bf16",
                   "--variants-224", "lean,reference", "--repeats", "1")
    assert payload["device"] == "cpu" and payload["complete"] and payload["settings"]["device"] == "cpu"
    assert "process-CPU-time" in payload["timing"]
    assert [(r["family"], r["size"]) for r in payload["rows"]] == [
        ("resnet26", 32), ("gsa_resnet26", 32), ("resnet26", 64), ("gsa_resnet26", 64)]
    _check_derived(payload, "cpu_ms")
    gsa32, gsa64 = payload["rows"][1], payload["rows"][3]
    # on a CPU the attacks query the folded copy, channels-last (resolve_attack_copy("auto", "cpu"))
    assert gsa32["variants"]["default"]["attack_copy"] and gsa32["variants"]["default"]["channels_last_input"]
    assert not gsa32["variants"]["as_is"]["attack_copy"]
    assert gsa32["variants"]["default"]["attention_path"] == ["lean"]
    assert gsa32["variants"]["reference"]["attention_path"] == ["reference"]
    assert payload["rows"][0]["variants"]["reference"]["attention_path"] == []    # resnet26 has no such layers
    assert gsa64["width"] == 0.25 and gsa64["variants"]["reference"]["attention_path"] == ["reference"]
    for row in payload["rows"]:
        for v, r in row["variants"].items():
            if v in SAME_FUNCTION:
                assert r["max_logit_diff_vs_first"] < 1e-4, (row["family"], v)
                assert r["grad_signs_differing_vs_first"] <= r["grad_elements"] // 100, (row["family"], v)
    assert gsa32["variants"]["bf16"]["max_logit_diff_vs_first"] > 0    # another function
    assert "cpu_ms" in gsa32["variants"]["default"] and "peak_mb" not in gsa32["variants"]["default"]


class _FailsAfterFirstCall(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module, self.calls = module, 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 1:
            raise MemoryError("out of memory in the second step")
        return self.module(x)


def test_a_failing_variant_is_recorded_and_the_others_measured(monkeypatch):
    def broken(model, x):
        raise RuntimeError("out of memory, say\nsecond line")

    def flaky(model, x):
        return Attacked(_FailsAfterFirstCall(model), channels_last=False, attack_copy=False)

    monkeypatch.setitem(VARIANTS, "broken", Variant(broken, "raises"))
    monkeypatch.setitem(VARIANTS, "flaky", Variant(flaky, "raises after its first step"))
    row = bench_efficiency.measure_family("resnet26", 32, 2, ["broken", "default", "flaky"], repeats=2)
    assert row["variants"]["broken"] == {"error": "RuntimeError: out of memory, say"}
    assert row["variants"]["flaky"] == {"error": "MemoryError: out of memory in the second step"}
    assert row["variants"]["default"]["max_logit_diff_vs_first"] == 0    # the first variant that ran
    assert row["variants"]["default"]["images_per_s"] > 0


def test_dry_run_accepts_cuda_command_lines_without_a_gpu(tmp_path, capsys):
    out = tmp_path / "never.json"
    argv = ["--device", "cuda", "--sizes", "224", "--width-224", "1.0", "--batch-224", "64", "--families",
            "resnet26,san10_pairwise", "--variants-224", "lean,reference,compiled,cuda_graph", "--dry-run"]
    assert bench_efficiency.main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "would measure san10_pairwise at 224 px width 1.0, batch 64, on cuda: lean,reference,compiled,cuda_graph" \
        in printed
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--variants", "default,fastest"], "unknown variant(s) ['fastest'] in --variants"),
    (["--variants-224", "cuda_graph"], "['cuda_graph'] in --variants-224 do not run on cpu"),
    (["--families", "resnet50"], "unknown families ['resnet50']"),
    (["--device", "mps"], "--device must be cpu or cuda"),
    (["--width-224", "0"], "--width-224 must be in (0, 4]"),
])
def test_options_are_checked_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_efficiency.main([*argv, "--dry-run"])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_cuda_without_a_gpu_is_an_error_that_names_the_fix(capsys):
    with pytest.raises(SystemExit):
        bench_efficiency.main(["--device", "cuda", "--sizes", "32"])
    assert "use --device cpu" in capsys.readouterr().err


def test_cuda_graph_variants_are_cuda_only():
    assert set(VARIANTS) - set(variants_for("cpu")) == {"cuda_graph", "cuda_graph_reference"}
    assert variants_for("cuda") == list(VARIANTS)


def test_step_time_on_a_cpu_is_process_time():
    ms, wall = step_time_ms(lambda: time.sleep(0.05), "cpu")
    assert wall >= 50 and ms < wall          # sleeping takes wall time, not the process's CPU time


def test_matmul_tf32_is_restored_even_after_an_error():
    before = torch.backends.cuda.matmul.allow_tf32
    with pytest.raises(ValueError):
        with matmul_tf32(not before):
            assert torch.backends.cuda.matmul.allow_tf32 is (not before)
            raise ValueError
    assert torch.backends.cuda.matmul.allow_tf32 is before


@needs_cuda
def test_cuda_run_times_every_variant_with_synchronized_wall_time(tmp_path):
    payload = _run(tmp_path, "--device", "cuda", "--families", "resnet26,san10_pairwise", "--sizes", "32",
                   "--batch", "4", "--variants", "default,reference,copy,bf16,cuda_graph,cuda_graph_reference",
                   "--repeats", "2")
    assert payload["device"] == "cuda" and payload["complete"]
    assert "synchronized" in payload["timing"]
    assert {"before", "after", "used"} <= set(payload["matmul_gflops_bf16"])
    _check_derived(payload, "wall_ms")
    san = payload["rows"][1]["variants"]
    assert not san["default"]["attack_copy"] and san["copy"]["attack_copy"]    # auto: the model as given on CUDA
    assert san["reference"]["attention_path"] == ["reference"] and san["cuda_graph"]["cuda_graph"]
    for row in payload["rows"]:
        for v, r in row["variants"].items():
            assert "error" not in r and "cpu_ms" not in r and r["peak_mb"] > 0
            if v != "bf16":
                assert r["max_logit_diff_vs_first"] < 1e-2, (row["family"], v)
