"""``robust-attn eval PROTOCOL``: one protocol on one model (SAN's section 5.4 and the rest),
written to a resumable run directory (see :mod:`robust_attn.runs.store`).

Every subcommand is a protocol's registered eval step (:mod:`robust_attn.protocols.eval_step`):
its options are the fields of its settings, the same dataclass its study step takes, beside the
model, data and output options every subcommand has
(:func:`robust_attn.commands.eval_common.add_common_options`). This module is the plumbing:
parse, check the settings, load the model and the images, run the step, print its summary.

Runs under ``torchrun --nproc_per_node=N`` as well: each rank evaluates a disjoint shard of the
images and the run directory merges them.
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace

from robust_attn.commands.eval_common import add_common_options, parse_list, setup_run, with_cleanup

__all__ = ["add_parser", "eval_settings", "run_eval_cmd"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    from robust_attn.protocols.eval_step import EVAL_PROTOCOLS
    from robust_attn.protocols.settings import add_options, eval_fields

    names = EVAL_PROTOCOLS.names()
    ev = sub.add_parser("eval", help=f"one robustness protocol on one model: {', '.join(names)}")
    ev_sub = ev.add_subparsers(dest="protocol", required=True, metavar="PROTOCOL")
    for name in names:
        protocol = EVAL_PROTOCOLS.get(name)
        p = ev_sub.add_parser(name, help=protocol.help)
        add_common_options(p)
        add_options(p, eval_fields(protocol.settings), command="eval")
        p.set_defaults(func=run_eval_cmd, eval_protocol=name)


def eval_settings(protocol, args):
    """The protocol's settings from the command line (an option left out: the field's default),
    checked before anything is loaded."""
    from robust_attn.protocols.settings import eval_fields, given_options

    given = given_options(eval_fields(protocol.settings), args, parse_list, command="eval")
    settings = protocol.settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})
    settings.check(SimpleNamespace(command="eval", dataset=args.dataset, root=args.root, split=args.split,
                                   limit=args.limit))
    return settings


@with_cleanup
def run_eval_cmd(args) -> int:
    """``robust-attn eval NAME``: its settings, the model(s) and images, the step, then the
    step's one-line summary (default: top-1 per condition)."""
    from robust_attn.protocols.eval_step import EVAL_PROTOCOLS, EvalContext

    protocol = EVAL_PROTOCOLS.get(args.eval_protocol)
    settings = eval_settings(protocol, args)
    run_name = protocol.run_name(settings) if protocol.run_name else protocol.name
    if protocol.models == "sources-targets":
        from robust_attn.commands.eval_models import setup_models

        info, rank, world_size, device, model, dataset, out, run_info = setup_models(args, settings, run_name)
    else:
        info, rank, world_size, device, model, dataset, out, run_info = setup_run(args, run_name)
    ctx = EvalContext(info, dataset, out, run_info, device, rank=rank, world_size=world_size,
                      batch_size=args.batch_size, num_workers=args.num_workers, progress=not args.no_progress,
                      seed=args.seed, data={"name": args.dataset, "root": args.root, "split": args.split,
                                            "limit": args.limit}, repair=args.repair)
    store = protocol.step(ctx, model, settings)
    if rank == 0:
        summary = (protocol.summary or _top1)(ctx, settings, store)
        head = f"{protocol.name} {run_info['model']} on {args.dataset}/{args.split} ({len(dataset)} images):"
        if "\n" in summary:   # one line per row, indented
            print(head, *("  " + line for line in summary.split("\n")), f"-> {store.root}", sep="\n")
        else:
            print(f"{head} {summary} -> {store.root}")
    return 0


def _top1(ctx, settings, store) -> str:
    from robust_attn.protocols.shift_runner import accuracy_by_condition
    from robust_attn.runs.store import load_records

    records = load_records(store.root)
    if "top1" not in records:
        return "done"
    summary = accuracy_by_condition(records)
    return "top-1 " + ", ".join(f"{c} {t:.1f}" for c, t in zip(summary["condition"], summary["top1"]))
