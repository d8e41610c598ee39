"""Images/s of targeted PGD (SAN Table 10, {eps, step, n} = {8, 2, 4}) by backend, on one model.

Variants: native (the default fast mode: batch norm folded into the convolutions and
channels-last layout; agrees with the libraries up to floating-point ties), its two parts
alone (native_fold_bn, native_channels_last), native_exact (``exact=True``, bit-identical to
the libraries), torchattacks and foolbox, all on one model (``--model``, default resnet26; CIFAR
layout, 32x32 input) wrapped in NormalizedModel, eval mode, the same images and targets. Each variant is timed in
``--rounds`` interleaved rounds (the machine may be shared); the fastest round's median is
kept, in wall time and, on CPU, in process CPU time (steadier when other processes compete
for the cores). The one-time cost of building the folded copy (cached per model afterwards)
is reported as ``prepare_ms``. Also records whether each variant's adversarial images match
the exact native ones.

    python benchmarks/bench_pgd.py                         # CPU, widths 0.25 and 1.0, batch 32
    python benchmarks/bench_pgd.py --device cuda --widths 1.0 --batch 128
    python benchmarks/bench_pgd.py --model san10_pairwise --widths 0.25 --batch 16 --out /tmp/pgd_san.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import machine_description, time_ms, write_json  # noqa: E402

import robust_attn  # noqa: E402
from robust_attn.attacks import PGDConfig, draw_targets, targeted_pgd  # noqa: E402
from robust_attn.attacks.fast_model import attack_model, fold_batchnorm  # noqa: E402
from robust_attn.attacks.inputs import validate_attack_inputs  # noqa: E402
from robust_attn.attacks.targeted_pgd import native_pgd  # noqa: E402
from robust_attn.models.wrapper import NormalizedModel  # noqa: E402


def cpu_ms(fn, repeats: int) -> float:
    """Median process CPU time of ``fn()`` in ms: less sensitive than wall time to other
    processes on a shared machine (CPU only; on CUDA it misses the GPU's time)."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) * 1e3)
    return statistics.median(times)


VARIANTS = {  # name -> (backend, native_pgd options or None for targeted_pgd's defaults)
    "native": ("native", None),
    "native_fold_bn": ("native", {"fold_bn": True, "channels_last": False}),
    "native_channels_last": ("native", {"fold_bn": False, "channels_last": True}),
    "native_exact": ("native", {"fold_bn": False, "channels_last": False}),
    "torchattacks": ("torchattacks", None),
    "foolbox": ("foolbox", None),
}


def bench_width(model_name: str, width: float, batch: int, config: PGDConfig, device: torch.device, repeats: int,
                rounds: int) -> dict:
    torch.manual_seed(0)
    net = robust_attn.create_model(model_name, num_classes=10, resolution="cifar", width=width)
    model = NormalizedModel(net, [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]).to(device).eval()
    images = torch.rand(batch, 3, 32, 32, device=device)
    with torch.no_grad():
        labels = model(images).argmax(1)
    targets = draw_targets(labels, 10, seed=0)

    def attack(name: str) -> torch.Tensor:
        backend, options = VARIANTS[name]
        if options is None:
            return targeted_pgd(model, images, targets, config, backend=backend)
        validate_attack_inputs(model, images, targets)  # as targeted_pgd does
        with torch.enable_grad():
            return native_pgd(model, images, targets, config, **options).detach()

    # One-time cost of the fast mode: fold a fresh copy and check it (what a cache miss costs).
    start, start_cpu = time.perf_counter(), time.process_time()
    fold_batchnorm(model)
    prepare = {"prepare_ms": (time.perf_counter() - start) * 1e3,
               "prepare_cpu_ms": (time.process_time() - start_cpu) * 1e3}
    attack_model(model, images[:4])

    advs = {name: attack(name) for name in VARIANTS}  # also a warm-up
    best = {name: float("inf") for name in VARIANTS}
    best_cpu = {name: float("inf") for name in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            best[name] = min(best[name], time_ms(lambda: attack(name), device, repeats=repeats, warmup=0))
            if device.type == "cpu":
                best_cpu[name] = min(best_cpu[name], cpu_ms(lambda: attack(name), repeats))
    with torch.no_grad():
        exact_pred = model(advs["native_exact"]).argmax(1)
        rows = {}
        for name, adv in advs.items():
            rows[name] = {
                "ms_per_batch": best[name],
                "images_per_s": batch / (best[name] / 1e3),
                "cpu_ms_per_batch": best_cpu[name] if device.type == "cpu" else None,
                "max_abs_diff_vs_exact": (adv - advs["native_exact"]).abs().max().item(),
                "same_pixels_as_exact": float(((adv - advs["native_exact"]).abs() <= 1e-6).float().mean()),
                "same_prediction_as_exact": int((model(adv).argmax(1) == exact_pred).sum()),
                "success_rate": float((model(adv).argmax(1) == targets).float().mean()),
            }
    base = rows["torchattacks"]["images_per_s"]
    for row in rows.values():
        row["speedup_vs_torchattacks"] = row["images_per_s"] / base
        if device.type == "cpu":
            row["cpu_speedup_vs_torchattacks"] = rows["torchattacks"]["cpu_ms_per_batch"] / row["cpu_ms_per_batch"]
    rows["native"].update(prepare)
    return {"width": width, "batch": batch, "params": sum(p.numel() for p in model.parameters()), "backends": rows}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="resnet26", help="a registered model name (cifar resolution)")
    parser.add_argument("--widths", type=float, nargs="+", default=[0.25, 1.0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "pgd.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    config = PGDConfig(8, 2, 4)

    results = []
    print(f"targeted PGD {config}, {args.model} (cifar, 32x32), batch {args.batch}, {machine_description(device)}")
    print(f"{'width':>5}  {'backend':<22}{'ms/batch':>10}{'img/s':>9}{'vs torchattacks':>17}"
          f"{'cpu ms':>9}{'cpu vs ta':>11}{'max|diff|':>11}{'same pred':>11}")
    print("(max|diff| and same pred: against native_exact, bit-identical to the libraries)")
    for width in args.widths:
        result = bench_width(args.model, width, args.batch, config, device, args.repeats, args.rounds)
        results.append(result)
        for name, row in result["backends"].items():
            print(f"{width:>5}  {name:<22}{row['ms_per_batch']:>10.1f}{row['images_per_s']:>9.1f}"
                  f"{row['speedup_vs_torchattacks']:>16.2f}x"
                  f"{row['cpu_ms_per_batch'] or float('nan'):>9.1f}{row.get('cpu_speedup_vs_torchattacks', float('nan')):>10.2f}x"
                  f"{row['max_abs_diff_vs_exact']:>11.2g}"
                  f"{row['same_prediction_as_exact']:>8}/{args.batch}")
        print(f"{'':>5}  one-time fold of the fast mode: {result['backends']['native']['prepare_ms']:.0f} ms")
    write_json(args.out, {
        "benchmark": "targeted PGD images/s by backend",
        "config": {"eps": config.eps, "step": config.step, "steps": config.steps, "random_start": config.random_start},
        "model": f"{args.model} cifar, NormalizedModel, eval, random init",
        "machine": machine_description(device),
        "device": str(device),
        "threads": args.threads,
        "timing": f"fastest of {args.rounds} interleaved rounds of the median of {args.repeats} runs, "
                  f"wall time (ms_per_batch, images_per_s) and, on CPU, process CPU time (cpu_ms_per_batch)",
        "results": results,
    })


if __name__ == "__main__":
    main()
