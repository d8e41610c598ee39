"""Time and peak memory of the AA and EA layers against the 3x3 convolution they stand beside.

For each stage shape (ImageNet stage 1: 56x56, CIFAR stage 1: 32x32; 64 channels) it measures
forward (no grad) and forward+backward of

* ``aa_lean``: :class:`AugmentedConv2d` (``impl="einsum"``: relative logits from a gathered
  ``(w, w, dkh)`` table, queries chunked to at most ``2**24`` logits at a time), full-resolution
  attention (no pooling), 8 heads, ``dk, dv = aa_dims(64, 0.2, 0.2, 8, 20) = (160, 16)``;
* ``aa_lean_ckpt``: the same with ``checkpoint=True`` (chunks recomputed in backward);
* ``aa_sdpa``: the same layer with ``impl="sdpa"`` (relative terms folded into the dot product);
* ``aa_naive``: the same layer with the relative logits of public implementations, which store
  every relative embedding ``r_ij`` in an ``(HW, HW, dkh)`` tensor (AA section 3.1.1, Shaw et al.);
* ``ea``: :class:`ExternalAttention` (S = 64, single head);
* ``conv3x3``: the bottleneck's 3x3 convolution;

prints the ratios and writes ``benchmarks/results/aa_ea_ops.json``. Not a test. Example
(small settings, CPU)::

    .venv/bin/python benchmarks/bench_aa_ea_ops.py --imagenet-batch 2 --cifar-batch 16 --repeats 2

``--device cuda`` runs the same on a GPU (peak memory from ``torch.cuda.max_memory_allocated``);
``--amp`` runs the layers under ``torch.autocast`` (bfloat16 on CPU, float16 on CUDA).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import machine_description, run_layer_benchmark, write_json  # noqa: E402

from robust_attn.layers.aa import AugmentedConv2d, aa_dims, relative_index  # noqa: E402
from robust_attn.layers.external_attention import ExternalAttention  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class NaiveRelativeAA(AugmentedConv2d):
    """Relative logits as public implementations compute them: an ``(HW, HW, dkh)`` table of
    ``r^W_{x_j - x_i} + r^H_{y_j - y_i}`` contracted with every query (O((HW)^2 dkh) memory)."""

    def _attend_einsum(self, q, k, v):
        n, nh, h, w, d = q.shape
        qf = q.reshape(n, nh, h * w, d)
        iy = relative_index(h, q.device)[:, None, :, None].expand(h, w, h, w).reshape(h * w, h * w)
        ix = relative_index(w, q.device)[None, :, None, :].expand(h, w, h, w).reshape(h * w, h * w)
        table = self.rel_h[iy] + self.rel_w[ix]                                  # (HW, HW, dkh)
        logits = qf @ k.transpose(-1, -2) + torch.einsum("nhid,ijd->nhij", qf, table.to(qf.dtype))
        return torch.softmax(logits, dim=-1).to(v.dtype) @ v


def _layers(channels: int, size: int) -> dict[str, nn.Module]:
    dk, dv = aa_dims(channels, 0.2, 0.2, 8, 20)
    aa = dict(dk=dk, dv=dv, heads=8, feature_size=size)
    return {
        "aa_lean": AugmentedConv2d(channels, channels, 3, 1, **aa),
        "aa_lean_ckpt": AugmentedConv2d(channels, channels, 3, 1, checkpoint=True, **aa),
        "aa_sdpa": AugmentedConv2d(channels, channels, 3, 1, impl="sdpa", **aa),
        "aa_naive": NaiveRelativeAA(channels, channels, 3, 1, chunk_elements=None, **aa),
        "ea": ExternalAttention(channels, slots=64),
        "conv3x3": nn.Conv2d(channels, channels, 3, padding=1, bias=False),
    }


def main(argv=None) -> None:
    args, device, results = run_layer_benchmark(_layers, __doc__.split("\n")[0], argv)

    metrics = ["forward_ms", "train_step_ms", "forward_peak_mb", "train_step_peak_mb"]
    print(f"\n{machine_description(device)}{' (autocast)' if args.amp else ''}")
    for shape_name, res in results.items():
        lay = {n: r for n, r in res["layers"].items() if "error" not in r}
        print(f"\n{shape_name}: batch {res['batch']}, {res['size']}x{res['size']}, {res['channels']} channels")
        print(f"{'metric':20s}" + "".join(f"{n:>13s}" for n in lay))
        for m in metrics:
            print(f"{m:20s}" + "".join(f"{lay[n][m]:13.1f}" for n in lay))
        ref = lay.get("conv3x3")
        for m in metrics:
            ratios = []
            if ref:
                ratios += [f"{n}/conv {lay[n][m] / max(ref[m], 1e-9):.2f}" for n in lay if n != "conv3x3"]
            if "aa_naive" in lay:
                ratios += [f"{n}/naive {lay[n][m] / max(lay['aa_naive'][m], 1e-9):.2f}"
                           for n in ("aa_lean", "aa_lean_ckpt", "aa_sdpa") if n in lay]
            print(f"  {m}: " + ", ".join(ratios))

    payload = {"device": str(device), "machine": machine_description(device), "repeats": args.repeats,
               "amp": args.amp,
               "command": args.command,
               "shapes": results}
    write_json(RESULTS / "aa_ea_ops.json", payload)


if __name__ == "__main__":
    main()
