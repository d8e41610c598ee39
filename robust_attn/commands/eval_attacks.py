"""``robust-attn eval attack|transfer``: the evaluation attacks (PGD, APGD, FAB, Square,
AutoAttack) with their gradient-masking checks, and transfer attacks from source models to target
models. Same model, data and output options as ``eval pgd``
(:mod:`robust_attn.commands.eval`)."""
from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

import torch

from robust_attn.cli import UserError
from robust_attn.commands.eval_common import add_common_options, repair_run, setup_run, with_cleanup, check_common

__all__ = ["add_attack_parsers", "attack_configs", "load_named_model", "run_attack_cmd", "run_transfer_cmd"]


def _add_attack_options(p: argparse.ArgumentParser, default_attack: str | None) -> None:
    from robust_attn.attacks.base import NORMS, list_attacks

    p.add_argument("--attack", default=default_attack, required=default_attack is None,
                   help=f"attack name ({', '.join(list_attacks())})")
    p.add_argument("--norm", default="linf", choices=NORMS, help="threat model (default linf)")
    p.add_argument("--eps", default="8/255", help="radius(es) in [0, 1] image units, comma list: 8/255 or 0.031 "
                                                  "(as in every command; default 8/255)")
    p.add_argument("--targeted", action="store_true", help="attack toward seeded wrong-class targets")
    p.add_argument("--steps", type=int, help="iterations (default: the attack's own)")
    p.add_argument("--step", help="step size in image units, e.g. 2/255 (PGD; default: the attack's own)")
    p.add_argument("--restarts", type=int, default=1, help="random restarts, strongest kept per image")
    p.add_argument("--queries", type=int, help="query budget of score-based attacks (Square)")
    p.add_argument("--attack-seed", type=int, default=0, help="seed of the attack's random draws")


def add_attack_parsers(ev_sub) -> None:
    from robust_attn.attacks.fast_model import ATTACK_COPY_MODES

    att = ev_sub.add_parser("attack", help="an evaluation attack (PGD, APGD, FAB, Square, AutoAttack) with "
                                           "per-image records and gradient-masking checks")
    add_common_options(att)
    _add_attack_options(att, None)
    att.add_argument("--targets", help="reuse another run's targets.csv (same images) for --targeted")
    att.add_argument("--no-checks", action="store_true", help="skip the gradient-masking checks")
    att.add_argument("--attack-copy", default="auto", choices=ATTACK_COPY_MODES,
                     help="whether the attacks query the attack-time copy of the model (batch norm folded, "
                          "channels-last input: the same function, faster on a CPU, rounded differently) or the "
                          "model as given; auto (default): the copy on a CPU; recorded in run.json")
    att.set_defaults(func=run_attack_cmd)
    tra = ev_sub.add_parser("transfer", help="craft adversarial images on --source model(s), evaluate them on "
                                             "every --target model")
    add_common_options(tra)
    tra.add_argument("--source", action="append", required=True,
                     help="zoo entry name (for --dataset), checkpoint .safetensors or any model spec (timm:NAME, "
                          "torchvision:NAME[:WEIGHTS], FILE.py:FUNCTION, ...); repeat for an ensemble (mean of logits)")
    tra.add_argument("--target", action="append", required=True,
                     help="zoo entry name, checkpoint .safetensors or model spec; repeat for several targets")
    _add_attack_options(tra, "pgd")
    tra.set_defaults(func=run_transfer_cmd)


def attack_configs(args) -> list:
    """One :class:`~robust_attn.attacks.base.AttackConfig` per ``--eps`` value."""
    from robust_attn.attacks.base import AttackConfig
    from robust_attn.commands.eps import parse_radii, parse_radius

    step = parse_radius(args.step, "--step", args.norm) if args.step is not None else None
    eps = parse_radii(args.eps, "--eps", args.norm)
    return [AttackConfig(args.attack, norm=args.norm, eps=e, targeted=args.targeted, steps=args.steps,
                         restarts=args.restarts, step=step, queries=args.queries, seed=args.attack_seed)
            for e in eps]


@with_cleanup
def run_attack_cmd(args) -> int:
    from robust_attn.protocols.attack import run_attack, summarize_attack
    from robust_attn.runs.store import load_records

    configs = attack_configs(args)
    if args.targets and not Path(args.targets).is_file():
        raise UserError(f"--targets {args.targets} does not exist; pass another run's targets.csv")
    info, rank, world_size, device, model, dataset, out, run_info = setup_run(args, f"attack-{args.attack}")
    store = run_attack(model, dataset, out, configs=configs, num_classes=info.num_classes, seed=args.seed,
                       targets_file=args.targets, batch_size=args.batch_size, device=device, run_info=run_info,
                       rank=rank, world_size=world_size, num_workers=args.num_workers,
                       progress=not args.no_progress, checks=not args.no_checks, attack_copy=args.attack_copy)
    if rank == 0:
        summary = summarize_attack(load_records(store.root)).set_index("condition")
        parts = [f"{c.name}: robust top-1 {summary.loc[c.name, 'robust_top1']:.1f}" for c in configs]
        print(f"{args.attack} on {run_info['model']} ({args.dataset}/{args.split}, {len(dataset)} images): clean "
              f"top-1 {summary.loc['clean', 'robust_top1']:.1f}; {'; '.join(parts)} -> {store.root}")
        _warn_flagged(store.root)
    return 0


def _warn_flagged(root: Path) -> None:
    import json

    path = Path(root) / "checks.json"
    if not path.is_file():
        return
    flagged = [c for c in json.loads(path.read_text()) if c.get("verdict", "pass") != "pass"
               or c.get("passed", True) is False]
    if flagged:
        print(f"WARNING: {len(flagged)} gradient-masking check(s) flagged (see {path}): "
              + "; ".join(f"{c['name']}: {c.get('detail', '')}" for c in flagged[:3]), file=sys.stderr)


def load_named_model(spec: str, info, device, other_dataset: bool = False) -> tuple[str, torch.nn.Module, dict]:
    """A transfer source or target: a zoo entry name (``NAME`` or ``zoo:NAME``, for the dataset),
    a checkpoint file, or any other model spec (:mod:`robust_attn.sources`; its description
    carries its ``preprocessing``). Returns (name, model, description)."""
    from robust_attn.models.checkpoint import check_trained_on, load_checkpoint
    from robust_attn.sources import load_model_spec, parse_spec, spec_label
    from robust_attn.utils.io import sha256_file
    from robust_attn.models.manifest import Manifest, load_entry

    path = Path(spec)
    if not (spec.endswith(".safetensors") or path.is_file()) and parse_spec(spec)[0] not in ("registry", "zoo"):
        loaded = load_model_spec(spec, dataset_info=info, device=str(device))
        return spec_label(spec), loaded.model, loaded.description
    if spec.endswith(".safetensors") or path.is_file():
        if not path.is_file():
            raise UserError(f"checkpoint {path} does not exist; check the path")
        model = load_checkpoint(path)
        check_trained_on(path, info.name, allow_other=other_dataset)
        name = path.stem
        desc = {"model": model.arch_args.get("name", name), "checkpoint": {"path": str(path),
                                                                           "sha256": sha256_file(path)}}
    else:
        manifest = Manifest()
        entry_name = spec.removeprefix("zoo:")
        try:
            entry = manifest.get(entry_name, info.name)
        except (KeyError, ValueError) as err:
            raise UserError(f"{spec!r} is neither a checkpoint file nor a zoo model for {info.name}: {err}") from None
        model = load_entry(entry, manifest, device=str(device))
        name = entry.name
        desc = {"model": entry.name, "zoo_entry": entry.name,
                "checkpoint": {"path": entry.weights, "sha256": entry.sha256}}
    from robust_attn.models.checkpoint import check_num_classes

    model = model.to(device).eval()
    check_num_classes(model, info.num_classes, f"model {spec}", image_size=info.image_size)
    return name.replace(".", "_"), model, desc


@with_cleanup
def run_transfer_cmd(args) -> int:
    from robust_attn.commands.eval_common import check_classes, check_deterministic_model
    from robust_attn.data import dataset_info
    from robust_attn.distributed import init_distributed
    from robust_attn.protocols.transfer import EnsembleModel, run_transfer, summarize_transfer
    from robust_attn.sources.inputs import model_dataset, same_preprocessing
    from robust_attn.runs.store import load_records
    from robust_attn.sources.contract import apply_input_contract

    if args.model or args.checkpoint or args.zoo:
        raise UserError("eval transfer takes its models as --source and --target, not --model/--checkpoint/--zoo")
    check_common(args)
    configs = attack_configs(args)
    info = dataset_info(args.dataset, root=args.root)
    check_classes(info, args.root)
    rank, world_size, device = init_distributed(args.device)
    sources = [load_named_model(s, info, device, args.other_dataset) for s in args.source]
    targets = [load_named_model(t, info, device, args.other_dataset) for t in args.target]
    source_name = "+".join(n for n, _, _ in sources)
    common = same_preprocessing({n: d.get("preprocessing") for n, _, d in sources + targets},
                                "a transferred image is one tensor for every source and target",
                                "transfer between models of one preprocessing")
    dataset = model_dataset(args.dataset, common, root=args.root, split=args.split, limit=args.limit)[0]
    # each user's model: its input contract (printed, recorded with it); every model: deterministic
    flag = getattr(args, "model_input", None)
    sources, targets = ([(n, m, apply_input_contract(m, d, flag if d.get("source") == "callable" else None, dataset,
                                                     device, args.batch_size,
                                                     log=lambda line, n=n: print(f"{n}: {line}", file=sys.stderr)))
                         for n, m, d in group] for group in (sources, targets))
    for n, m, _ in sources + targets:
        check_deterministic_model(m, dataset, device, args.batch_size, name=f"model {n}")
    source = sources[0][1] if len(sources) == 1 else EnsembleModel([m for _, m, _ in sources])
    out = Path(args.out or f"runs/transfer-{source_name}-{args.dataset}-{args.split}")
    repair_run(args, out, rank)
    origins = sorted({d.get("weights_origin", "zoo" if d.get("zoo_entry") else "checkpoint") for _, _, d in sources})
    run_info = {"model": source_name, "sources": [d for _, _, d in sources],
                "checkpoint": [d["checkpoint"] for _, _, d in sources] if all(d.get("checkpoint") for _, _, d in
                                                                              sources) else None,
                "weights_origin": "+".join(origins),   # "random" only when every source's weights are
                "target_models": {n: d for n, _, d in targets},
                "dataset": {"name": args.dataset, "split": args.split, "limit": args.limit},
                "data_source": getattr(dataset, "source", None), "command": list(sys.argv),
                "device": str(device), "world_size": world_size, "host": socket.gethostname(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    store = run_transfer(source_name, source, {n: m for n, m, _ in targets}, dataset, out, configs=configs,
                         seed=args.seed, batch_size=args.batch_size, device=device, run_info=run_info, rank=rank,
                         world_size=world_size, num_workers=args.num_workers, progress=not args.no_progress)
    if rank == 0:
        summary = summarize_transfer(load_records(store.root))
        for _, row in summary.iterrows():
            print(f"transfer {row['source']} -> {row['target_model']} [{row['attack']}]: top-1 {row['top1']:.1f}, "
                  f"success {row['success_rate']:.1f} (on the source {row['source_success_rate']:.1f})")
        print(f"-> {store.root}")
    return 0
