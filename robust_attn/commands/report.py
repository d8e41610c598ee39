"""``robust-attn report RUN_DIR... --out DIR``: SAN Tables 9 and 10 (Markdown, LaTeX, CSV) with
the published numbers beside ours, bootstrap intervals and plots, from stored runs."""
from __future__ import annotations

import argparse
from pathlib import Path

from robust_attn.cli import UserError

__all__ = ["add_parser", "run_report"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    rep = sub.add_parser("report", help="tables (SAN Tables 9, 10), intervals and plots from run directories")
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR", help="directories written by robust-attn eval")
    rep.add_argument("--out", required=True, help="folder for the report files")
    rep.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (default 1000)")
    rep.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    rep.add_argument("--level", type=float, default=0.95, help="confidence level (default 0.95)")
    rep.add_argument("--no-plots", action="store_true", help="tables only")
    rep.set_defaults(func=run_report)


def run_report(args) -> int:
    from robust_attn.reports import make_report

    for run in args.runs:
        if not (Path(run) / "run.json").is_file():
            raise UserError(f"{run} is not a run directory (no run.json); pass directories written by "
                            f"`robust-attn eval rotation|pgd --out DIR`")
    files = make_report(args.runs, args.out, n_boot=args.bootstrap, seed=args.seed, level=args.level,
                        plots=not args.no_plots)
    print(f"report of {len(args.runs)} run(s): {len(files)} files in {args.out} (see {Path(args.out) / 'report.md'})")
    return 0
