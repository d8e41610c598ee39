"""How close each zoo family's attack step comes to the machine: images/s and achieved FLOP/s as a
fraction of the matmul rate, measured in the same run and process, on a CPU (one thread) or on CUDA.

The attack step is what PGD, APGD and FAB repeat: a forward pass and the input gradient of a summed
cross-entropy (``_attack_variants.attack_step``), as :func:`~robust_attn.attacks.targeted_pgd.native_pgd`
runs it. FLOPs are ``2 x`` the multiply-adds of the convolutions and matmuls of one forward pass
(:class:`torch.utils.flop_counter.FlopCounterMode`, on the layers' reference paths, whose einsums and
unfolds the counter sees) and two passes per step (forward and input gradient), the same count for
every path of a family, so the fraction is useful work per second over the matmul rate.

Shapes: the CIFAR-10 zoo's (trained weights, width 0.25, stem_downsample 2, 32 px; batch 64) and
224 px (any size but 32: the ImageNet layout with random weights, ``--width-224`` (0.25) and
``--batch-224``). Variants (``--variants``, ``--variants-224``) are ways of computing the attack step
(``_attack_variants.VARIANTS``: ``default`` is what the attacks query on the device; the attention
layers' lean and reference paths, the attack copy, ``torch.compile``, bf16 autocast, which is not the
same function, and on CUDA a CUDA graph of the whole step); each records what ran (attack copy,
attention path). Each family's variants are timed interleaved, so machine drift moves them alike; the
first step (compilation or capture included) is timed apart; a variant that fails (out of memory, a
compiler error) is recorded with its error and the others go on. Times: on a CPU the process's CPU
time on one thread (steadier than wall time when other jobs share the cores; wall time is recorded
too), on CUDA the wall time between synchronizations (``_measure.step_time_ms``). The matmul rate
(``torch.mm``, 1024^3 on a CPU, 8192^3 on CUDA) is measured before and after the families and the
fraction uses the larger; on CUDA in fp32 with TF32 off (``allow_tf32`` set for the measurement and
restored), in bf16 and with TF32, all recorded (the step itself runs with torch's TF32 settings,
recorded too: cuDNN's convolutions use TF32 by default). Each row is written to ``--out`` as it is
measured (``"complete": false`` until the end), so a run stopped by a time limit keeps its rows.

    python benchmarks/bench_efficiency.py                      # CIFAR shape and 224 px, every family
    python benchmarks/bench_efficiency.py --sizes 32 --families resnet26,sasa_resnet26 --repeats 2
    python benchmarks/bench_efficiency.py --sizes 32 --variants default --profile   # top operators too
    python benchmarks/bench_efficiency.py --device cuda --sizes 32 --variants default,reference,bf16 --repeats 10
    python benchmarks/bench_efficiency.py --device cuda --sizes 224 --width-224 1.0 --batch-224 64 \
        --families resnet26,san10_pairwise,san10_patchwise --variants-224 lean,reference,compiled

``--dry-run`` checks the options (CUDA need not be present) and prints what would be measured;
``benchmarks/gpu_session.sh`` runs the GPU measurements in one go.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _attack_variants import VARIANTS, describe, make_step, variants_for  # noqa: E402
from _measure import machine_description, matmul_tf32, step_time_ms, write_json  # noqa: E402

import robust_attn  # noqa: E402
from robust_attn.layers.paths import set_attention_path  # noqa: E402
from robust_attn.models.manifest import load_model  # noqa: E402
from robust_attn.models.wrapper import NormalizedModel  # noqa: E402

__all__ = ["FAMILIES", "build", "matmul_gflops", "forward_flops", "measure_family", "main"]

FAMILIES = ("resnet26", "san10_pairwise", "san10_patchwise", "sasa_resnet26", "gsa_resnet26", "aa_resnet26",
            "ea_resnet26")
CIFAR_MEAN, CIFAR_STD = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]


def matmul_gflops(device: torch.device | str = "cpu", n: int | None = None, repeats: int = 10,
                  dtype: torch.dtype = torch.float32) -> float:
    """The best of ``repeats`` ``n x n`` matmuls on ``device``, in GFLOP/s (``2 n^3`` per product),
    timed by :func:`step_time_ms` (``n``: 1024 on a CPU, 8192 on CUDA)."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    out = torch.empty(n, n, dtype=dtype, device=device)
    torch.mm(a, b, out=out)
    best = min(step_time_ms(lambda: torch.mm(a, b, out=out), device)[0] for _ in range(repeats))
    return 2 * n ** 3 / (best / 1e3) / 1e9


def matmul_peaks(device: torch.device) -> dict[str, float]:
    """The matmul rates of the run: fp32 on a CPU; on CUDA fp32 with TF32 off, fp32 with TF32 on,
    and bf16 (GFLOP/s)."""
    if device.type != "cuda":
        return {"fp32": matmul_gflops(device)}
    with matmul_tf32(False):
        fp32 = matmul_gflops(device)
    with matmul_tf32(True):
        tf32 = matmul_gflops(device)
    return {"fp32": fp32, "tf32": tf32, "bf16": matmul_gflops(device, dtype=torch.bfloat16)}


def forward_flops(model: nn.Module, x: torch.Tensor) -> int:
    """``2 x`` multiply-adds of one eval forward of ``model`` on ``x``, on the reference paths."""
    set_attention_path(model, "reference")
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x)
    finally:
        set_attention_path(model, "lean")
    return counter.get_total_flops()


def build(name: str, size: int, batch: int, width: float = 0.25,
          device: torch.device | str = "cpu") -> tuple[nn.Module, torch.Tensor]:
    """The eval model and a batch of images in [0, 1] on ``device`` (drawn on the CPU, so every device
    gets the same images): the trained CIFAR-10 zoo model at 32 px, the ImageNet layout at ``width``
    with random weights otherwise."""
    torch.manual_seed(0)
    if size == 32:
        model = load_model(name, "cifar10", device=str(device))
    else:
        net = robust_attn.create_model(name, num_classes=10, resolution="imagenet", width=width, image_size=size)
        model = NormalizedModel(net, CIFAR_MEAN, CIFAR_STD).to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(0)).to(device)
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


def _error(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:500]


def measure_family(name: str, size: int, batch: int, variants: list[str], repeats: int,
                   profile: bool = False, width: float = 0.25, device: torch.device | str = "cpu") -> dict:
    """One row: every variant's attack step of family ``name``, timed interleaved; a variant that
    fails to build or to take a step is recorded with its error."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    model, x = build(name, size, batch, width, device)
    with torch.no_grad():
        labels = model(x).argmax(1)
    flops = 2 * forward_flops(model, x[:2]) * batch // 2     # linear in the batch
    steps, logits, grads, first, ran, errors, peak_mb = {}, {}, {}, {}, {}, {}, {}
    for v in variants:
        try:
            attacked = VARIANTS[v].build(model, x)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            start, keep = time.perf_counter(), {}
            step = make_step(attacked, x, labels, keep)
            grads[v] = step()                                     # warm-up (and any compilation or capture)
            if cuda:
                torch.cuda.synchronize(device)
                peak_mb[v] = torch.cuda.max_memory_allocated(device) / 2 ** 20
            first[v] = time.perf_counter() - start
            logits[v] = keep["logits"]
            steps[v], ran[v] = step, describe(attacked)
        except Exception as err:    # out of memory, a compiler's or a capture's error: record it, go on
            errors[v] = _error(err)
            grads.pop(v, None)
            if cuda:
                torch.cuda.empty_cache()
    timed = list(steps)
    basis: dict[str, list[float]] = {v: [] for v in timed}
    wall: dict[str, list[float]] = {v: [] for v in timed}
    for _ in range(repeats):
        for v in list(timed):
            try:
                ms, w = step_time_ms(steps[v], device)
            except Exception as err:    # e.g. out of memory beside another variant's CUDA graph
                errors[v] = _error(err)
                timed.remove(v)
                continue
            basis[v].append(ms)
            wall[v].append(w)
    row = {"family": name, "size": size, "batch": batch, "step_gflop": flops / 1e9, "variants": {}}
    if size != 32:
        row["width"] = width
    if profile and timed:
        row["profile_" + timed[0]] = top_ops(steps[timed[0]])
    for v in variants:
        if v in errors:
            row["variants"][v] = {"error": errors[v]}
            continue
        ms, w = statistics.median(basis[v]), statistics.median(wall[v])
        cell = {"cpu_ms": ms} if not cuda else {}
        cell.update({"wall_ms": w, "images_per_s": batch / ms * 1e3, "gflops": flops / ms / 1e6,
                     "first_step_wall_s": first[v],
                     "max_logit_diff_vs_first": (logits[v] - logits[timed[0]]).abs().max().item(),
                     "grad_signs_differing_vs_first": int((grads[v].sign() != grads[timed[0]].sign()).sum()),
                     "grad_elements": grads[v].numel()})
        if cuda:
            cell["peak_mb"] = peak_mb[v]
        cell.update(ran[v])
        row["variants"][v] = cell
    return row


def add_fractions(rows: list[dict], peaks: dict[str, float]) -> None:
    """Each variant's share of the matmul rates (fp32; on CUDA bf16 too) and its images/s over
    resnet26's in the same variant and size."""
    resnet = {row["size"]: row["variants"] for row in rows if row["family"] == "resnet26"}
    for row in rows:
        for v, r in row["variants"].items():
            if "error" in r:
                continue
            r["fraction_of_matmul_peak"] = r["gflops"] / peaks["fp32"]
            if "bf16" in peaks:
                r["fraction_of_bf16_matmul_peak"] = r["gflops"] / peaks["bf16"]
            base = resnet.get(row["size"], {}).get(v, {})
            if "images_per_s" in base:
                r["vs_resnet26"] = r["images_per_s"] / base["images_per_s"]


def summary(rows: list[dict]) -> dict:
    """Per size and family: the fastest variant and its images/s over resnet26's fastest (the
    issue's GPU goal compares SAN10's attack step with ResNet-26's this way)."""
    out: dict[str, dict] = {}
    for row in rows:
        done = {v: r["images_per_s"] for v, r in row["variants"].items() if "images_per_s" in r}
        if done:
            best = max(done, key=done.get)
            out.setdefault(str(row["size"]), {})[row["family"]] = {"best_variant": best, "images_per_s": done[best]}
    for families in out.values():
        if "resnet26" in families:
            for cell in families.values():
                cell["best_vs_resnet26_best"] = cell["images_per_s"] / families["resnet26"]["images_per_s"]
    return out


def print_table(rows: list[dict]) -> None:
    resnet = {row["size"]: row["variants"] for row in rows if row["family"] == "resnet26"}
    for row in rows:
        names = list(row["variants"])
        widths = {v: max(20, len(f" {v} vs {names[0]}")) for v in names[1:]}
        if row["family"] == rows[0]["family"]:
            print(f"{'size':>4} {'family':<16}" + "".join(f"{v + ' %peak':>16}" for v in names)
                  + "".join(f"{v + ' vs ' + names[0]:>{widths[v]}}" for v in names[1:])
                  + f"{names[0] + ' vs resnet26':>22}")
        base = row["variants"][names[0]].get("images_per_s")
        cells = "".join(f"{r['fraction_of_matmul_peak'] * 100:15.1f}%" if "error" not in r else f"{'failed':>16}"
                        for r in row["variants"].values())
        ratios = "".join(f"{row['variants'][v]['images_per_s'] / base:{widths[v] - 1}.2f}x"
                         if base and "images_per_s" in row["variants"][v] else f"{'-':>{widths[v]}}"
                         for v in names[1:])
        resnet_base = resnet.get(row["size"], {}).get(names[0], {}).get("images_per_s")
        vs_resnet = f"{base / resnet_base:21.2f}x" if base and resnet_base else ""
        print(f"{row['size']:>4} {row['family']:<16}{cells}{ratios}{vs_resnet}")


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Errors that name the fix, before anything is measured (all ``--dry-run`` does)."""
    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    runnable = variants_for(device)
    for option, names in (("--variants", args.variants), ("--variants-224", args.variants_224)):
        unknown = sorted(set(names.split(",")) - set(VARIANTS))
        if unknown:
            parser.error(f"unknown variant(s) {unknown} in {option}; choose from {', '.join(VARIANTS)}")
        elsewhere = sorted(set(names.split(",")) - set(runnable))
        if elsewhere:
            parser.error(f"variant(s) {elsewhere} in {option} do not run on {device.type}; "
                         f"there choose from {', '.join(runnable)}")
    unknown = sorted(set(args.families.split(",")) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    if any(s < 16 for s in args.sizes) or args.batch < 1 or args.batch_224 < 1 or args.repeats < 1:
        parser.error("sizes must be at least 16 px, batches and --repeats at least 1")
    if not 0 < args.width_224 <= 4:
        parser.error(f"--width-224 must be in (0, 4], got {args.width_224}")
    if device.type == "cuda" and not args.dry_run and not torch.cuda.is_available():
        parser.error("--device cuda given but CUDA is not available here; use --device cpu "
                     "(or --dry-run to check the options only)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (one thread, process CPU time) or cuda")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 224])
    parser.add_argument("--batch", type=int, default=64, help="batch at 32 px (the zoo's attack batch)")
    parser.add_argument("--batch-224", type=int, default=4, help="batch at the other sizes")
    parser.add_argument("--width-224", type=float, default=0.25, help="width of the ImageNet layout at the other sizes")
    parser.add_argument("--variants", default="default,as_is,compiled,bf16",
                        help=f"at 32 px (the first is the baseline); of {', '.join(VARIANTS)}")
    parser.add_argument("--variants-224", default="default,bf16", help="at the other sizes (compiling there is slow)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="record the top operators of the first variant's step")
    parser.add_argument("--dry-run", action="store_true", help="check the options, print the plan, measure nothing")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "efficiency_cpu.json"))
    args = parser.parse_args(argv)
    check_options(parser, args)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    variants = args.variants.split(",")
    variants_224 = args.variants_224.split(",")
    plan = [(size, args.batch if size == 32 else args.batch_224, name, variants if size == 32 else variants_224)
            for size in args.sizes for name in args.families.split(",")]
    if args.dry_run:
        for size, batch, name, vs in plan:
            width = "" if size == 32 else f" width {args.width_224}"
            print(f"would measure {name} at {size} px{width}, batch {batch}, on {device.type}: {','.join(vs)}")
        print(f"would write {args.out}")
        return 0
    torch.set_num_threads(1)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    if cuda:
        print(f"{machine_description(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
              f"host load average {' '.join(load)}")
    else:
        print(f"{machine_description()}, 1 thread; load average {' '.join(load)} (other jobs share the cores: "
              f"compare ratios within this run)")
    peaks_before = matmul_peaks(device)
    what = "fp32 matmul 8192^3 (TF32 off)" if cuda else "fp32 matmul 1024^3, one thread"
    print(f"{what}: {peaks_before['fp32']:.1f} GFLOP/s"
          + (f"; TF32 {peaks_before['tf32']:.1f}, bf16 {peaks_before['bf16']:.1f}" if cuda else ""))
    payload = {
        "benchmark": "attack step (forward + input gradient) efficiency per family",
        "device": device.type,
        "machine": machine_description(device), "threads": 1, "load_average_at_start": load,
        "matmul_gflops": {"before": peaks_before["fp32"], "after": None, "used": peaks_before["fp32"]},
        "flops": "2 x multiply-adds of one forward (FlopCounterMode, reference attention paths) x 2 passes",
        "timing": (f"median of {args.repeats} interleaved wall-time runs per variant, synchronized before and after"
                   if cuda else f"median of {args.repeats} interleaved process-CPU-time runs per variant"),
        "variants": {v: VARIANTS[v].description for v in dict.fromkeys(variants + variants_224)},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "dry_run")},
        "rows": [],
        "complete": False,
    }
    if cuda:
        payload.update({"torch": torch.__version__, "cuda": torch.version.cuda,
                        "matmul_gflops_tf32": {"before": peaks_before["tf32"]},
                        "matmul_gflops_bf16": {"before": peaks_before["bf16"]},
                        "step_tf32": {"cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                                      "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32}})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = payload["rows"]
    for size, batch, name, vs in plan:
        row = measure_family(name, size, batch, vs, args.repeats, args.profile, args.width_224, device)
        rows.append(row)
        if cuda:    # the row's CUDA graphs and cached blocks go before the next family
            gc.collect()
            torch.cuda.empty_cache()
        add_fractions(rows, peaks_before)
        out.write_text(json.dumps(payload, indent=2) + "\n")     # what is measured so far
        cells = "  ".join(f"{v} {r['images_per_s']:8.1f} img/s {r['gflops']:6.1f} GFLOP/s" if "error" not in r
                          else f"{v} failed ({r['error']})" for v, r in row["variants"].items())
        print(f"{size:>4}px b{batch:<3} {name:<16} {row['step_gflop']:7.2f} GFLOP/step  {cells}", flush=True)
        for key in row:
            for op in row[key] if key.startswith("profile_") else ():
                print(f"{'':>12}{op['share'] * 100:5.1f}%  {op['self_cpu_ms']:8.1f} ms  {op['calls']:5d} calls  "
                      f"{op['op']}")
    peaks_after = matmul_peaks(device)
    peaks = {k: max(peaks_before[k], peaks_after[k]) for k in peaks_before}
    print(f"fp32 matmul again: {peaks_after['fp32']:.1f} GFLOP/s; fractions below use {peaks['fp32']:.1f}")
    add_fractions(rows, peaks)
    if rows:
        print_table(rows)
    payload["matmul_gflops"] = {"before": peaks_before["fp32"], "after": peaks_after["fp32"], "used": peaks["fp32"]}
    if cuda:
        for k in ("tf32", "bf16"):
            payload[f"matmul_gflops_{k}"] = {"before": peaks_before[k], "after": peaks_after[k], "used": peaks[k]}
    payload["summary"] = summary(rows)
    for size, families in payload["summary"].items():
        for family, cell in families.items():
            ratio = f", {cell['best_vs_resnet26_best']:.2f}x resnet26's best" if "best_vs_resnet26_best" in cell else ""
            print(f"SUMMARY {device.type} {size}px {family}: best {cell['best_variant']} "
                  f"{cell['images_per_s']:.1f} img/s{ratio}")
    payload["complete"] = True
    write_json(out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
