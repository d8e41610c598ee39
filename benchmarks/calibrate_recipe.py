"""Calibrate a training recipe: train a queue of (model, width, stem, epochs) configurations one
after the other and record test accuracy against CPU time after every epoch.

    OMP_NUM_THREADS=1 python benchmarks/calibrate_recipe.py --out /work/runs/calib \\
        --queue benchmarks/calibration_queue.toml --data-root /work/data

The queue file lists the recipe and the runs::

    recipe = "zoo/recipes/cifar10_efficient.toml"
    [[run]]
    model = "resnet26"
    width = 0.25
    stem = 2
    epochs = 10
    [[run]]                       # an ablation: recipe overrides, and a tag naming the run
    model = "resnet26"
    width = 0.25
    stem = 2
    epochs = 10
    tag = "fp32"
    overrides = ["runtime.amp=none", "runtime.channels_last=false"]

Each run trains ``robust-attn train RECIPE model=M model_args.width=W model_args.stem_downsample=S
epochs=E`` into ``OUT/<M>_w<W>_s<S>_e<E>[_<tag>]/``; a run with a final ``model.safetensors`` is skipped, a
run with an epoch checkpoint resumes, so rerunning the same command after a kill continues where
it stopped. Next to the trainer's files each run gets ``progress.csv``: per epoch the test
top-1, the wall and CPU seconds of the epoch (training and the test-set evaluation, this process's
``time.process_time``) and the cumulative CPU seconds over all invocations. CPU time rather than
wall time is the cost because the machine is shared: with one thread, CPU seconds are what the run
would take alone (up to cache contention). ``--threads`` sets torch's thread count (default 1).

Several workers may share one queue (the same command, started again in another shell): a worker
claims a run with ``OUT/<run>/worker.lock`` (its process id and start time) and the others pass over
a run whose lock names a live process, so each run trains in one process at a time. A lock left by
a killed worker names a dead process and is taken over.

``benchmarks/plot_calibration.py`` turns the progress files into a CSV and a plot.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import re
import sys
import time
from pathlib import Path

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROGRESS_COLUMNS = ["epoch", "test_top1", "train_loss", "epoch_wall_s", "epoch_cpu_s", "cum_cpu_s"]
_EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+): ")  # the trainer's line after an epoch's checkpoint


def run_name(run: dict) -> str:
    """``<model>_w<width>_s<stem>_e<epochs>``, then ``_<tag>`` for a run with recipe overrides."""
    name = f"{run['model']}_w{run['width']:g}_s{run['stem']}_e{run['epochs']}"
    return name + (f"_{run['tag']}" if run.get("tag") else "")


def read_queue(path: Path) -> tuple[str, list[dict]]:
    """The recipe path (relative to the repository root or absolute) and the list of runs."""
    raw = tomllib.loads(path.read_text())
    unknown = set(raw) - {"recipe", "run"}
    if unknown or "recipe" not in raw or not raw.get("run"):
        raise SystemExit(f"{path}: a queue has `recipe = PATH` and [[run]] tables (unknown: {sorted(unknown)})")
    runs = []
    for i, run in enumerate(raw["run"]):
        missing = {"model", "width", "stem", "epochs"} - set(run)
        extra = set(run) - {"model", "width", "stem", "epochs", "overrides", "tag"}
        if missing or extra or bool(run.get("overrides")) != bool(run.get("tag")):
            raise SystemExit(f"{path}: run {i + 1} needs model, width, stem, epochs, and a tag exactly when it has "
                             f"overrides; missing {sorted(missing)}, unknown {sorted(extra)}")
        runs.append(dict(run, overrides=list(run.get("overrides", []))))
    return raw["recipe"], runs


def read_progress(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open() as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def write_progress(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=PROGRESS_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (int(row[k]) if k == "epoch" else row[k]) for k in PROGRESS_COLUMNS})
    tmp.replace(path)


def _process_identity(pid: int) -> str | None:
    """``PID:START`` with the process's start time in clock ticks since boot (/proc/PID/stat), or
    None for a process that does not exist: a process id reused after a kill has another start."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{pid}:{stat.rsplit(')', 1)[1].split()[19]}"  # field 22; the name in () may hold spaces


@contextlib.contextmanager
def claim(out: Path):
    """Yield True while this process holds ``out/worker.lock``, False when a live other process
    holds it (a lock naming a dead process is replaced). The lock is removed on leaving."""
    out.mkdir(parents=True, exist_ok=True)
    lock = out / "worker.lock"
    me = _process_identity(os.getpid())
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            holder = lock.read_text().strip() if lock.is_file() else ""
            pid = int(holder.split(":")[0]) if holder.split(":")[0].isdigit() else -1
            if holder and holder != me and _process_identity(pid) == holder:
                yield False
                return
            lock.unlink(missing_ok=True)  # stale: its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me)
        try:
            yield True
        finally:
            lock.unlink(missing_ok=True)
        return
    raise RuntimeError(f"{lock}: could not be claimed (another worker took it over at the same time?)")


def train_one(recipe_path: Path, run: dict, out_root: Path, data_root: str | None) -> None:
    from robust_attn.train import load_recipe

    name = run_name(run)
    out = out_root / name
    if (out / "model.safetensors").is_file():
        print(f"[calibrate] {name}: finished, skipped", flush=True)
        return
    overrides = [f"model={run['model']}", f"model_args.width={run['width']}",
                 f"model_args.stem_downsample={run['stem']}", f"epochs={run['epochs']}", *run["overrides"]]
    if data_root:
        overrides.append(f"data.root=\"{data_root}\"")
    recipe = load_recipe(recipe_path, overrides)
    with claim(out) as mine:
        if not mine:
            print(f"[calibrate] {name}: running in another worker ({(out / 'worker.lock').read_text()}), passed over",
                  flush=True)
            return
        if (out / "model.safetensors").is_file():  # finished by another worker since the check above
            print(f"[calibrate] {name}: finished, skipped", flush=True)
            return
        _train_claimed(recipe, name, out, overrides)


def _train_claimed(recipe, name: str, out: Path, overrides: list[str]) -> None:
    from robust_attn.train import train
    from robust_attn.train.checkpoints import latest_checkpoint

    resume = latest_checkpoint(out) is not None
    progress_path = out / "progress.csv"
    rows = read_progress(progress_path) if resume else []
    clock = {"cpu": time.process_time(), "wall": time.perf_counter()}

    def log(message: str) -> None:
        print(f"[{name}] {message}", flush=True)
        match = _EPOCH_LINE.match(message)
        if not match:
            return
        cpu, wall = time.process_time(), time.perf_counter()
        with (out / "metrics.csv").open() as f:  # written just before the line
            metrics = list(csv.DictReader(f))[-1]
        epoch = int(metrics["epoch"])
        del rows[epoch - 1:]  # an epoch logged before a kill and trained again after the resume
        previous = rows[-1]["cum_cpu_s"] if rows else 0.0
        rows.append({"epoch": epoch, "test_top1": float(metrics["eval_top1"]),
                     "train_loss": float(metrics["train_loss"]),
                     "epoch_wall_s": wall - clock["wall"], "epoch_cpu_s": cpu - clock["cpu"],
                     "cum_cpu_s": previous + cpu - clock["cpu"]})
        write_progress(progress_path, rows)
        clock.update(cpu=cpu, wall=wall)

    print(f"[calibrate] {name}: {'resuming' if resume else 'starting'} ({' '.join(overrides)})", flush=True)
    train(recipe, out, resume=resume, progress=False, log=log)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queue", default=str(Path(__file__).resolve().parent / "calibration_queue.toml"))
    p.add_argument("--out", required=True, help="folder of the runs (outside git until they are finished)")
    p.add_argument("--data-root", default=None, help="data.root for the recipe (e.g. /work/data)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", nargs="*", default=None, help="run only these run names")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    queue = Path(args.queue)
    recipe, runs = read_queue(queue)
    recipe_path = Path(recipe)
    if not recipe_path.is_absolute():
        recipe_path = Path(__file__).resolve().parents[1] / recipe_path
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    for run in runs:
        if args.only and run_name(run) not in args.only:
            continue
        train_one(recipe_path, run, out_root, args.data_root)
    print("[calibrate] queue done", flush=True)


if __name__ == "__main__":
    main()
