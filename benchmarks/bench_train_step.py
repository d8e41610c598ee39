"""Throughput and peak memory of one training step (forward, backward, SGD update) for ResNet-26
and one depth-26 member of every registered family, side by side with their ratios to ResNet-26.

    python benchmarks/bench_train_step.py                         # CPU, cifar 32x32, batch 32, width 0.25
    python benchmarks/bench_train_step.py --width 1.0
    python benchmarks/bench_train_step.py --device cuda --amp bf16 --resolution imagenet --batch 64 --width 1

Writes benchmarks/results/train_step.json (``--out``). A step is what the trainer does per batch:
autocast forward, cross-entropy, backward, SGD with momentum. The models' steps are timed in
turns (one step of each per round, median over ``--repeats`` rounds). Peak memory is measured by
``benchmarks/_measure.py`` (CUDA allocator peak, or the growth of the peak RSS on CPU, there in a
fresh process per model: :func:`model_peak_memory`).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import (json_from_fresh_process, machine_description, peak_memory_mb,  # noqa: E402
                      time_interleaved_ms, write_json)  # noqa: E402

from robust_attn.models.registry import create_model, list_models, model_info  # noqa: E402


def default_models() -> list[str]:
    """resnet26 plus the depth-26 member of each other family (SAN has none: SAN10, both relations)."""
    chosen = ["resnet26"]
    for name in list_models():
        family = model_info(name).family
        if family == "resnet":
            continue
        if "26" in name or (family == "san" and name.startswith("san10")):
            chosen.append(name)
    return chosen


def make_step(name: str, args, device: torch.device):
    torch.manual_seed(0)
    kwargs = {"width": args.width}
    if args.stem_downsample:
        kwargs["stem_downsample"] = args.stem_downsample
    model = create_model(name, args.num_classes, args.resolution, **kwargs).to(device)
    size = 224 if args.resolution == "imagenet" else 32
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    images = torch.rand(args.batch, 3, size, size, device=device)
    if args.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, args.num_classes, (args.batch,), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = criterion(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    params = sum(p.numel() for p in model.parameters())
    return step, params


def model_peak_memory(name: str, args, device: torch.device, step) -> float:
    """Peak memory (MiB) of one train step of ``name``. On CPU in a fresh process (this script with
    ``--memory-of``) started with glibc's mmap threshold at 64 KiB, so neither another model's
    heap nor this one's history can hide or add memory (see ``_measure.peak_memory_mb``)."""
    if device.type == "cuda":
        return peak_memory_mb(step, device)
    argv = [str(Path(__file__).resolve()), "--device", args.device, "--amp", args.amp,
            "--resolution", args.resolution, "--batch", str(args.batch), "--width", str(args.width),
            "--num-classes", str(args.num_classes), "--memory-of", name]
    if args.stem_downsample:
        argv += ["--stem-downsample", str(args.stem_downsample)]
    if args.channels_last:
        argv.append("--channels-last")
    return json_from_fresh_process(argv)["peak_memory_MiB"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none")
    p.add_argument("--resolution", choices=["cifar", "imagenet"], default="cifar")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--stem-downsample", type=int, choices=[1, 2, 4], default=None)
    p.add_argument("--num-classes", type=int, default=100)
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--models", nargs="*", default=None, help="default: resnet26 + one depth-26 member per family")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)  # internal: one model's CPU peak
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "train_step.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.memory_of:
        step, _ = make_step(args.memory_of, args, device)
        step()
        print(json.dumps({"peak_memory_MiB": peak_memory_mb(step, device)}))
        return 0
    models = args.models or default_models()
    if "resnet26" not in models:
        models = ["resnet26", *models]

    steps = {}
    for name in models:
        steps[name] = make_step(name, args, device)
    # Timed in turns (one step of each model per round), so machine drift cannot skew the ratios.
    ms = time_interleaved_ms({name: step for name, (step, _) in steps.items()}, device, repeats=args.repeats)
    rows = []
    for name, (step, params) in steps.items():
        mem = None if args.no_memory else model_peak_memory(name, args, device, step)
        rows.append({"model": name, "params_M": params / 1e6, "ms_per_step": ms[name],
                     "images_per_s": args.batch / ms[name] * 1e3, "peak_memory_MiB": mem})
        print(f"  {name}: {ms[name]:.1f} ms/step", file=sys.stderr, flush=True)

    base = rows[0]
    for row in rows:
        row["slowdown_vs_resnet26"] = row["ms_per_step"] / base["ms_per_step"]
        row["memory_vs_resnet26"] = (row["peak_memory_MiB"] / base["peak_memory_MiB"]
                                     if row["peak_memory_MiB"] and base["peak_memory_MiB"] else None)
    print(f"train step: {args.resolution}, batch {args.batch}, width {args.width}, amp {args.amp}, "
          f"{machine_description(device)}")
    header = f"{'model':<18} {'params':>8} {'ms/step':>9} {'img/s':>8} {'x r26':>6} {'peak MiB':>9} {'x r26':>6}"
    print(header)
    print("-" * len(header))
    for r in rows:
        mem = f"{r['peak_memory_MiB']:9.1f}" if r["peak_memory_MiB"] is not None else f"{'-':>9}"
        mratio = f"{r['memory_vs_resnet26']:6.2f}" if r["memory_vs_resnet26"] is not None else f"{'-':>6}"
        print(f"{r['model']:<18} {r['params_M']:7.2f}M {r['ms_per_step']:9.1f} {r['images_per_s']:8.1f} "
              f"{r['slowdown_vs_resnet26']:6.2f} {mem} {mratio}")
    write_json(args.out, {"benchmark": "train_step", "machine": machine_description(device),
                          "settings": {k: v for k, v in vars(args).items() if k not in ("out", "models")},
                          "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
