"""``torch.compile`` (Inductor, CPU) of the attack-time copy against eager, for one family.

The attack step (forward and input gradient of a summed cross-entropy) on the copy an attack
queries (:func:`robust_attn.attacks.fast_model.attack_copy`), eager and compiled with static shapes
(``dynamic=False``), at two batch sizes: the attack's batch and a smaller one, as AutoAttack's
later members see a shrinking batch (each new shape compiles again unless batches are padded to a
few bucket sizes). Printed, in one process, one thread: the wall time of each first compiled call
(compilation included), the steady step's process CPU time eager and compiled (median of
interleaved runs), and whether the compiled step computes the same function (largest logit
difference, input-gradient signs differing, and Table 10's native PGD predictions when both run
it). ``TORCHINDUCTOR_CACHE_DIR`` set to an empty folder gives the cold compile time.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) OMP_NUM_THREADS=1 python benchmarks/bench_compile.py \\
        --family sasa_resnet26 --out benchmarks/results/compile_sasa_cpu.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import cifar10_test_images, machine_description, start_one_thread, write_json  # noqa: E402

from robust_attn.attacks import PGDConfig, draw_targets  # noqa: E402
from robust_attn.attacks.fast_model import attack_copy  # noqa: E402
from robust_attn.attacks.targeted_pgd import native_pgd  # noqa: E402
from robust_attn.models.manifest import load_model  # noqa: E402


def step(module, x, labels):
    xg = x.detach().requires_grad_(True)
    logits = module(xg)
    (grad,) = torch.autograd.grad(F.cross_entropy(logits, labels, reduction="sum"), xg)
    return logits.detach(), grad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="sasa_resnet26")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", default="/work/data", help="where cifar10-jpeg/ lies")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "compile_cpu.json"))
    args = parser.parse_args(argv)
    load = start_one_thread(f"; TORCHINDUCTOR_CACHE_DIR={os.environ.get('TORCHINDUCTOR_CACHE_DIR', '(default)')}")
    images = cifar10_test_images(args.root, max(args.batches))
    model = load_model(args.family, "cifar10").eval()
    for p in model.parameters():
        p.requires_grad_(False)
    copy = attack_copy(model, images[:4])
    compiled = torch.compile(copy, dynamic=False)
    rows = []
    for batch in args.batches:
        x = images[:batch]
        with torch.no_grad():
            labels = model(x).argmax(1)
        start = time.perf_counter()
        logits_c, grad_c = step(compiled, x, labels)
        first = time.perf_counter() - start
        logits_e, grad_e = step(copy, x, labels)
        times = {"eager": [], "compiled": []}
        for _ in range(args.repeats):
            for name, module in (("eager", copy), ("compiled", compiled)):
                t = time.process_time()
                step(module, x, labels)
                times[name].append(time.process_time() - t)
        eager, comp = statistics.median(times["eager"]), statistics.median(times["compiled"])
        targets = draw_targets(labels, 10, seed=0)
        config = PGDConfig(8, 2, 4)
        adv_e = native_pgd(copy, x, targets, config, fold_bn=False)
        adv_c = native_pgd(compiled, x, targets, config, fold_bn=False)
        with torch.no_grad():
            same = int((model(adv_e).argmax(1) == model(adv_c).argmax(1)).sum())
        row = {"family": args.family, "batch": batch, "first_compiled_call_wall_s": first,
               "eager_step_cpu_s": eager, "compiled_step_cpu_s": comp, "speedup": eager / comp,
               "max_logit_diff": (logits_c - logits_e).abs().max().item(),
               "grad_signs_differing": int((grad_c.sign() != grad_e.sign()).sum()), "grad_elements": grad_e.numel(),
               "pgd_same_predictions": same, "pgd_images": batch,
               "compile_steps_to_repay": first / max(eager - comp, 1e-9) if eager > comp else None}
        rows.append(row)
        print(f"{args.family} batch {batch}: first compiled call {first:6.1f} s wall; step eager {eager * 1e3:7.1f} ms, "
              f"compiled {comp * 1e3:7.1f} ms ({eager / comp:4.2f}x); max logit diff {row['max_logit_diff']:.1e}; "
              f"grad signs differing {row['grad_signs_differing']} of {grad_e.numel()}; PGD same predictions "
              f"{same}/{batch}", flush=True)
    write_json(args.out, {
        "benchmark": "torch.compile (Inductor, CPU, dynamic=False) of the attack copy vs eager, attack step",
        "machine": machine_description(), "threads": 1, "load_average_at_start": load,
        "torch": torch.__version__, "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "(default)"),
        "timing": f"median of {args.repeats} interleaved process-CPU-time steps; first call in wall time",
        "settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
