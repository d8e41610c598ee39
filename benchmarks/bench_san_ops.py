"""Time and peak memory of the SAN operator: lean path vs unfold reference vs the 3x3 conv it replaces.

Shapes: an ImageNet stage (SAN stage 2: 256 channels in, 64 aggregated, 56x56, 7x7 footprint)
and a CIFAR stage (same channels at 32x32). The 3x3 conv is ResNet's 64 -> 64 conv at the same
map size. Forward is timed without autograd (inference); forward+backward in training mode.
Peak memory is forward+backward (see benchmarks/_measure.py for how it is measured).

    python benchmarks/bench_san_ops.py                       # CPU, small batches
    python benchmarks/bench_san_ops.py --device cuda --batch-imagenet 8 --batch-cifar 64
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

from _measure import json_from_fresh_process, machine_description, peak_memory_mb, time_ms, write_json  # noqa: E402

from robust_attn.layers.san import SelfAttention2d  # noqa: E402


def build(kind: str, attention: str, device) -> nn.Module:
    if kind == "conv3x3":
        return nn.Conv2d(64, 64, 3, padding=1, bias=False).to(device)
    return SelfAttention2d(256, attention=attention, footprint=7, implementation=kind).to(device)


def measure(module: nn.Module, in_channels: int, batch: int, size: int, device, repeats: int,
            memory: bool) -> dict:
    x = torch.randn(batch, in_channels, size, size, device=device)

    def forward():
        with torch.no_grad():
            module(x)

    def train_step():
        xg = x.detach().requires_grad_()
        module(xg).sum().backward()
        module.zero_grad(set_to_none=True)

    module.train()
    if memory:
        train_step()  # one-time costs (lazy library init, code pages) stay out of the measurement
        return {"peak_train_mb": peak_memory_mb(train_step, device)}
    return {"forward_ms": time_ms(forward, device, repeats=repeats),
            "train_step_ms": time_ms(train_step, device, repeats=repeats)}


def run_all(shapes: dict, device, repeats: int, memory: bool) -> dict:
    results = {}
    for shape_name, (batch, size) in shapes.items():
        for attention in ("pairwise", "patchwise"):
            row = {}
            for kind in ("lean", "unfold", "conv3x3"):
                torch.manual_seed(0)
                module = build(kind, attention, device)
                row[kind] = measure(module, 64 if kind == "conv3x3" else 256, batch, size, device, repeats, memory)
            results[f"{shape_name}/{attention}"] = {"batch": batch, "size": size, **row}
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-imagenet", type=int, default=2)
    parser.add_argument("--batch-cifar", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "san_ops.json"))
    parser.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes = {"imagenet_56x56": (args.batch_imagenet, 56), "cifar_32x32": (args.batch_cifar, 32)}
    if args.memory_only:
        print(json.dumps(run_all(shapes, device, args.repeats, memory=True)))
        return
    results = run_all(shapes, device, args.repeats, memory=False)
    passed = [a for a in (argv if argv is not None else sys.argv[1:])]
    memory = (json_from_fresh_process([__file__, *passed, "--memory-only"]) if device.type == "cpu"
              else run_all(shapes, device, args.repeats, memory=True))
    for key, row in results.items():
        for kind in ("lean", "unfold", "conv3x3"):
            row[kind].update(memory[key][kind])
        lean, unfold, conv = row["lean"], row["unfold"], row["conv3x3"]
        print(f"{key:32s} batch {row['batch']}")
        for metric in ("forward_ms", "train_step_ms", "peak_train_mb"):
            print(f"  {metric:14s} lean {lean[metric]:9.1f}  unfold {unfold[metric]:9.1f}  conv3x3 "
                  f"{conv[metric]:8.1f}  lean/unfold {lean[metric] / unfold[metric]:5.2f}  "
                  f"lean/conv {lean[metric] / max(conv[metric], 1e-9):6.1f}")
    write_json(args.out, {"machine": machine_description(device), "device": str(device),
                          "operator": "SelfAttention2d(256 -> 64, footprint 7); conv3x3 64 -> 64",
                          "results": results})


if __name__ == "__main__":
    main()
