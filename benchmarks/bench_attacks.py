"""Images/s of each evaluation attack per family, beside torchattacks' implementation at equal settings.

For every model (default: the seven depth-26 families at the CIFAR-10 CPU recipe's shape, width
0.25 and stem downsampling 2, random weights with the zero-initialized residual scales set to 0.2
so every block contributes and batch-norm statistics calibrated on random images, 32x32 input) and every attack, our attack (:mod:`robust_attn.attacks`) and torchattacks' counterpart
run on the same images, interleaved round by round, timed in process CPU time (the machine may
be shared); the fastest round is kept. Settings are equal on both sides:

* ``pgd``: untargeted L-inf, 10 steps of 2/255 at 8/255, no random start (ours keeps the last
  iterate, as torchattacks) vs ``torchattacks.PGD``;
* ``table10``: SAN Table 10's targeted {8, 2, 4}: ``targeted_pgd`` (native fast mode) vs
  ``torchattacks.PGD`` targeted;
* ``apgd-ce``: ``--steps`` iterations, 1 restart vs ``torchattacks.APGD(loss="ce")``;
* ``apgd-t``: ``--steps`` iterations, 9 target classes vs ``torchattacks.APGDT``;
* ``square``: ``--queries`` queries vs ``torchattacks.Square`` (both stop querying fooled images);
* ``fab-t``: ``--steps`` iterations, 9 target classes vs ``torchattacks.FAB(multi_targeted=True)`` (ours:
  its iterations written out so that they can be saved, the same operations);
* ``autoattack``: ours only (``--aa-steps`` per member): its cost per image.

Random weights make an untrained model's decisions easy to flip, so the early-stopping attacks
(Square, the ensemble) do less work than on a trained model; the ratios of equal settings are
what this measures.

    python benchmarks/bench_attacks.py                                  # all families, batch 16
    python benchmarks/bench_attacks.py --models resnet26 --attacks pgd,apgd-ce --out /tmp/a.json
    python benchmarks/bench_attacks.py --zoo fashion_mnist --attacks autoattack --aa-steps 100 --queries 5000 \
        --out benchmarks/results/autoattack_cost_fashion_mnist.json      # standard AutoAttack, trained models
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
from robust_attn.attacks import PGDConfig, draw_targets, targeted_pgd  # noqa: E402
from robust_attn.attacks.base import AttackConfig, make_attack  # noqa: E402
from robust_attn.models.wrapper import NormalizedModel  # noqa: E402

FAMILIES = ("resnet26", "san10_pairwise", "san10_patchwise", "sasa_resnet26", "gsa_resnet26", "aa_resnet26",
            "ea_resnet26")
ATTACKS = ("pgd", "table10", "apgd-ce", "apgd-t", "square", "fab-t", "autoattack")
EPS = 8 / 255   # --eps changes it


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def build(name: str, seed: int = 0) -> NormalizedModel:
    torch.manual_seed(seed)
    net = robust_attn.create_model(name, num_classes=10, resolution="cifar", width=0.25, stem_downsample=2)
    for m in net.modules():   # zero-initialized residual scales would mute every block
        if isinstance(m, torch.nn.BatchNorm2d):
            if not m.weight.detach().any():
                m.weight.data.fill_(0.2)
            m.reset_running_stats()
            m.momentum = None      # cumulative average over the calibration batches below
    model = NormalizedModel(net, [0.49, 0.48, 0.45], [0.25, 0.24, 0.26])
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():     # batch-norm statistics of the images the model sees, as after training
        model.train()
        for _ in range(4):
            model(torch.rand(32, 3, 32, 32, generator=gen))
    model.eval()
    with torch.no_grad():
        if not torch.isfinite(model(torch.rand(2, 3, 32, 32))).all():
            raise RuntimeError(f"{name}: non-finite logits with the benchmark's weights")
    return model


def pairs(attack: str, model, images, labels, args) -> dict:
    """name -> zero-argument callable, ours first."""
    import torchattacks

    targets = draw_targets(labels, 10, seed=0)
    if attack == "pgd":
        ours = make_attack(AttackConfig("pgd", eps=EPS, steps=10, step=2 / 255,
                                        options={"random_start": False, "keep": "last"}))
        theirs = torchattacks.PGD(model, eps=EPS, alpha=2 / 255, steps=10, random_start=False)
        return {"ours": lambda: ours.run(model, images, labels), "torchattacks": lambda: theirs(images, labels)}
    if attack == "table10":
        theirs = torchattacks.PGD(model, eps=EPS, alpha=2 / 255, steps=4, random_start=False)
        theirs.set_mode_targeted_by_label(quiet=True)
        return {"ours": lambda: targeted_pgd(model, images, targets, PGDConfig(8, 2, 4)),
                "torchattacks": lambda: theirs(images, targets)}
    if attack == "apgd-ce":
        ours = make_attack(AttackConfig("apgd-ce", eps=EPS, steps=args.steps))
        theirs = torchattacks.APGD(model, eps=EPS, steps=args.steps, n_restarts=1, loss="ce")
        return {"ours": lambda: ours.run(model, images, labels), "torchattacks": lambda: theirs(images, labels)}
    if attack == "apgd-t":
        ours = make_attack(AttackConfig("apgd-t", eps=EPS, steps=args.steps, options={"n_target_classes": 9}))
        theirs = torchattacks.APGDT(model, eps=EPS, steps=args.steps, n_restarts=1, n_classes=10)
        return {"ours": lambda: ours.run(model, images, labels), "torchattacks": lambda: theirs(images, labels)}
    if attack == "square":
        ours = make_attack(AttackConfig("square", eps=EPS, queries=args.queries))
        theirs = torchattacks.Square(model, eps=EPS, n_queries=args.queries, n_restarts=1)
        return {"ours": lambda: ours.run(model, images, labels), "torchattacks": lambda: theirs(images, labels)}
    if attack == "fab-t":
        ours = make_attack(AttackConfig("fab-t", eps=EPS, steps=args.steps))
        theirs = torchattacks.FAB(model, eps=EPS, steps=args.steps, n_restarts=1, multi_targeted=True, n_classes=10)
        return {"ours": lambda: ours.run(model, images, labels), "torchattacks": lambda: theirs(images, labels)}
    if attack == "autoattack":
        ours = make_attack(AttackConfig("autoattack", eps=EPS, steps=args.aa_steps, queries=args.queries))
        return {"ours": lambda: ours.run(model, images, labels)}
    raise ValueError(f"unknown attack {attack!r}; choose from {', '.join(ATTACKS)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(FAMILIES))
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="APGD and FAB iterations (standard: 100)")
    parser.add_argument("--aa-steps", type=int, default=20, help="AutoAttack members' iterations")
    parser.add_argument("--queries", type=int, default=100, help="Square's queries (standard: 5000)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--eps", type=float, default=8.0, help="L-inf radius in 1/255 (default 8); at 1/255 most "
                                                               "images resist, so AutoAttack runs all four members")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--zoo", metavar="DATASET",
                        help="attack the zoo's trained models for DATASET on its first --batch test images "
                             "(the embedded test set) instead of random-weight models on random images")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "attacks.json"))
    args = parser.parse_args()
    global EPS
    EPS = args.eps / 255
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(args.batch, 3, 32, 32, generator=gen)
    rows = []
    if args.zoo:
        from robust_attn.data import build_dataset
        from robust_attn.models.manifest import load_model

        test = build_dataset(args.zoo, split="test")
        images = torch.stack([test[i][0] for i in range(args.batch)])
        true_labels = torch.as_tensor([int(test[i][1]) for i in range(args.batch)])
    for name in args.models.split(","):
        model = load_model(name, args.zoo) if args.zoo else build(name)
        with torch.no_grad():
            # random models: attack their own predictions, so every image starts correct; zoo models:
            # the true labels (AutoAttack skips the misclassified ones, as it would in a study)
            labels_m = true_labels if args.zoo else model(images).argmax(1)
        for attack in args.attacks.split(","):
            fns = pairs(attack, model, images, labels_m, args)
            if len(fns) > 1:          # warm-up of a comparison (kernel compilation, folded-BN cache)
                for fn in fns.values():
                    fn()
            best = {k: min(cpu_seconds(fn) for _ in range(args.rounds)) for k, fn in fns.items()}
            row = {"model": name, "attack": attack, "batch": args.batch, "weights": args.zoo or "random",
                   "eps": args.eps,
                   **{f"{k}_img_s": args.batch / v for k, v in best.items()},
                   **{f"{k}_ms_per_image": 1e3 * v / args.batch for k, v in best.items()}}
            if "torchattacks" in best:
                row["speedup"] = best["torchattacks"] / best["ours"]
            rows.append(row)
            shown = ", ".join(f"{k} {args.batch / v:.1f} img/s" for k, v in best.items())
            ratio = f" -> {row['speedup']:.2f}x" if "speedup" in row else ""
            print(f"{name:16s} {attack:11s} {shown}{ratio}", flush=True)
    write_json(args.out, {"machine": machine_description(), "settings": vars(args), "rows": rows})
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
