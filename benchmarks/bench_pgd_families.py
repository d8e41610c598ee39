"""SAN Table 10's targeted PGD ({eps, step, n} = {8, 2, 4}) on every trained CIFAR-10 zoo family: the
native attack (its default fast mode, :func:`robust_attn.attacks.targeted_pgd`) against torchattacks,
images/s and their ratio side by side from one run, one thread.

Each family's two backends are timed in interleaved rounds on the same images and targets (process
CPU time, steadier than wall time on a shared machine; wall time is recorded too); the native
images' predictions are compared with torchattacks' (they agree up to floating-point ties, see
:func:`robust_attn.attacks.targeted_pgd.native_pgd`).

    python benchmarks/bench_pgd_families.py                    # batch 64, every family
    python benchmarks/bench_pgd_families.py --families resnet26,sasa_resnet26 --rounds 2
    python benchmarks/bench_pgd_families.py --bf16     # also native PGD under bf16 autocast (another function)
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

from _attack_variants import Autocast  # noqa: E402
from _measure import machine_description, write_json  # noqa: E402

from robust_attn.attacks import PGDConfig, draw_targets, targeted_pgd  # noqa: E402
from robust_attn.attacks.fast_model import attack_model  # noqa: E402
from robust_attn.attacks.targeted_pgd import native_pgd  # noqa: E402
from robust_attn.models.manifest import load_model  # noqa: E402

FAMILIES = ("resnet26", "san10_pairwise", "san10_patchwise", "sasa_resnet26", "gsa_resnet26", "aa_resnet26",
            "ea_resnet26")
BACKENDS = ("native", "torchattacks")


def _bf16_pgd(model, images, targets, config):
    """Native PGD on the attack copy under bf16 autocast (not the default: another function)."""
    copy = Autocast(attack_model(model, images[:4]), "cpu")
    with torch.enable_grad():
        return native_pgd(copy, images, targets, config, fold_bn=False).detach()


def measure(name: str, batch: int, rounds: int, config: PGDConfig, bf16: bool = False) -> dict:
    model = load_model(name, "cifar10").eval()
    images = torch.rand(batch, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        labels = model(images).argmax(1)
    targets = draw_targets(labels, 10, seed=0)
    attacks = {b: (lambda b=b: targeted_pgd(model, images, targets, config, backend=b)) for b in BACKENDS}
    if bf16:
        attacks["native_bf16"] = lambda: _bf16_pgd(model, images, targets, config)
    advs = {b: attack() for b, attack in attacks.items()}  # warm-up
    cpu: dict[str, list[float]] = {b: [] for b in attacks}
    wall: dict[str, list[float]] = {b: [] for b in attacks}
    for _ in range(rounds):
        for b, attack in attacks.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            attack()
            cpu[b].append((time.process_time() - start_cpu) * 1e3)
            wall[b].append((time.perf_counter() - start) * 1e3)
    with torch.no_grad():
        preds = {b: model(adv).argmax(1) for b, adv in advs.items()}
    row = {"family": name, "batch": batch, "same_predictions": int((preds["native"] == preds["torchattacks"]).sum())}
    if bf16:
        row["bf16_same_predictions_as_native"] = int((preds["native_bf16"] == preds["native"]).sum())
    for b in attacks:
        row[b] = {"cpu_ms": statistics.median(cpu[b]), "wall_ms": statistics.median(wall[b]),
                  "images_per_s": batch / statistics.median(cpu[b]) * 1e3}
    row["native_vs_torchattacks"] = row["native"]["images_per_s"] / row["torchattacks"]["images_per_s"]
    if bf16:
        row["bf16_vs_native"] = row["native_bf16"]["images_per_s"] / row["native"]["images_per_s"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bf16", action="store_true",
                        help="also native PGD under bf16 autocast: speed and predictions against fp32 native")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "pgd_families.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = PGDConfig(8, 2, 4)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"targeted PGD {config}, CIFAR-10 zoo, batch {args.batch}; {machine_description()}; "
          f"load average {' '.join(load)} (shared machine: compare the ratios)")
    extra = " bf16 / native | bf16 same predictions as native |" if args.bf16 else ""
    print(f"| family | native img/s | torchattacks img/s | native / torchattacks | same predictions |{extra}")
    print("|---|--:|--:|--:|--:|" + ("--:|--:|" if args.bf16 else ""))
    rows = []
    for name in args.families.split(","):
        r = measure(name, args.batch, args.rounds, config, args.bf16)
        rows.append(r)
        cells = (f" {r['bf16_vs_native']:.2f}x | {r['bf16_same_predictions_as_native']}/{args.batch} |"
                 if args.bf16 else "")
        print(f"| {name} | {r['native']['images_per_s']:.1f} | {r['torchattacks']['images_per_s']:.1f} "
              f"| {r['native_vs_torchattacks']:.2f}x | {r['same_predictions']}/{args.batch} |{cells}", flush=True)
    write_json(args.out, {
        "benchmark": "Table 10 targeted PGD, native (default fast mode) vs torchattacks, per family",
        "config": {"eps": config.eps, "step": config.step, "steps": config.steps},
        "machine": machine_description(), "threads": 1, "load_average_at_start": load,
        "timing": f"median of {args.rounds} interleaved rounds, process CPU time (images_per_s) and wall time",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
