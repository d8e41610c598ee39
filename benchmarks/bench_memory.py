"""Peak memory of every protocol, attack and check at 32, 224 and 256 px: bounded by the batch size.

Each command runs in a fresh process (``python -c`` calling ``robust_attn.cli.main``) that prints
its own peak resident set (``resource.getrusage(RUSAGE_SELF).ru_maxrss``); the peak of a process
that only imports robust-attn and builds the parser is measured the same way and subtracted
(``work_mb``: what the protocol itself added). The model is a zoo architecture at ImageNet
resolution (timm's models when timm is installed and ``--archs timm:NAME`` names them; the
default is the zoo's resnet26 and sasa_resnet26 at a small width, so that the run is feasible on a
loaded CPU), on an image folder of ``--images`` generated images, ``--batch`` images per batch. The
protocols with gradient-masking or sanity checks run with them (their default) and ``eval attack``
also without (``--no-checks``): the ratio of the two is the checks' cost in memory.

    OMP_NUM_THREADS=1 python benchmarks/bench_memory.py --out benchmarks/results/memory.json

Results: ``benchmarks/results/memory.json``; the table in ``docs/memory.md``.
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
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--out", default="benchmarks/results/memory.json")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(tmp) / "images", args.images)
        base = peak([], env)
        print(f"import and parser alone: {base['peak_mb']} MB", flush=True)
        for arch in args.archs.split(","):
            for size in map(int, args.sizes.split(",")):
                run_env = dict(env, BENCH_ARCH=arch, BENCH_SIZE=str(size), BENCH_WIDTH=args.width)
                for name in args.protocols.split(","):
                    command = list(PROTOCOLS[name])
                    model = [] if command[0] == "transfer" else ["--model", MODEL]
                    argv = ["eval", *command, *model, "--dataset", "imagefolder", "--root", str(folder), "--limit",
                            str(args.images), "--batch-size", str(args.batch), "--no-progress",
                            "--out", str(Path(tmp) / f"run-{arch}-{size}-{name.replace(' ', '_')}")]
                    result = peak(argv, run_env)
                    row = {"arch": arch, "size": size, "protocol": name, "batch": args.batch, **result}
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
    write_json(args.out, {"machine": machine_description(), "batch": args.batch, "images": args.images,
                          "width": args.width, "baseline_peak_mb": base["peak_mb"], "rows": rows})
    print(markdown(rows))


def markdown(rows: list[dict]) -> str:
    """The table of docs/memory.md: peak MB (and what the protocol added to the import's) per
    protocol, one column per architecture and size."""
    columns = list(dict.fromkeys((r["arch"], r["size"]) for r in rows))
    by = {(r["arch"], r["size"], r["protocol"]): r for r in rows}
    lines = ["| protocol | " + " | ".join(f"{a} {s} px" for a, s in columns) + " |",
             "|:--|" + "--:|" * len(columns)]
    for name in dict.fromkeys(r["protocol"] for r in rows):
        cells = []
        for a, s in columns:
            r = by.get((a, s, name), {})
            cells.append(f"{r['peak_mb']:.0f} (+{r['work_mb']:.0f})" if "peak_mb" in r else r.get("error", "-")[:40])
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
