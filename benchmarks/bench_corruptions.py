"""Cost of making the common corruptions against the cost of evaluating a model on them.

A study makes the corrupted images once (:class:`robust_attn.shifts.cache.CorruptionCache`) and
evaluates every model on them; the goal is that making them for a 10,000-image CIFAR study costs
less than evaluating resnet26 (width 0.25, stem_downsample 2, CIFAR shape) on them. Both are
measured in one run, on the same ``--images`` CIFAR-10 test images (the copy embedded in the
package), one thread, in batches of ``--batch`` (the study's default 250):

* generation: :func:`robust_attn.shifts.corruptions.corrupt_batch` per corruption and severity,
  as the cache makes them (uint8 in, uint8 out);
* evaluation: resnet26's forward pass (eval mode, no gradients) on the same number of images,
  timed once beside every corruption (interleaved, so a drift of the shared machine's speed
  moves both alike); its median is the cost of evaluating one condition.

Times are process CPU time (steadier than wall time on a shared machine; one thread, so it is
the compute time) and wall time. The totals compare all corruptions x severities once
(generation) with one model evaluated on all of them; the 10,000-image figures scale the
per-image costs linearly.

    OMP_NUM_THREADS=1 python benchmarks/bench_corruptions.py                 # 1000 images, the 15 + 4
    OMP_NUM_THREADS=1 python benchmarks/bench_corruptions.py --images 250 --corruptions common
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

from _measure import machine_description, write_json  # noqa: E402

import robust_attn  # noqa: E402
from robust_attn.data import build_dataset, dataset_info  # noqa: E402
from robust_attn.shifts.cache import to_uint8  # noqa: E402
from robust_attn.shifts.corruptions import SEVERITIES, corrupt_batch, corruption_names  # noqa: E402
from robust_attn.shifts.corruptions.weather import frost_dir  # noqa: E402
from robust_attn.models.wrapper import NormalizedModel  # noqa: E402


def timed(fn) -> tuple[float, float]:
    """(process CPU seconds, wall seconds) of ``fn()``."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=1000, help="CIFAR-10 test images (default 1000)")
    parser.add_argument("--batch", type=int, default=250, help="images per batch (default 250, the study's)")
    parser.add_argument("--corruptions", default="all", help="common, extra, all or names (default all)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "corruptions.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = corruption_names(args.corruptions)
    try:
        frost_dir()
    except FileNotFoundError:
        if "frost" in names:
            print("frost left out: its photographs are not installed (pip install imagecorruptions)")
            names.remove("frost")
    dataset = build_dataset("cifar10", split="test", limit=args.images)
    clean = torch.stack([dataset[i][0] for i in range(len(dataset))])
    batches = [(to_uint8(clean[a:a + args.batch]), list(range(a, min(a + args.batch, len(clean)))))
               for a in range(0, len(clean), args.batch)]
    info = dataset_info("cifar10")
    torch.manual_seed(0)
    model = NormalizedModel(robust_attn.create_model("resnet26", num_classes=10, resolution="cifar", width=0.25,
                                                     stem_downsample=2), info.mean, info.std).eval()

    def evaluate():
        with torch.no_grad():
            for a in range(0, len(clean), args.batch):
                model(clean[a:a + args.batch])

    evaluate()   # warm-up
    n = len(clean)
    rows, evals = [], []
    print(f"{n} CIFAR-10 images, batches of {args.batch}, one thread ({machine_description()})")
    print(f"{'corruption':>18} | generation ms/image, severities 1-5 (CPU) | resnet26 eval ms/image (CPU, beside it)")
    for name in names:
        per_severity = []
        for severity in SEVERITIES:
            cpu, wall = timed(lambda: [corrupt_batch(b, name, severity, indices=i, seed=0) for b, i in batches])
            per_severity.append({"severity": severity, "cpu_s": cpu, "wall_s": wall})
        eval_cpu, eval_wall = timed(evaluate)
        evals.append({"cpu_s": eval_cpu, "wall_s": eval_wall})
        rows.append({"corruption": name, "severities": per_severity})
        print(f"{name:>18} | " + " ".join(f"{1e3 * s['cpu_s'] / n:6.2f}" for s in per_severity)
              + f" | {1e3 * eval_cpu / n:5.2f}")
    gen_cpu = sum(s["cpu_s"] for r in rows for s in r["severities"])
    gen_wall = sum(s["wall_s"] for r in rows for s in r["severities"])
    eval_cpu = statistics.median(e["cpu_s"] for e in evals)
    eval_wall = statistics.median(e["wall_s"] for e in evals)
    conditions = len(names) * len(SEVERITIES)
    summary = {
        "conditions": conditions,
        "generation_cpu_s": gen_cpu, "generation_wall_s": gen_wall,
        "evaluation_cpu_s": eval_cpu * conditions, "evaluation_wall_s": eval_wall * conditions,
        "generation_ms_per_image_condition": 1e3 * gen_cpu / (n * conditions),
        "evaluation_ms_per_image_condition": 1e3 * eval_cpu / n,
        "ratio_generation_to_evaluation": gen_cpu / (eval_cpu * conditions),
        "at_10000_images": {"generation_cpu_s": gen_cpu * 10000 / n, "evaluation_cpu_s": eval_cpu * conditions * 10000 / n},
    }
    print(f"all {conditions} conditions on {n} images: generation {gen_cpu:.1f} s CPU ({gen_wall:.1f} s wall), resnet26 "
          f"evaluation {eval_cpu * conditions:.1f} s CPU ({eval_wall * conditions:.1f} s wall): ratio "
          f"{summary['ratio_generation_to_evaluation']:.2f}; at 10,000 images {summary['at_10000_images']['generation_cpu_s']:.0f}"
          f" s vs {summary['at_10000_images']['evaluation_cpu_s']:.0f} s")
    write_json(args.out, {"benchmark": "corruptions", "machine": machine_description(), "threads": torch.get_num_threads(),
                          "images": n, "batch": args.batch, "model": "resnet26 width 0.25 stem_downsample 2 (CIFAR)",
                          "command": " ".join(["OMP_NUM_THREADS=1", "python", "benchmarks/bench_corruptions.py",
                                               *(argv if argv is not None else sys.argv[1:])]),
                          "summary": summary, "evaluation_runs": evals, "corruptions": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
