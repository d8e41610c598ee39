"""What each member of AutoAttack costs and adds, per trained zoo model, at one radius.

AutoAttack's standard ensemble (Croce & Hein, ICML 2020; :mod:`robust_attn.attacks.autoattack`)
runs APGD-CE, then APGD-T, FAB-T and Square, each on the images the members before it left
correctly classified. On a model without a defence the first member does nearly all the
fooling, and the other three cost seconds to tens of seconds of CPU per image that survives them. This
script measures both per model, on the first ``--images`` images of the study's attack subset
(the same seeded images ``robust-attn study --attack-limit A`` attacks when its ``--limit`` is at least A):

* per member: how many images it attacked, how many of those it fooled, its CPU seconds per
  attacked image (process time, one thread);
* the images left robust after APGD-CE and after the whole ensemble: their difference is what
  the other members add to APGD-CE alone (the study's ``apgd`` protocol).

    python benchmarks/bench_autoattack_members.py --dataset cifar10 --attack-limit 1000 \\
        --eps 1 --images 60 --models resnet26,san10_pairwise \\
        --out benchmarks/results/autoattack_members_cifar10_eps1.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import machine_description, write_json  # noqa: E402

import robust_attn  # noqa: E402
from robust_attn.attacks.autoattack import AutoAttack  # noqa: E402
from robust_attn.attacks.base import AttackConfig, make_attack  # noqa: E402
from robust_attn.data import build_dataset  # noqa: E402


def attack_images(dataset: str, attack_limit: int, images: int):
    """The first ``images`` images of the study's attack subset (the seeded ``attack_limit`` of
    the test split, :func:`robust_attn.study.models.model_inputs`)."""
    subset = build_dataset(dataset, split="test", limit=attack_limit)
    xs, ys = zip(*(subset[i] for i in range(min(images, len(subset)))))
    return torch.stack(xs), torch.as_tensor(ys).long()


def members(model, images, labels, eps: float, seed: int) -> dict:
    """AutoAttack's members one by one, as :class:`~robust_attn.attacks.autoattack.AutoAttack`
    runs them (the same member configs and seeds), each timed on the images still robust."""
    ensemble = AutoAttack(AttackConfig("autoattack", eps=eps / 255, seed=seed))
    with torch.no_grad():
        logits = model(images)
    robust = logits.argmax(1) == labels
    row = {"images": len(labels), "clean_correct": int(robust.sum()), "members": []}
    for position, name in enumerate(ensemble.member_names):
        todo = robust.nonzero().flatten()
        if todo.numel() == 0:
            break
        attack = make_attack(ensemble.member_config(name, position, logits.shape[1]))
        start = time.process_time()
        out = attack.run(model, images[todo], labels[todo])
        seconds = time.process_time() - start
        with torch.no_grad():
            fooled = model(out.adv).argmax(1) != labels[todo]
        robust[todo[fooled]] = False
        row["members"].append({"member": name, "attacked": int(todo.numel()), "fooled": int(fooled.sum()),
                               "cpu_s_per_attacked_image": seconds / todo.numel()})
        print(f"  {name}: attacked {todo.numel()}, fooled {int(fooled.sum())}, "
              f"{seconds / todo.numel():.2f} CPU-s per attacked image", flush=True)
    first = row["members"][0] if row["members"] else {"attacked": 0, "fooled": 0}
    row["robust_after_apgd_ce"] = first["attacked"] - first["fooled"]
    row["robust_after_autoattack"] = int(robust.sum())
    row["added_by_other_members"] = row["robust_after_apgd_ce"] - row["robust_after_autoattack"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="cifar10")
    parser.add_argument("--attack-limit", type=int, default=1000, help="the study's --attack-limit (default 1000)")
    parser.add_argument("--models", default="resnet26,san10_pairwise")
    parser.add_argument("--eps", type=float, default=1.0, help="L-inf radius in 1/255 (default 1)")
    parser.add_argument("--images", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" /
                                             "autoattack_members_cifar10_eps1.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    images, labels = attack_images(args.dataset, args.attack_limit, args.images)
    rows = []
    for name in args.models.split(","):
        model = robust_attn.load_model(name, dataset=args.dataset).eval()
        print(f"{name} at {args.eps:g}/255 on {len(labels)} images", flush=True)
        rows.append({"model": name, "eps": args.eps, **members(model, images, labels, args.eps, args.seed)})
        print(f"  robust after APGD-CE {rows[-1]['robust_after_apgd_ce']}, after AutoAttack "
              f"{rows[-1]['robust_after_autoattack']}", flush=True)
    write_json(args.out, {"machine": machine_description(), "settings": vars(args),
                          "rows": rows})


if __name__ == "__main__":
    main()
