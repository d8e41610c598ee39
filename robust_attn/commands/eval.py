"""``robust-attn eval rotation|pgd|attack|transfer|corruption|occlusion|shuffle``: the SAN paper's
robustness protocols (section 5.4) on one model, written to a resumable run directory (see
:mod:`robust_attn.runs.store`); the evaluation and transfer attacks live in
:mod:`robust_attn.commands.eval_attacks`, the distribution shifts in
:mod:`robust_attn.commands.eval_shifts`.

Runs under ``torchrun --nproc_per_node=N`` as well: each rank evaluates a disjoint shard of the
images and the run directory merges them.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from robust_attn.attacks.targeted_pgd import BACKENDS
from robust_attn.cli import UserError
from robust_attn.commands.eval_common import add_common_options, parse_list, setup_run, with_cleanup

__all__ = ["add_parser", "run_rotation_cmd", "run_pgd_cmd", "run_registered_cmd"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser("eval", help="robustness protocols: rotation (SAN Table 9), pgd (SAN Table 10), attack, "
                                     "transfer, corruption, occlusion, shuffle")
    ev_sub = ev.add_subparsers(dest="protocol", required=True, metavar="PROTOCOL")
    rot = ev_sub.add_parser("rotation", help="test-time rotations and flips (SAN Table 9) plus an angle sweep")
    add_common_options(rot)
    rot.add_argument("--angle-step", type=float, default=15.0,
                     help="sweep angles every this many degrees, bilinear with zero fill (0: off; default 15)")
    rot.add_argument("--no-hflip", action="store_true", help="leave out the left-right flip")
    rot.set_defaults(func=run_rotation_cmd)
    pgd = ev_sub.add_parser("pgd", help="white-box targeted L-inf PGD (SAN Table 10)")
    add_common_options(pgd)
    pgd.add_argument("--eps", default="8", help="L-inf radius(es) in 1/255 units, comma list (default 8)")
    pgd.add_argument("--step", default=None, help="step size(s) in 1/255 units, comma list "
                                                  "(default: eps/steps, the paper's rule)")
    pgd.add_argument("--steps", default="2,4", help="iteration count(s), comma list (default 2,4: with "
                                                    "eps 8 the paper's {8,4,2} and {8,2,4})")
    pgd.add_argument("--backend", default="native", choices=BACKENDS)
    pgd.add_argument("--targets", help="reuse another run's targets.csv (same images) instead of drawing")
    pgd.add_argument("--no-checks", action="store_true", help="skip the attack sanity checks")
    pgd.add_argument("--exact", action="store_true", help="exact mode: bit-identical images across the native, "
                     "torchattacks and foolbox backends at any --batch-size (slower native attack)")
    pgd.set_defaults(func=run_pgd_cmd)
    from robust_attn.commands.eval_attacks import add_attack_parsers
    from robust_attn.commands.eval_shifts import add_shift_parsers

    add_attack_parsers(ev_sub)
    add_shift_parsers(ev_sub)
    _add_registered(ev_sub)


def _add_registered(ev_sub) -> None:
    """A subcommand for every protocol that registered an eval step
    (:mod:`robust_attn.protocols.eval_step`), its options from its settings."""
    import dataclasses

    from robust_attn.protocols.eval_step import EVAL_PROTOCOLS
    from robust_attn.protocols.settings import add_options

    for name, protocol in EVAL_PROTOCOLS.items():
        if name in ev_sub.choices:
            raise ValueError(f"eval protocol {name!r} is also a built-in eval subcommand; rename it")
        p = ev_sub.add_parser(name, help=protocol.help)
        add_common_options(p)
        add_options(p, dataclasses.fields(protocol.settings))
        p.set_defaults(func=run_registered_cmd, eval_protocol=name)


@with_cleanup
def run_registered_cmd(args) -> int:
    """``robust-attn eval NAME`` of a registered eval step: its settings from the options, checked
    before the model loads; then the step, then a one-line summary of its records."""
    import dataclasses
    from types import SimpleNamespace

    from robust_attn.protocols.eval_step import EVAL_PROTOCOLS, EvalContext
    from robust_attn.protocols.settings import given_options
    from robust_attn.protocols.shift_runner import accuracy_by_condition
    from robust_attn.runs.store import load_records

    protocol = EVAL_PROTOCOLS.get(args.eval_protocol)
    given = given_options(dataclasses.fields(protocol.settings), args, parse_list)
    settings = protocol.settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})
    settings.check(SimpleNamespace(dataset=args.dataset))
    info, rank, world_size, device, model, dataset, out, run_info = setup_run(args, protocol.name)
    ctx = EvalContext(info, dataset, out, run_info, device, rank=rank, world_size=world_size,
                      batch_size=args.batch_size, num_workers=args.num_workers, progress=not args.no_progress)
    store = protocol.step(ctx, model, settings)
    if rank == 0:
        records = load_records(store.root)
        parts = ""
        if "top1" in records:
            summary = accuracy_by_condition(records)
            parts = "top-1 " + ", ".join(f"{c} {t:.1f}" for c, t in zip(summary["condition"], summary["top1"])) + " "
        print(f"{protocol.name} {run_info['model']} on {args.dataset}/{args.split} ({len(dataset)} images): "
              f"{parts}-> {store.root}")
    return 0


@with_cleanup
def run_rotation_cmd(args) -> int:
    from robust_attn.protocols.rotation import run_rotation, summarize_rotation
    from robust_attn.shifts.rotation import rotation_conditions
    from robust_attn.runs.store import load_records

    info, rank, world_size, device, model, dataset, out, run_info = setup_run(args, "rotation")
    conditions = rotation_conditions(args.angle_step, hflip=not args.no_hflip)
    store = run_rotation(model, dataset, out, conditions=conditions, batch_size=args.batch_size, device=device,
                         run_info=run_info, rank=rank, world_size=world_size, num_workers=args.num_workers,
                         progress=not args.no_progress)
    if rank == 0:
        summary = summarize_rotation(load_records(store.root)).set_index("condition")
        parts = [f"{c} {summary.loc[c, 'top1']:.1f}({summary.loc[c, 'top1_drop']:.1f})"
                 for c in ("cw90", "cw180", "cw270", "flip_ud")]
        print(f"rotation {run_info['model']} on {args.dataset}/{args.split} ({len(dataset)} images): top-1 "
              f"{summary.loc['none', 'top1']:.1f}, top-1(drop): {', '.join(parts)} -> {store.root}")
    return 0


@with_cleanup
def run_pgd_cmd(args) -> int:
    from robust_attn.protocols.pgd import load_checks, pgd_settings, run_pgd, summarize_pgd
    from robust_attn.runs.store import load_records

    eps = parse_list(args.eps, float, "--eps")
    for e in eps:
        if 0 < e < 1:
            warnings.warn(f"--eps {e:g} is in 1/255 units (Table 10's 8 is 8/255), so it is {e:g}/255 = "
                          f"{e / 255:.2g} of the pixel range; for {e:g} of the range give --eps {e * 255:g}")
    settings = pgd_settings(eps, parse_list(args.steps, int, "--steps"), parse_list(args.step, float, "--step"))
    if args.targets and not Path(args.targets).is_file():
        raise UserError(f"--targets {args.targets} does not exist; pass another run's targets.csv")
    info, rank, world_size, device, model, dataset, out, run_info = setup_run(args, "pgd")
    store = run_pgd(model, dataset, out, num_classes=info.num_classes, settings=settings, seed=args.seed,
                    backend=args.backend, targets_file=args.targets, batch_size=args.batch_size, device=device,
                    run_info=run_info, rank=rank, world_size=world_size, num_workers=args.num_workers,
                    progress=not args.no_progress, checks=not args.no_checks, exact=args.exact)
    if rank == 0:
        summary = summarize_pgd(load_records(store.root)).set_index("condition")
        parts = [f"{s.name}: success {summary.loc[s.name, 'success_rate']:.1f}, top-1 "
                 f"{summary.loc[s.name, 'top1']:.1f}" for s in settings]
        print(f"pgd {run_info['model']} on {args.dataset}/{args.split} ({len(dataset)} images): clean top-1 "
              f"{summary.loc['clean', 'top1']:.1f}; {'; '.join(parts)} -> {store.root}")
        failed = [f"{c['setting']}: {c['name']} ({c['detail']})" for c in load_checks(store.root) if not c["passed"]]
        if failed:
            print(f"WARNING: {len(failed)} attack sanity check(s) failed (see {store.root / 'checks.json'}): "
                  + "; ".join(failed[:3]), file=sys.stderr)
    return 0
