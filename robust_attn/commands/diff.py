"""``robust-attn diff RUN_A RUN_B``: do two runs agree image by image (a run computed again, on
another machine or with other code, against the one a report was made from)?
:mod:`robust_attn.reports.run_diff` compares them; the exit status is 0 where every condition both
have is defined alike and its records are equal on every field of every image, 1 where not, 2 on
an error (as ``diff`` does). Reads only."""
from __future__ import annotations

import argparse
from pathlib import Path

from robust_attn.cli import UserError

__all__ = ["add_parser", "run_diff"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diff", help="compare two runs' per-image records (a reproduction against the original)")
    p.add_argument("run_a", metavar="RUN_A", help="a run directory (what `eval ... --out` wrote, or one run of a "
                                                  "study's --runs or of a report's packed runs/)")
    p.add_argument("run_b", metavar="RUN_B", help="the run to compare it with")
    p.add_argument("--atol", type=float, default=0.0,
                   help="numbers this far apart count as equal (default 0: exactly as the records store them)")
    p.add_argument("--show", type=int, default=5, help="image indices named per differing field (default 5)")
    p.set_defaults(func=run_diff)


def run_diff(args) -> int:
    from robust_attn.reports.run_diff import diff_lines, diff_runs

    for path in (args.run_a, args.run_b):
        if not (Path(path) / "run.json").is_file():
            raise UserError(f"{path} is not a run directory (no run.json): pass one run, e.g. "
                            f"runs/study-cifar10/autoattack-resnet26 or reports/study-cifar10/runs/pgd-resnet26")
    if args.atol < 0:
        raise UserError(f"--atol must be at least 0, got {args.atol:g}")
    if args.show < 0:
        raise UserError(f"--show must be at least 0, got {args.show}")
    diff = diff_runs(args.run_a, args.run_b, atol=args.atol)
    print("\n".join(diff_lines(diff, shown=args.show)))
    return 0 if diff.same else 1
