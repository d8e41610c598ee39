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

import sys
from pathlib import Path

import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import machine_description, run_layer_benchmark, write_json  # noqa: E402

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
    args, device, results = run_layer_benchmark(_layers, __doc__.split("\n")[0], argv)

    metrics = ["forward_ms", "train_step_ms", "forward_peak_mb", "train_step_peak_mb"]
    print(f"\n{machine_description(device)}")
    for shape_name, res in results.items():
        lay = {n: r for n, r in res["layers"].items() if "error" not in r}
        print(f"\n{shape_name}: batch {res['batch']}, {res['size']}x{res['size']}, {res['channels']} channels")
        print(f"{'metric':20s}" + "".join(f"{n:>13s}" for n in lay) + f"{'lean/unfold':>13s}"
              + f"{'lean/conv':>11s}{'gsa/conv':>10s}")
        for m in metrics:
            row = "".join(f"{lay[n][m]:13.1f}" for n in lay)
            conv = max(lay["conv3x3"][m], 1e-9)
            print(f"{m:20s}{row}{lay['sasa_lean'][m] / max(lay['sasa_unfold'][m], 1e-9):13.2f}"
                  f"{lay['sasa_lean'][m] / conv:11.2f}{lay['gsa'][m] / conv:10.2f}")

    common = {"device": str(device), "machine": machine_description(device), "repeats": args.repeats,
              "command": args.command}
    for family, names in (("sasa", ("sasa_lean", "sasa_unfold", "conv3x3")), ("gsa", ("gsa", "conv3x3"))):
        payload = dict(common, shapes={s: {**{k: v for k, v in r.items() if k != "layers"},
                                           "layers": {n: r["layers"][n] for n in names}}
                                       for s, r in results.items()})
        write_json(RESULTS / f"{family}_ops.json", payload)


if __name__ == "__main__":
    main()
