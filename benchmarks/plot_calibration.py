"""Test accuracy against CPU-hours from the runs of ``benchmarks/calibrate_recipe.py``: one CSV
row per run and epoch, and a plot with one line per run (the end of a run, where its learning rate
reaches 0, is marked: a run's intermediate epochs are not what a shorter run would reach).

    python benchmarks/plot_calibration.py --runs /work/runs/calib \\
        --out benchmarks/results/calibration/cifar10_efficient

writes ``OUT.csv`` and ``OUT.png``, and prints each run's last epoch. ``--zoo TAG`` plots the
training logs of the zoo's entries named ``<architecture>-TAG`` instead (their ``log`` in
``zoo/manifest.json``: the trainer's metrics.csv), against epochs rather than CPU-hours (the entries
were trained on different machines, and a log written before the trainer recorded ``epoch_cpu_s``
has none: its CSV cells are left empty):

    python benchmarks/plot_calibration.py --zoo efficient --out benchmarks/results/calibration/zoo_efficient
"""
from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

COLUMNS = ["run", "model", "width", "stem", "epochs", "tag", "finished", "epoch", "test_top1", "epoch_cpu_s",
           "cum_cpu_hours"]
_NAME = re.compile(r"^(?P<model>.+)_w(?P<width>[0-9.]+)_s(?P<stem>\d+)_e(?P<epochs>\d+)(?:_(?P<tag>.+))?$")


def collect(runs: Path) -> list[dict]:
    rows = []
    for progress in sorted(runs.glob("*/progress.csv")):
        match = _NAME.match(progress.parent.name)
        if not match:
            continue
        finished = (progress.parent / "model.safetensors").is_file()
        with progress.open() as f:
            for row in csv.DictReader(f):
                rows.append({"run": progress.parent.name, "model": match["model"], "width": float(match["width"]),
                             "stem": int(match["stem"]), "epochs": int(match["epochs"]), "tag": match["tag"] or "",
                             "finished": finished, "epoch": int(row["epoch"]), "test_top1": float(row["test_top1"]),
                             "epoch_cpu_s": float(row["epoch_cpu_s"]),
                             "cum_cpu_hours": float(row["cum_cpu_s"]) / 3600})
    return rows


def collect_zoo(manifest: Path, tag: str) -> list[dict]:
    """The rows of :func:`collect` from the training logs of the manifest's entries named
    ``<architecture>-TAG`` (run: the entry's name; width and stem from its architecture's overrides)."""
    entries = json.loads(manifest.read_text())["models"]
    rows = []
    named = (e for e in entries if e["name"] == f"{e.get('arch', {}).get('name')}-{tag}" and e.get("log"))
    for entry in sorted(named, key=lambda e: e["name"]):
        overrides = entry.get("arch", {}).get("overrides", {})
        with (manifest.parent / entry["log"]).open() as f:
            log = list(csv.DictReader(f))
        cum = 0.0
        for row in log:
            cpu = float(row["epoch_cpu_s"]) if row.get("epoch_cpu_s") else None
            cum = cum + cpu if cpu is not None and cum is not None else None
            rows.append({"run": entry["name"], "model": entry["arch"]["name"],
                         "width": float(overrides.get("width", 1.0)), "stem": int(overrides.get("stem_downsample", 1)),
                         "epochs": len(log), "tag": "zoo", "finished": True, "epoch": int(row["epoch"]),
                         "test_top1": float(row["eval_top1"]), "epoch_cpu_s": cpu,
                         "cum_cpu_hours": cum / 3600 if cum is not None else None})
    return rows


def plot(rows: list[dict], path: Path, title: str, x: str = "cum_cpu_hours") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    runs = sorted({r["run"] for r in rows})
    for run in runs:
        mine = [r for r in rows if r["run"] == run]
        style = "-" if mine[0]["model"] == "resnet26" else "--"
        line, = ax.plot([r[x] for r in mine], [r["test_top1"] for r in mine], style, marker=".", label=run)
        last = mine[-1]
        if last["epoch"] == last["epochs"]:
            ax.plot([last[x]], [last["test_top1"]], "o", ms=9, mfc="none", color=line.get_color())
    ax.axhline(90, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("CPU-hours (one thread; training and per-epoch test evaluation)" if x == "cum_cpu_hours" else "epoch")
    ax.set_ylabel("CIFAR-10-JPEG test top-1 (%)")
    ax.set_ylim(50, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--runs", help="the calibration runs' folder (benchmarks/calibrate_recipe.py --out)")
    source.add_argument("--zoo", metavar="TAG", help="the zoo entries named <architecture>-TAG (e.g. efficient)")
    p.add_argument("--manifest", default=str(Path(__file__).resolve().parents[1] / "zoo" / "manifest.json"),
                   help="with --zoo (default: the repository's zoo/manifest.json)")
    p.add_argument("--out", required=True, help="path without suffix: OUT.csv and OUT.png are written")
    args = p.parse_args(argv)
    if args.zoo:
        rows = collect_zoo(Path(args.manifest), args.zoo)
        title, x = f"the zoo's <architecture>-{args.zoo} entries: test accuracy after each epoch", "epoch"
        if not rows:
            raise SystemExit(f"no entry named <architecture>-{args.zoo} with a training log in {args.manifest}")
    else:
        rows = collect(Path(args.runs))
        title, x = "cifar10_efficient.toml: accuracy against cost (circle: end of the schedule)", "cum_cpu_hours"
        if not rows:
            raise SystemExit(f"no progress.csv under {args.runs}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out.with_suffix(".png"), title, x)
    for run in sorted({r["run"] for r in rows}):
        last = [r for r in rows if r["run"] == run][-1]
        print(json.dumps({k: last[k] for k in ("run", "epoch", "epochs", "test_top1", "cum_cpu_hours")}))


if __name__ == "__main__":
    main()
