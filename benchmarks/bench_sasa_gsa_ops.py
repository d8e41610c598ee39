"""Time and peak memory of the SASA and GSA layers against the 3x3 convolution they replace.

For each stage shape (ImageNet stage 1: 56x56, 64 channels; CIFAR stage 1: 32x32, 64 channels)
it measures forward (no grad) and forward+backward of

* ``sasa_lean``: :class:`SASAttention2d` with the streaming operator (7x7, 8 heads);
* ``sasa_unfold``: the same layer with the unfold reference operator;
* ``gsa``: :class:`GlobalSelfAttention2d` (8 heads, L = the map side);
* ``conv3x3``: the bottleneck's 3x3 convolution;

prints the ratios side by side and writes ``benchmarks/results/sasa_ops.json`` and
``benchmarks/results/gsa_ops.json``. Not a test. Example (small settings, CPU)::

    .venv/bin/python benchmarks/bench_sasa_gsa_ops.py --imagenet-batch 2 --cifar-batch 16 --repeats 3

``--device cuda`` runs the same on a GPU (peak memory from ``torch.cuda.max_memory_allocated``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import machine_description, measure_layer, write_json  # noqa: E402

from robust_attn.layers.gsa import GlobalSelfAttention2d  # noqa: E402
from robust_attn.layers.sasa import SASAttention2d  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _layers(channels: int, size: int) -> dict[str, nn.Module]:
    return {
        "sasa_lean": SASAttention2d(channels, channels, 7, 8, impl="lean"),
        "sasa_unfold": SASAttention2d(channels, channels, 7, 8, impl="reference"),
        "gsa": GlobalSelfAttention2d(channels, channels, feature_size=size, heads=8),
        "conv3x3": nn.Conv2d(channels, channels, 3, padding=1, bias=False),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--imagenet-batch", type=int, default=8, help="batch at 56x56 (default 8)")
    parser.add_argument("--cifar-batch", type=int, default=64, help="batch at 32x32 (default 64)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda given but CUDA is not available; use --device cpu")
    torch.manual_seed(0)

    shapes = {"imagenet_stage1": (args.imagenet_batch, 56), "cifar_stage1": (args.cifar_batch, 32)}
    results: dict[str, dict] = {}
    for shape_name, (batch, size) in shapes.items():
        x = torch.randn(batch, args.channels, size, size, device=device)
        results[shape_name] = {"batch": batch, "size": size, "channels": args.channels, "layers": {}}
        for name, layer in _layers(args.channels, size).items():
            layer.to(device).train()
            results[shape_name]["layers"][name] = measure_layer(layer, x, device, args.repeats)
            print(f"{shape_name} {name}: {results[shape_name]['layers'][name]}", flush=True)

    metrics = ["forward_ms", "train_step_ms", "forward_peak_mb", "train_step_peak_mb"]
    print(f"\n{machine_description(device)}")
    for shape_name, res in results.items():
        lay = res["layers"]
        print(f"\n{shape_name}: batch {res['batch']}, {res['size']}x{res['size']}, {res['channels']} channels")
        print(f"{'metric':20s}" + "".join(f"{n:>13s}" for n in lay) + f"{'lean/unfold':>13s}"
              + f"{'lean/conv':>11s}{'gsa/conv':>10s}")
        for m in metrics:
            row = "".join(f"{lay[n][m]:13.1f}" for n in lay)
            conv = max(lay["conv3x3"][m], 1e-9)
            print(f"{m:20s}{row}{lay['sasa_lean'][m] / max(lay['sasa_unfold'][m], 1e-9):13.2f}"
                  f"{lay['sasa_lean'][m] / conv:11.2f}{lay['gsa'][m] / conv:10.2f}")

    common = {"device": str(device), "machine": machine_description(device), "repeats": args.repeats,
              "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:]))}
    for family, names in (("sasa", ("sasa_lean", "sasa_unfold", "conv3x3")), ("gsa", ("gsa", "conv3x3"))):
        payload = dict(common, shapes={s: {**{k: v for k, v in r.items() if k != "layers"},
                                           "layers": {n: r["layers"][n] for n in names}}
                                       for s, r in results.items()})
        write_json(RESULTS / f"{family}_ops.json", payload)


if __name__ == "__main__":
    main()
