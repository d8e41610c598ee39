"""How close each zoo family's attack step comes to the machine: images/s and achieved FLOP/s as a
fraction of the one-thread fp32 matmul rate, measured in the same run and process.

The attack step is what PGD, APGD and FAB repeat: a forward pass and the input gradient of a summed
cross-entropy through the attack-time model copy (:func:`robust_attn.attacks.fast_model.attack_model`:
batch norm folded, parameters frozen, the iterate channels-last), as
:func:`~robust_attn.attacks.targeted_pgd.native_pgd` runs it. FLOPs are ``2 x`` the multiply-adds of the convolutions and matmuls of one forward pass
(:class:`torch.utils.flop_counter.FlopCounterMode`, on the layers' reference paths, whose einsums and
unfolds the counter sees) and two passes per step (forward and input gradient), the same count for
every path of a family, so the fraction is useful work per second over the matmul rate.

Shapes: the CIFAR-10 zoo's (trained weights, width 0.25, stem_downsample 2, 32 px; batch 64) and
224 px (the ImageNet layout at width 0.25, random weights; ``--batch-224``). Variants (``--variants``)
are ways of computing the attack step (:data:`VARIANTS`: the default path, the eval model as it is,
``torch.compile`` of the default, bf16 autocast, which is not the same function); each family's
variants are timed interleaved, so machine drift moves them alike; the first step (compilation
included) is timed apart. Times are process CPU time on one thread (steadier than wall time when
other jobs share the cores; wall time is recorded too). The matmul rate is measured
before and after the families; both are printed, and the fraction uses the larger.

    python benchmarks/bench_efficiency.py                      # CIFAR shape and 224 px, every family
    python benchmarks/bench_efficiency.py --sizes 32 --families resnet26,sasa_resnet26 --repeats 2
    python benchmarks/bench_efficiency.py --sizes 32 --variants default --profile   # top operators too
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import machine_description, write_json  # noqa: E402

import robust_attn  # noqa: E402
from robust_attn.attacks.fast_model import attack_model  # noqa: E402
from robust_attn.layers.paths import set_attention_path  # noqa: E402
from robust_attn.models.wrapper import NormalizedModel  # noqa: E402
from robust_attn.models.manifest import load_model  # noqa: E402

FAMILIES = ("resnet26", "san10_pairwise", "san10_patchwise", "sasa_resnet26", "gsa_resnet26", "aa_resnet26",
            "ea_resnet26")
CIFAR_MEAN, CIFAR_STD = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]


def cpu_time_ms(fn: Callable[[], object]) -> tuple[float, float]:
    """``(process CPU ms, wall ms)`` of one call of ``fn``."""
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    return (time.process_time() - start_cpu) * 1e3, (time.perf_counter() - start) * 1e3


def matmul_gflops(n: int = 1024, repeats: int = 10, dtype: torch.dtype = torch.float32) -> float:
    """The best of ``repeats`` ``n x n`` matmuls, in GFLOP/s (``2 n^3`` per product), CPU time."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)
    best = min(cpu_time_ms(lambda: torch.mm(a, b, out=out))[0] for _ in range(repeats))
    return 2 * n ** 3 / (best / 1e3) / 1e9


def forward_flops(model: nn.Module, x: torch.Tensor) -> int:
    """``2 x`` multiply-adds of one eval forward of ``model`` on ``x``, on the reference paths."""
    set_attention_path(model, "reference")
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x)
    finally:
        set_attention_path(model, "lean")
    return counter.get_total_flops()


def attack_step(model: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Forward and input gradient of the summed cross-entropy, as one PGD step computes them."""
    def step() -> torch.Tensor:
        xg = x.detach().requires_grad_(True)
        loss = F.cross_entropy(model(xg), labels, reduction="sum")
        return torch.autograd.grad(loss, xg)[0]
    return step


def _default(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """What native PGD attacks today: the folded copy (lean attention paths), channels-last input."""
    return attack_model(model, x[:4])


class _Bf16Autocast(nn.Module):
    """``module`` under CPU bf16 autocast, logits back in float32 (not the same function: rounding
    of bf16's 8-bit mantissa; the benchmark records how many input-gradient signs differ)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.module(x).float()


def _as_is(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """The eval model itself, contiguous input: what the attacks query with ``attack_copy="off"``."""
    return model


def _bf16(model: nn.Module, x: torch.Tensor) -> nn.Module:
    return _Bf16Autocast(attack_model(model, x[:4]))


def _compiled(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """``torch.compile`` (Inductor, static shapes) of the attack-time copy; compiled on the first step."""
    return torch.compile(attack_model(model, x[:4]), dynamic=False)


#: name -> (build the attacked module from the eval model and an example batch, description)
VARIANTS: dict[str, tuple[Callable[[nn.Module, torch.Tensor], nn.Module], str]] = {
    "default": (_default, "attack_model copy (batch norm folded), lean attention, channels-last, fp32"),
    "as_is": (_as_is, "the eval model itself (batch norm unfolded), lean attention, contiguous input, fp32"),
    "compiled": (_compiled, "torch.compile(default copy, dynamic=False), Inductor C++; fp32"),
    "bf16": (_bf16, "default copy under torch.autocast('cpu', bfloat16); not the same function"),
}


def build(name: str, size: int, batch: int) -> tuple[nn.Module, torch.Tensor]:
    """The eval model and a batch of images in [0, 1]: the trained CIFAR-10 zoo model at 32 px,
    the ImageNet layout at width 0.25 with random weights otherwise."""
    torch.manual_seed(0)
    if size == 32:
        model = load_model(name, "cifar10")
    else:
        net = robust_attn.create_model(name, num_classes=10, resolution="imagenet", width=0.25, image_size=size)
        model = NormalizedModel(net, CIFAR_MEAN, CIFAR_STD)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(0))
    return model, x


def top_ops(step: Callable[[], object], count: int = 10) -> list[dict]:
    """The ``count`` operators of one step with the most self CPU time (:mod:`torch.profiler`);
    a custom autograd function's own time includes the compiled kernels it calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count,
             "share": e.self_cpu_time_total / total} for e in events[:count]]


def measure_family(name: str, size: int, batch: int, variants: list[str], repeats: int,
                   profile: bool = False) -> dict:
    model, x = build(name, size, batch)
    with torch.no_grad():
        labels = model(x).argmax(1)
    flops = 2 * forward_flops(model, x[:2]) * batch // 2     # linear in the batch
    xc = x.contiguous(memory_format=torch.channels_last)
    steps, logits, grads, first = {}, {}, {}, {}
    for v in variants:
        module = VARIANTS[v][0](model, x)
        steps[v] = attack_step(module, x if v == "as_is" else xc, labels)
        start = time.perf_counter()
        grads[v] = steps[v]()                                     # warm-up (and any compilation)
        first[v] = time.perf_counter() - start
        with torch.no_grad():
            logits[v] = module(x if v == "as_is" else xc)
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    wall: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            c, w = cpu_time_ms(steps[v])
            cpu[v].append(c)
            wall[v].append(w)
    row = {"family": name, "size": size, "batch": batch, "step_gflop": flops / 1e9, "variants": {}}
    if profile:
        row["profile_" + variants[0]] = top_ops(steps[variants[0]])
    for v in variants:
        c, w = statistics.median(cpu[v]), statistics.median(wall[v])
        row["variants"][v] = {"cpu_ms": c, "wall_ms": w, "images_per_s": batch / c * 1e3,
                              "gflops": flops / c / 1e6,
                              "first_step_wall_s": first[v],
                              "max_logit_diff_vs_first": (logits[v] - logits[variants[0]]).abs().max().item(),
                              "grad_signs_differing_vs_first":
                                  int((grads[v].sign() != grads[variants[0]].sign()).sum()),
                              "grad_elements": grads[v].numel()}
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 224])
    parser.add_argument("--batch", type=int, default=64, help="batch at 32 px (the zoo's attack batch)")
    parser.add_argument("--batch-224", type=int, default=4, help="batch at 224 px")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="at 32 px (the first is the baseline)")
    parser.add_argument("--variants-224", default="default,bf16", help="at 224 px (compiling there is slow)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="record the top operators of the first variant's step")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "efficiency_cpu.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    variants = args.variants.split(",")
    variants_224 = args.variants_224.split(",")
    unknown = sorted(set(variants + variants_224) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"{machine_description()}, 1 thread; load average {' '.join(load)} (other jobs share the cores: "
          f"compare ratios within this run)")
    peak_before = matmul_gflops()
    print(f"fp32 matmul 1024^3, one thread: {peak_before:.1f} GFLOP/s")
    rows = []
    for size in args.sizes:
        batch = args.batch if size == 32 else args.batch_224
        for name in args.families.split(","):
            row = measure_family(name, size, batch, variants if size == 32 else variants_224, args.repeats,
                                 args.profile)
            rows.append(row)
            cells = "  ".join(f"{v} {r['images_per_s']:8.1f} img/s {r['gflops']:6.1f} GFLOP/s"
                              for v, r in row["variants"].items())
            print(f"{size:>4}px b{batch:<3} {name:<16} {row['step_gflop']:7.2f} GFLOP/step  {cells}", flush=True)
            for op in row.get("profile_" + variants[0], []):
                print(f"{'':>12}{op['share'] * 100:5.1f}%  {op['self_cpu_ms']:8.1f} ms  {op['calls']:5d} calls  "
                      f"{op['op']}")
    peak_after = matmul_gflops()
    peak = max(peak_before, peak_after)
    print(f"fp32 matmul again: {peak_after:.1f} GFLOP/s; fractions below use {peak:.1f}")
    resnet = {row["size"]: row["variants"] for row in rows if row["family"] == "resnet26"}
    for row in rows:
        names = list(row["variants"])
        if row["family"] == rows[0]["family"]:
            print(f"{'size':>4} {'family':<16}" + "".join(f"{v + ' %peak':>16}" for v in names)
                  + "".join(f"{v + ' vs ' + names[0]:>20}" for v in names[1:]) + f"{names[0] + ' vs resnet26':>22}")
        for r in row["variants"].values():
            r["fraction_of_matmul_peak"] = r["gflops"] / peak
        base = row["variants"][names[0]]["images_per_s"]
        cells = "".join(f"{r['fraction_of_matmul_peak'] * 100:15.1f}%" for r in row["variants"].values())
        ratios = "".join(f"{row['variants'][v]['images_per_s'] / base:19.2f}x" for v in names[1:])
        vs_resnet = (f"{base / resnet[row['size']][names[0]]['images_per_s']:21.2f}x" if row["size"] in resnet
                     else "")
        print(f"{row['size']:>4} {row['family']:<16}{cells}{ratios}{vs_resnet}")
    write_json(args.out, {
        "benchmark": "attack step (forward + input gradient) efficiency per family",
        "machine": machine_description(), "threads": 1, "load_average_at_start": load,
        "matmul_gflops": {"before": peak_before, "after": peak_after, "used": peak},
        "flops": "2 x multiply-adds of one forward (FlopCounterMode, reference attention paths) x 2 passes",
        "timing": f"median of {args.repeats} interleaved process-CPU-time runs per variant",
        "variants": {v: VARIANTS[v][1] for v in variants},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
