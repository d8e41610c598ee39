"""``robust-attn report RUN_DIR... --out DIR``: SAN Tables 9 and 10 (Markdown, LaTeX, CSV) with
the published numbers beside ours, bootstrap intervals and plots, from stored runs.

``--pack`` first copies the runs, packed and checksummed, under ``OUT/runs/``, so that a report
committed with its runs can be re-derived from what was committed (the study does the same).
``--partial`` reports what is finished (an unfinished attack run's finished radii; other
unfinished runs are left out), naming what it leaves out. ``--compare-zoo OTHER...`` writes,
instead of the report, the findings of the zoo at OTHER tested in the zoo of the runs given
(:mod:`robust_attn.reports.across_scale`)."""
from __future__ import annotations

import argparse
import os
import shutil
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
    rep.add_argument("--pack", action="store_true",
                     help="copy each run, packed (one checksummed gzip CSV of its records), into OUT/runs/ and "
                          "report from the copies: the report can then be re-derived from OUT alone")
    rep.add_argument("--partial", action="store_true",
                     help="report what is finished: unfinished attack runs from their finished conditions (each "
                          "radius on all of its images), other unfinished runs left out; the report names what it "
                          "leaves out")
    rep.add_argument("--compare-zoo", nargs="+", metavar="OTHER",
                     help="instead of the report: test the findings of the zoo at OTHER (report folders, study runs "
                          "folders or run directories; e.g. reports/study-cifar10 reports/study-cifar10-full) again "
                          "in the zoo of RUN_DIR (the same kinds of path), each with its paired bootstrap interval, "
                          "and say which hold, flip or stay unresolved (OUT/report.md, OUT/across_scale.csv)")
    rep.set_defaults(func=run_report)


def run_report(args) -> int:
    from robust_attn.reports import make_report

    if args.compare_zoo:
        return _compare_zoos(args)
    # a study's runs folder (`--runs`, its timings.csv beside the runs) is taken as the study wrote
    # it: given whole, it stands for its runs; given as FOLDER/*, its own files are passed over
    given, args.runs = args.runs, []
    for run in given:
        path = Path(run)
        if (path / "run.json").is_file():
            args.runs.append(run)
        elif path.is_dir() and (path / "timings.csv").is_file():
            args.runs += sorted(str(p.parent) for p in path.glob("*/run.json"))
        elif not (path.parent / "timings.csv").is_file():
            args.runs.append(run)   # not a study's file: refused below
    for run in args.runs:
        if not (Path(run) / "run.json").is_file():
            raise UserError(f"{run} is not a run directory (no run.json); pass directories written by "
                            f"`robust-attn eval rotation|pgd --out DIR`")
    if args.pack and args.partial:
        raise UserError("--pack keeps finished runs only, so it does not go with --partial; report the "
                        "unfinished runs without --pack, and pack them once they finish")
    runs = _packed(args.runs, Path(args.out) / "runs") if args.pack else args.runs
    files = make_report(runs, args.out, n_boot=args.bootstrap, seed=args.seed, level=args.level,
                        plots=not args.no_plots, partial=args.partial)
    if args.pack:
        print(f"runs packed into {Path(args.out) / 'runs'}")
    print(f"report of {len(args.runs)} run(s): {len(files)} files in {args.out} (see {Path(args.out) / 'report.md'})")
    return 0


def _compare_zoos(args) -> int:
    """``--compare-zoo``: the findings of one zoo tested in another (:mod:`robust_attn.reports.across_scale`)."""
    from robust_attn.reports.across_scale import write_across_scale

    if args.pack or args.partial:
        raise UserError("--compare-zoo reads finished runs as they are: drop --pack and --partial")
    if args.level <= 0 or args.level >= 1 or args.bootstrap < 1:
        raise UserError("--level takes a confidence level in (0, 1) and --bootstrap a positive number of resamples")
    files = write_across_scale(args.compare_zoo, args.runs, args.out, n_boot=args.bootstrap, seed=args.seed,
                               level=args.level)
    print(f"findings across zoos: {len(files)} files in {args.out} (see {Path(args.out) / 'report.md'})")
    return 0


def _packed(runs: list[str], dest: Path) -> list[Path]:
    """Pack each run into ``dest/<its folder name>`` (:meth:`RunStore.pack`, which refuses an
    unfinished run); two runs with one folder name would overwrite each other, so that is an error."""
    from robust_attn.runs.store import RunStore

    names = [Path(os.path.abspath(r)).name for r in runs]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise UserError(f"--pack: runs share the folder name(s) {clash}, which would collide in {dest}; "
                        f"rename or copy them to distinct names first")
    for run in runs:   # every run checked before any is packed: a refusal leaves nothing behind
        missing = RunStore(run).missing()
        if missing:
            raise UserError(f"--pack: {run} is unfinished ({len(missing)} chunks missing); finish it (run its "
                            f"command again) before packing, or report it without --pack (--partial)")
    out, made = [], []
    try:
        for run, name in zip(runs, names):
            store = RunStore(run)
            if store.root.resolve() == (dest / name).resolve():   # already there: reporting again from OUT
                out.append(store.root)
            else:
                if not (dest / name).exists():
                    made.append(dest / name)   # removed again if a later run cannot be packed
                out.append(store.pack(dest / name).root)
    except ValueError as err:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
        raise UserError(f"--pack: {err}") from None
    return out
