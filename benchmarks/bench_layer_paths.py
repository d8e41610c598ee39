"""Trained zoo models with their local-attention layers on the reference path (SAN: ``unfold``,
SASA: ``reference``) against the default memory-lean path, on one device, side by side: an
eval-mode forward (what Square costs) and an attack step (forward and input gradient, the
parameters frozen: what APGD and FAB cost), images/s and their ratio, peak memory on CUDA,
the largest logit difference between the paths, and the aten operators one forward dispatches.

Why: the lean paths loop over the footprint's offsets, a few operators per offset and layer. One
eval forward of san10_pairwise dispatches 7,456 aten operators on the PyTorch path a GPU runs
(counted on this CPU with ``ROBUST_ATTN_CPU_KERNELS=0``, batch 8; views included), against 654
for resnet26. On a lent H100, AutoAttack's Square ran san10_pairwise's 5,000 queries on its 306
robust CIFAR-10 images in about 250 s, 20 forwards a second, with the GPU 99% "busy" (README,
"The CIFAR-10 study"): what a launch-bound model looks like. The reference paths do the same
work in fewer, larger operators on the attention itself, at more memory. This script measures
which path is faster where (``robust_attn.layers.paths``; ``--attention-path`` of ``study`` and
``eval`` chooses). On this CPU the lean paths win (benchmarks/results/layer_paths_cpu.json); on a
lent H200 (batch 512, benchmarks/results/layer_paths_cuda.json) the reference paths' attack step
is 2.0x, 1.5x and 10.8x faster (san10_pairwise, san10_patchwise, sasa_resnet26) at 3-8x the peak
memory, their eval forward 0.44x, 0.47x and 5.0x:

    python benchmarks/bench_layer_paths.py --device cuda --batch 512
    python benchmarks/bench_layer_paths.py --batch 16 --repeats 2      # CPU
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import machine_description, time_interleaved_ms, write_json  # noqa: E402

from robust_attn.layers.paths import set_attention_path as set_path  # noqa: E402
from robust_attn.models.manifest import load_model  # noqa: E402

MODELS = ("san10_pairwise", "san10_patchwise", "sasa_resnet26")


def operator_count(model: torch.nn.Module, x: torch.Tensor) -> int:
    """aten operators one eval forward dispatches (views and the dispatcher's inner calls included:
    a convolution counts 5), counted by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        model(x)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def measure(name: str, dataset: str, batch: int, device: torch.device, repeats: int) -> dict:
    model = load_model(name, dataset, device=str(device)).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.rand(batch, 3, 32, 32, generator=torch.Generator().manual_seed(0)).to(device)
    labels = torch.zeros(batch, dtype=torch.long, device=device)

    def forward():
        with torch.no_grad():
            return model(x)

    def attack_step():
        xg = x.clone().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(model(xg), labels)
        return torch.autograd.grad(loss, xg)[0]

    row = {"model": name, "batch": batch, "layers": set_path(model, "lean")}
    logits = {}
    for path in ("lean", "reference"):
        set_path(model, path)
        logits[path] = forward()
        row[f"{path}_ops_per_forward"] = operator_count(model, x[:2])
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = time_interleaved_ms({"forward": forward, "attack_step": attack_step}, device, repeats=repeats)
        if device.type == "cuda":
            row[f"{path}_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
        for what, ms in times.items():
            row[f"{path}_{what}_img_s"] = batch / ms * 1e3
    set_path(model, "lean")
    row["max_logit_diff"] = (logits["lean"] - logits["reference"]).abs().max().item()
    for what in ("forward", "attack_step"):
        row[f"reference_vs_lean_{what}"] = row[f"reference_{what}_img_s"] / row[f"lean_{what}_img_s"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dataset", default="cifar10", help="the zoo's trained weights for this dataset")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON file (default benchmarks/results/layer_paths_<device>.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    print("| model | ops/forward lean / reference | forward img/s lean / reference (ratio) "
          "| attack step img/s lean / reference (ratio) | max logit diff |")
    print("|---|--:|--:|--:|--:|")
    for name in args.models.split(","):
        r = measure(name, args.dataset, args.batch, device, args.repeats)
        rows.append(r)
        print(f"| {name} | {r['lean_ops_per_forward']} / {r['reference_ops_per_forward']} "
              f"| {r['lean_forward_img_s']:.1f} / {r['reference_forward_img_s']:.1f} "
              f"({r['reference_vs_lean_forward']:.2f}x) "
              f"| {r['lean_attack_step_img_s']:.1f} / {r['reference_attack_step_img_s']:.1f} "
              f"({r['reference_vs_lean_attack_step']:.2f}x) | {r['max_logit_diff']:.1e} |", flush=True)
    out = args.out or Path(__file__).resolve().parent / "results" / f"layer_paths_{device.type}.json"
    write_json(out, {"machine": machine_description(device), "settings": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
