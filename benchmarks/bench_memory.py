"""Peak memory of every protocol, attack and check at 32, 224 and 256 px: bounded by the batch size.

Each command runs in a fresh process (``python -c`` calling ``robust_attn.cli.main``) that prints
its own peak resident set (``resource.getrusage(RUSAGE_SELF).ru_maxrss``); the peak of a process
that only imports robust-attn and builds the parser is measured the same way and subtracted
(``work_mb``: what the protocol itself added). The model is a zoo architecture at ImageNet
resolution (timm's models when timm is installed and ``--archs timm:NAME`` names them; the
default is the zoo's resnet26 and sasa_resnet26 at a small width, so that the run is feasible on a
loaded CPU), on an image folder of ``--images`` generated images (default: two batches), ``--batch``
images per batch (a comma list measures each). The protocols with gradient-masking or sanity checks
run with them (their default) and ``eval attack`` also without (``--no-checks``): the ratio of the
two is the checks' cost in memory. With two or more batch sizes the script fits each
(architecture, size, protocol) line ``peak = fixed + per_image * batch`` through the smallest and the
largest batch, and says which batch fits a budget of ``--budget-mb`` of peak resident set (the study's
default batch sizes at ImageNet resolution come from it, :mod:`robust_attn.study.batches`).

    OMP_NUM_THREADS=1 python benchmarks/bench_memory.py --out benchmarks/results/memory.json
    OMP_NUM_THREADS=1 python benchmarks/bench_memory.py --archs resnet26,san10_pairwise --width 1 --sizes 224 \
        --batch 2,8 --images 1 --protocols rotation,pgd,"attack apgd-ce --no-checks" --out benchmarks/results/memory_224.json

Results: ``benchmarks/results/memory.json`` and ``memory_224.json``; the tables in ``docs/memory.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import machine_description, write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = f"{REPO / 'benchmarks' / '_memory_model.py'}:build"
PEAK = ("import json, resource, sys; from robust_attn.cli import main, build_parser; "
        "code = main(sys.argv[1:]) if sys.argv[1:] else (build_parser(), 0)[1]; "
        "print(json.dumps({'code': code, 'maxrss_kb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))")

PROTOCOLS = {
    "rotation": ["rotation", "--angle-step", "0"],
    "pgd": ["pgd", "--eps", "8/255", "--steps", "2"],
    "attack apgd-ce": ["attack", "--attack", "apgd-ce", "--steps", "2"],
    "attack apgd-ce --no-checks": ["attack", "--attack", "apgd-ce", "--steps", "2", "--no-checks"],
    "attack autoattack": ["attack", "--attack", "autoattack", "--steps", "2", "--queries", "20"],
    "transfer": ["transfer", "--source", MODEL, "--target", MODEL, "--steps", "2"],
    "corruption": ["corruption", "--corruptions", "gaussian_noise,glass_blur", "--severities", "3"],
    "occlusion": ["occlusion", "--areas", "25", "--drop", "50"],
    "shuffle": ["shuffle"],
}


def make_folder(root: Path, images: int, size: int = 288) -> Path:
    import numpy as np
    from PIL import Image

    gen = np.random.default_rng(0)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range((images + 1) // 2):
            Image.fromarray(gen.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(root / c / f"{i}.png")
    return root


def peak(argv: list[str], env: dict) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK, *argv], capture_output=True, text=True, env=env, cwd=REPO)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}",
                "seconds": round(seconds, 1)}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"peak_mb": round(result["maxrss_kb"] / 1024, 1), "seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="resnet26,sasa_resnet26", help="zoo names or timm:NAME, comma list")
    parser.add_argument("--sizes", default="32,224,256")
    parser.add_argument("--width", default="0.25")
    parser.add_argument("--batch", default="4", help="images per batch, a comma list measures each")
    parser.add_argument("--images", type=int, default=None,
                        help="images per run, at least one batch (default: two batches)")
    parser.add_argument("--budget-mb", type=float, default=6144.0,
                        help="peak resident set a default batch must stay under (8 GB less the system's share)")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--out", default="benchmarks/results/memory.json")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(tmp) / "images", max(images(args.images, b) for b in batches))
        base = peak([], env)
        print(f"import and parser alone: {base['peak_mb']} MB", flush=True)
        for arch in args.archs.split(","):
            for size in map(int, args.sizes.split(",")):
                run_env = dict(env, BENCH_ARCH=arch, BENCH_SIZE=str(size), BENCH_WIDTH=args.width)
                for batch in batches:
                    for name in args.protocols.split(","):
                        command = list(PROTOCOLS[name])
                        model = [] if command[0] == "transfer" else ["--model", MODEL]
                        argv = ["eval", *command, *model, "--dataset", "imagefolder", "--root", str(folder), "--limit",
                                str(images(args.images, batch)), "--batch-size", str(batch), "--no-progress",
                                "--out", str(Path(tmp) / f"run-{arch}-{size}-{batch}-{name.replace(' ', '_')}")]
                        result = peak(argv, run_env)
                        row = {"arch": arch, "size": size, "protocol": name, "batch": batch, **result}
                        if "peak_mb" in result:
                            row["work_mb"] = round(result["peak_mb"] - base["peak_mb"], 1)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    for arch in args.archs.split(","):
        for size in map(int, args.sizes.split(",")):
            mine = {r["protocol"]: r for r in rows if r["arch"] == arch and r["size"] == size}
            a, b = mine.get("attack apgd-ce", {}), mine.get("attack apgd-ce --no-checks", {})
            if "peak_mb" in a and "peak_mb" in b:
                print(f"{arch} {size} px: apgd-ce with checks / --no-checks peak = {a['peak_mb'] / b['peak_mb']:.2f}x")
    fits = fit_batches(rows, args.budget_mb) if len(batches) > 1 else []
    for fit in fits:
        print(f"{fit['arch']} {fit['size']} px {fit['protocol']}: {fit['fixed_mb']:.0f} MB + {fit['per_image_mb']:.1f} MB "
              f"per image; {fit['fits_budget']} images fit {args.budget_mb:.0f} MB")
    write_json(args.out, {"command": " ".join(["python", "benchmarks/bench_memory.py", *sys.argv[1:]]),
                          "machine": machine_description(), "batches": batches, "images": args.images,
                          "width": args.width, "baseline_peak_mb": base["peak_mb"], "budget_mb": args.budget_mb,
                          "rows": rows, **({"fits": fits} if fits else {})})
    print(markdown(rows))


def images(given: int | None, batch: int) -> int:
    """Images per run: ``given`` (at least one batch), else two batches."""
    return 2 * batch if given is None else max(given, batch)


def fit_batches(rows: list[dict], budget_mb: float) -> list[dict]:
    """Per (architecture, size, protocol): the line through its peaks at the smallest and the
    largest batch (``fixed_mb + per_image_mb * batch``) and the largest batch under ``budget_mb``."""
    fits = []
    for key in dict.fromkeys((r["arch"], r["size"], r["protocol"]) for r in rows):
        points = sorted((r["batch"], r["peak_mb"]) for r in rows if (r["arch"], r["size"], r["protocol"]) == key
                        and "peak_mb" in r)
        if len(points) < 2 or points[0][0] == points[-1][0]:
            continue
        (b0, p0), (b1, p1) = points[0], points[-1]
        per_image = max((p1 - p0) / (b1 - b0), 1e-9)
        fixed = p0 - per_image * b0
        fits.append({"arch": key[0], "size": key[1], "protocol": key[2], "fixed_mb": round(fixed, 1),
                     "per_image_mb": round(per_image, 2), "fits_budget": max(int((budget_mb - fixed) // per_image), 0)})
    return fits


def markdown(rows: list[dict]) -> str:
    """The table of docs/memory.md: peak MB (and what the protocol added to the import's) per
    protocol, one column per architecture and size."""
    several = len({r["batch"] for r in rows}) > 1
    columns = list(dict.fromkeys((r["arch"], r["size"], r["batch"]) for r in rows))
    by = {(r["arch"], r["size"], r["batch"], r["protocol"]): r for r in rows}
    lines = ["| protocol | " + " | ".join(f"{a} {s} px" + (f" batch {b}" if several else "") for a, s, b in columns)
             + " |", "|:--|" + "--:|" * len(columns)]
    for name in dict.fromkeys(r["protocol"] for r in rows):
        cells = []
        for a, s, b in columns:
            r = by.get((a, s, b, name), {})
            cells.append(f"{r['peak_mb']:.0f} (+{r['work_mb']:.0f})" if "peak_mb" in r else r.get("error", "-")[:40])
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
