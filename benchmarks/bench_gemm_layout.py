"""CPU seconds of SAN10's training step under two register layouts of the window kernels' small
products (robust_attn/layers/csrc/small_gemm.h), side by side in one process: the layout the build
picks for this CPU, against another given by the SMALL_GEMM_* macros (by default AVX-512's: 64-byte
vectors, 8 rows, 4 x 4 dot products, which on an AVX2 CPU need twice its 16 vector registers).

    OMP_NUM_THREADS=1 python benchmarks/bench_gemm_layout.py --out benchmarks/results/gemm_layout_avx2.json

Both layouts are compiled here from the same sources (-O3 -march=native, as robust_attn/layers/
cpu_kernels.py builds them; the first run takes a minute or two per layout). The step is the
standard training step of the CIFAR zoo's shape (width 0.25, stem 2, 32 px, float32, channels-last,
SGD), timed in turns (one step of each layout per round, median over --repeats rounds after a
warm-up round). Before timing, both layouts' logits and input gradients on the same batch are
compared: they must agree to float rounding (the summation order over k is the same; only
gemm_nt's dot products differ).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from robust_attn.layers import cpu_kernels  # noqa: E402
from robust_attn.models.registry import create_model  # noqa: E402
from robust_attn.utils.hardware import hardware_label  # noqa: E402

AVX512_LAYOUT = "SMALL_GEMM_VECTOR_BYTES=64,SMALL_GEMM_NN_ROWS=8,SMALL_GEMM_NT_COLS=4"


def build_variant(defines: str):
    """The kernels compiled with ``defines`` (comma list of NAME=VALUE), as a separate module."""
    from torch.utils.cpp_extension import load

    flags = [f"-D{d}" for d in defines.split(",") if d]
    tag = "_".join(d.split("=")[1] for d in defines.split(",") if d)
    return load(name=f"robust_attn_gemm_layout_{tag}", sources=[str(p) for p in cpu_kernels._SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
                verbose=False)


def make_step(name: str, batch: int):
    torch.manual_seed(0)
    model = create_model(name, 10, "cifar", width=0.25, stem_downsample=2).to(memory_format=torch.channels_last)
    images = torch.rand(batch, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (batch,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    criterion = nn.CrossEntropyLoss()

    def step() -> float:
        start = time.process_time()
        loss = criterion(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return time.process_time() - start

    def outputs() -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(1)
        probe = create_model(name, 10, "cifar", width=0.25, stem_downsample=2).to(memory_format=torch.channels_last)
        x = images[:32].clone().requires_grad_()
        logits = probe(x)
        criterion(logits, labels[:32]).backward()
        return logits.detach(), x.grad

    return step, outputs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["san10_pairwise", "san10_patchwise"])
    p.add_argument("--other", default=AVX512_LAYOUT, help="the other layout's macros, NAME=VALUE,...")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    layouts = {"this CPU's": cpu_kernels._load(), "other": build_variant(args.other)}
    if layouts["this CPU's"] is None:
        sys.exit("the CPU kernels did not build here; nothing to compare")
    rows = []
    print(f"{hardware_label('cpu')}; other layout: {args.other}")
    print(f"{'model':16s} {'layout':>11s} {'cpu s/step':>10s} {'other / this':>12s} {'max |logit diff|':>16s}")
    for name in args.models:
        step, outputs = make_step(name, args.batch)
        results = {}
        for label, module in layouts.items():
            cpu_kernels._module = module
            results[label] = outputs()
        logits_diff = (results["other"][0] - results["this CPU's"][0]).abs().max().item()
        grad_diff = (results["other"][1] - results["this CPU's"][1]).abs().max().item()
        grad_scale = results["this CPU's"][1].abs().max().item()
        if logits_diff > 1e-4 or grad_diff > 1e-4 * grad_scale:
            sys.exit(f"{name}: the layouts disagree (logits {logits_diff:.2e}, input gradients {grad_diff:.2e})")
        times = {label: [] for label in layouts}
        for round_ in range(args.repeats + 1):
            for label, module in layouts.items():
                cpu_kernels._module = module
                seconds = step()
                if round_:  # the first round warms up
                    times[label].append(seconds)
        this = statistics.median(times["this CPU's"])
        for label in layouts:
            median = statistics.median(times[label])
            rows.append({"model": name, "layout": label, "cpu_s_per_step": median, "other_over_this": median / this,
                         "max_logit_diff": logits_diff, "max_input_grad_diff": grad_diff})
            print(f"{name:16s} {label:>11s} {median:10.3f} {median / this:12.2f} {logits_diff:16.2e}")
    cpu_kernels._module = layouts["this CPU's"]
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": " ".join(["python", *sys.argv]), "hardware": hardware_label("cpu"), "other": args.other,
            "batch": args.batch, "repeats": args.repeats, "torch": torch.__version__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
