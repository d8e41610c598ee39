"""``robust-attn status DIR...``: how far stored runs are. Per run: the chunks written of those
its description asks for (the rest are what running its command again computes) and, for a chunk
under way, the state an attack saved within it (AutoAttack: the members finished, the images
still robust, where the member under way stands, and when that was saved), and the compute time its
chunks recorded, summed over every resumed call. An unfinished run
also gives the top-1 of each condition it has finished (from its records, checksums verified), so
a run that takes days shows its first numbers as they land. Every record file is checked against
its checksum: a damaged run says so, with the files and the fix, and the exit status is 1. A folder of runs (a
study's ``--runs``) stands for each run in it; when anything is unfinished, the last line gives the
``robust-attn report ... --partial`` command that reports what is finished. Reads only; safe
beside the processes writing."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from robust_attn.cli import UserError

__all__ = ["add_parser", "run_status", "run_lines"]

SHOWN = 4   # missing chunks named per run
FINISHED = "finished"   # in a run's first line when nothing is left to compute
DAMAGED = "damaged"     # in a run's first line when a record file does not match its checksum
COMPUTE_TIME = ", compute time "   # ends a run's first line where its chunks recorded their seconds


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="how far stored runs are: chunks written, attack state saved within a chunk")
    p.add_argument("runs", nargs="+", metavar="DIR", help="run directories, or folders of them (a study's --runs)")
    p.set_defaults(func=run_status)


def _run_dirs(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if (p / "run.json").is_file():
            out.append(p)
        elif p.is_dir() and any((c / "run.json").is_file() for c in p.iterdir()):
            out.extend(sorted(c for c in p.iterdir() if (c / "run.json").is_file()))
        else:
            raise UserError(f"{p} is neither a run directory (no run.json) nor a folder of runs; pass what "
                            f"`robust-attn eval ... --out` or `robust-attn study --runs` wrote")
    return out


def run_lines(run: Path) -> list[str]:
    """The status of one run, as lines (the first names the run)."""
    import torch

    from robust_attn.attacks.base import make_attack
    from robust_attn.protocols.attack import STATE_DIR, config_from_condition, saved_states
    from robust_attn.runs.eta import eta_line
    from robust_attn.runs.store import RunStore, condition_definitions, damaged_message

    store = RunStore(run)
    desc = store.description()
    head = f"{run}: {desc.get('protocol', '?')}, {desc.get('model', '?')}"
    problems = [(path, why) for path, why in store.verify() if why != "deleted"]   # deleted: a repair under way
    damage = [f"  {DAMAGED}: {damaged_message(run, problems, store.packed)}"] if problems else []
    spent = "" if problems else _compute_time(store)
    if store.packed:
        return [f"{head}: {DAMAGED} (packed)" if problems else f"{head}: {FINISHED} (packed){spent}"] + damage
    missing = store.missing()
    total = len(store.chunks()) + len(missing)
    lines = [f"{head}: {total - len(missing)} of {total} chunks written"
             + (f", {DAMAGED}" if problems else "" if missing else f" ({FINISHED})") + spent] + damage
    if missing:
        named = ", ".join(f"{c}[{a}:{b}]" for c, a, b in missing[:SHOWN])
        lines.append(f"  to compute: {named}" + (f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""))
        if not problems:
            lines.extend(_finished_lines(store, missing))
            lines.extend(line for line in [eta_line(store, missing)] if line)
    conditions = condition_definitions(desc)
    for name, start, path in saved_states(run / STATE_DIR):
        saved = time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime))
        attack = make_attack(config_from_condition(conditions[name])) if name in conditions else None
        if attack is None or not hasattr(attack, "describe_state"):
            lines.append(f"  {name}[{start}:]: a saved state ({saved})")
            continue
        state = torch.load(path, map_location="cpu", weights_only=True)
        lines.append(f"  {name}[{start}:]: {attack.describe_state(state)} (saved {saved})")
    return lines


def _compute_time(store) -> str:
    """``, compute time H h`` (hours, two decimals) from the chunks' manifest entries, summed over every resumed call
    (:meth:`~robust_attn.runs.store.RunStore.compute_time`); ``""`` when no chunk recorded one."""
    spent = store.compute_time()
    if not spent.get("timed"):
        return ""
    seconds = spent["seconds"]
    partial = "" if spent["timed"] == spent["chunks"] else \
        f" (the {spent['timed']} of {spent['chunks']} chunks written that recorded it)"
    return f"{COMPUTE_TIME}{seconds / 3600:.2f} h{partial}"


def _finished_lines(store, missing) -> list[str]:
    """``top-1 of the finished conditions: NAME X% (N images), ...`` over the conditions with every
    chunk written (:meth:`~robust_attn.runs.store.RunStore.finished_records`); a line naming the
    problem where the records cannot be read (damaged, overlapping)."""
    try:
        records, _ = store.finished_records(missing)
    except ValueError as err:   # DamagedRecordsError included: say so, status never computes from it
        return [f"  records unreadable: {str(err).splitlines()[0]}"]
    if "top1" not in records.columns:
        return []
    done = records.groupby("condition", sort=False)["top1"]
    shown = [f"{name} {100 * top1.mean():.1f}% ({len(top1)} images)" for name, top1 in done]
    return [f"  top-1 of the finished conditions: {', '.join(shown)}"] if shown else []


def run_status(args) -> int:
    """Prints each run's lines; exit status 1 when a run is damaged, else 0."""
    unfinished = damaged = False
    for run in _run_dirs(args.runs):
        lines = run_lines(run)
        state = lines[0].split(COMPUTE_TIME)[0]
        damaged |= state.endswith((f", {DAMAGED}", f"{DAMAGED} (packed)"))
        unfinished |= not state.endswith((f"({FINISHED})", f"{FINISHED} (packed)"))
        print("\n".join(lines))
    if unfinished and not damaged:   # a folder of runs is given to the report as FOLDER/*
        runs = " ".join(p if (Path(p) / "run.json").is_file() else f"{p}/*" for p in args.runs)
        print(f"what is finished, with intervals and paired comparisons: robust-attn report {runs} "
              f"--out DIR --partial")
    return 1 if damaged else 0
