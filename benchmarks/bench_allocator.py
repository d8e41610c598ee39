"""What keeping freed memory in the process buys (:mod:`robust_attn.utils.allocator`), per family.

glibc maps a tensor above 32 MiB anew at each allocation and the kernel zero-fills its pages on
first touch; ``robust-attn`` turns that off on start. This script measures, on the trained
Fashion-MNIST zoo at the study's attack batch (``--batch`` images, 32x32), one thread:

* a forward pass without gradients (what Square and every member's final check cost), and
* a forward and backward pass to the input (what each APGD, FAB and PGD iteration costs),

each in a fresh child process per setting (glibc's defaults against :func:`keep_freed_memory`),
the two settings in turns, ``--rounds`` times, so a drift of the shared machine moves both alike.
A child reports its median wall times, its minor page faults and peak resident memory, and a
SHA-256 of every output and input gradient it computed: the two settings must agree bit for bit.

    OMP_NUM_THREADS=1 python benchmarks/bench_allocator.py --out benchmarks/results/allocator.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import machine_description, write_json  # noqa: E402

FAMILIES = ["resnet26", "san10_pairwise", "san10_patchwise", "sasa_resnet26", "gsa_resnet26", "aa_resnet26",
            "ea_resnet26"]


def child(model_name: str, batch: int, repeats: int, keep: bool) -> dict:
    """One setting's measurements in this (fresh) process."""
    from robust_attn.utils.allocator import keep_freed_memory

    took = keep_freed_memory() if keep else False
    import torch

    from robust_attn.models.manifest import load_model

    torch.set_num_threads(1)
    model = load_model(model_name, dataset="fashion_mnist").eval()
    x = torch.rand(batch, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    digest = hashlib.sha256()

    def forward(i):
        with torch.no_grad():
            digest.update(model(x + i * 1e-3).numpy().tobytes())

    def forward_backward(i):
        xg = (x + i * 1e-3).requires_grad_(True)
        grad, = torch.autograd.grad(model(xg).logsumexp(1).sum(), xg)
        digest.update(grad.numpy().tobytes())

    times = {}
    for name, fn in (("forward", forward), ("forward_backward", forward_backward)):
        fn(-1)   # warm-up
        spans = []
        for i in range(repeats):
            start = time.perf_counter()
            fn(i)
            spans.append(time.perf_counter() - start)
        times[name] = statistics.median(spans)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"kept": took, **{f"{k}_s": v for k, v in times.items()}, "minor_faults": usage.ru_minflt,
            "system_s": usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024, "sha256": digest.hexdigest()}


def _in_child(model_name: str, batch: int, repeats: int, keep: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, __file__, "--child", model_name, "--batch", str(batch), "--repeats",
                           str(repeats)] + (["--keep"] if keep else []), env=env, stdout=subprocess.PIPE, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(FAMILIES))
    parser.add_argument("--batch", type=int, default=800)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes of each kind per child")
    parser.add_argument("--rounds", type=int, default=2, help="children per setting, in turns")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.batch, args.repeats, args.keep)))
        return 0

    rows = []
    print(f"{'model':<16} {'forward':>9} {'fwd+bwd':>9} {'faults (default / kept)':>26} {'peak MB':>15}  same")
    for name in args.models.split(","):
        runs = {False: [], True: []}
        for _ in range(args.rounds):
            for keep in (False, True):
                runs[keep].append(_in_child(name, args.batch, args.repeats, keep))
        assert all(r["kept"] for r in runs[True]), "keep_freed_memory() did nothing here (not glibc?)"
        same = len({r["sha256"] for r in runs[False] + runs[True]}) == 1
        med = {k: {m: statistics.median(r[m] for r in rs) for m in rs[0] if m not in ("kept", "sha256")}
               for k, rs in runs.items()}
        row = {"model": name, "batch": args.batch, "default": med[False], "kept": med[True],
               "forward_ratio": med[False]["forward_s"] / med[True]["forward_s"],
               "forward_backward_ratio": med[False]["forward_backward_s"] / med[True]["forward_backward_s"],
               "bit_identical": same}
        rows.append(row)
        print(f"{name:<16} {row['forward_ratio']:>8.2f}x {row['forward_backward_ratio']:>8.2f}x "
              f"{med[False]['minor_faults']:>12,.0f} / {med[True]['minor_faults']:>10,.0f} "
              f"{med[False]['peak_rss_mb']:>7.0f}/{med[True]['peak_rss_mb']:<7.0f}  {'yes' if same else 'NO'}")
    if args.out:
        write_json(args.out, {"description": "default glibc malloc over keep_freed_memory(): wall-time ratios "
                                             "(>1: keeping is faster), medians of children in turns",
                              "machine": machine_description("cpu"), "batch": args.batch, "repeats": args.repeats,
                              "rounds": args.rounds, "models": rows})
    return 0 if all(r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
