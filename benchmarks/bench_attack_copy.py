"""AutoAttack's members on the attack-time copy against the model as given, side by side.

APGD-CE, APGD-T, FAB-T and Square (:mod:`robust_attn.attacks`) query the attack-time copy of the
model on a CPU by default (:func:`robust_attn.attacks.fast_model.attack_copy`: batch norm folded,
channels-last input, what native PGD attacks); ``attack_copy="off"`` queries the model as given,
which is what they did before. This script runs each member both ways on the same images of the
trained CIFAR-10 zoo models (width 0.25, 32 px), one thread, interleaved, and prints the ratio of
process CPU times and whether the same images were fooled. Budgets are small (the members' own
cost per step is what changes, not their schedules); APGD runs without early stopping, so both
ways take the same number of steps.

    OMP_NUM_THREADS=1 python benchmarks/bench_attack_copy.py --families resnet26,sasa_resnet26,gsa_resnet26 \\
        --out benchmarks/results/attack_copy_cpu.json
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

from _measure import cifar10_test_images, machine_description, start_one_thread, write_json  # noqa: E402

from robust_attn.attacks.base import AttackConfig, make_attack  # noqa: E402
from robust_attn.models.manifest import load_model  # noqa: E402

#: the members at small budgets (eps 1/255, the AutoAttack-cost benchmark's radius)
MEMBERS = (AttackConfig("apgd-ce", eps=1 / 255, steps=10, options={"early_stop": False}),
           AttackConfig("apgd-t", eps=1 / 255, steps=5, options={"n_target_classes": 2, "early_stop": False}),
           AttackConfig("fab-t", eps=1 / 255, steps=5, options={"n_target_classes": 2}),
           AttackConfig("square", eps=1 / 255, queries=100))


def run_member(model, config: AttackConfig, mode: str, images, labels) -> tuple[float, torch.Tensor]:
    """(process CPU seconds, images fooled as judged on the model) of one run of ``config``."""
    attack = make_attack(config)
    attack.attack_copy = mode
    start = time.process_time()
    adv = attack.run(model, images, labels).adv
    seconds = time.process_time() - start
    with torch.no_grad():
        return seconds, model(adv).argmax(1) != labels


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="resnet26,sasa_resnet26,gsa_resnet26")
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--root", default="/work/data", help="where cifar10-jpeg/ lies")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "attack_copy_cpu.json"))
    args = parser.parse_args(argv)
    load = start_one_thread()
    images = cifar10_test_images(args.root, args.images)
    rows = []
    for name in args.families.split(","):
        model = load_model(name, "cifar10").eval()
        with torch.no_grad():
            labels = model(images).argmax(1)   # attack the model's own predictions: every image starts correct
        for config in MEMBERS:
            times = {"on": [], "off": []}
            fooled = {}
            run_member(model, config, "on", images[:4], labels[:4])   # builds and caches the copy
            for _ in range(args.repeats):
                for mode in ("off", "on"):
                    seconds, fooled[mode] = run_member(model, config, mode, images, labels)
                    times[mode].append(seconds)
            off, on = statistics.median(times["off"]), statistics.median(times["on"])
            row = {"family": name, "attack": config.attack, "config": config.as_dict(), "images": len(images),
                   "as_given_cpu_s": off, "copy_cpu_s": on, "speedup": off / on,
                   "fooled_as_given": int(fooled["off"].sum()), "fooled_copy": int(fooled["on"].sum()),
                   "same_images_fooled": bool(torch.equal(fooled["on"], fooled["off"])),
                   "images_fooled_differently": int((fooled["on"] != fooled["off"]).sum())}
            rows.append(row)
            print(f"{name:<16} {config.attack:<8} as given {off:7.2f} s  copy {on:7.2f} s  {off / on:5.2f}x  "
                  f"fooled {row['fooled_as_given']:>2}/{row['fooled_copy']:>2} of {len(images)}  "
                  f"same images: {row['same_images_fooled']}", flush=True)
    write_json(args.out, {
        "benchmark": "AutoAttack members on the attack-time copy vs the model as given (CPU, one thread)",
        "machine": machine_description(), "threads": 1, "load_average_at_start": load,
        "timing": f"median of {args.repeats} interleaved process-CPU-time runs per member and mode",
        "settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
