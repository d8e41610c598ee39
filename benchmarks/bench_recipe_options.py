"""CPU seconds of one training step under the recipe's runtime options, side by side: fp32 against
bf16 autocast, channels-last, the stem's downsampling and the width, for one or more models.

    OMP_NUM_THREADS=1 python benchmarks/bench_recipe_options.py --models resnet26 --batch 256
    OMP_NUM_THREADS=1 python benchmarks/bench_recipe_options.py --methods none fgsm pgd trades  # adversarial
    OMP_NUM_THREADS=1 python benchmarks/bench_recipe_options.py --models san10_pairwise sasa_resnet26 \
        --amps none bf16 bf16-half --channels-last yes --batch 128   # SAN/SASA under autocast
    OMP_NUM_THREADS=1 python benchmarks/bench_recipe_options.py --models gsa_resnet26 --amps bf16 \
        --channels-last yes --compile no yes                           # torch.compile (runtime.compile)

The cost is this process's CPU time (``time.process_time``), not wall time: on a machine shared with
other jobs, one thread's CPU seconds are what the step costs alone (up to cache contention), while
wall time depends on the load. The variants are timed in turns (one step of each per round, median
over ``--repeats`` rounds, after one warm-up round). Writes ``--out`` (JSON) and prints a table with
images per CPU second and the ratio to the first variant of each model.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from robust_attn.layers import precision  # noqa: E402
from robust_attn.models.registry import create_model  # noqa: E402
from robust_attn.train.adversarial import adversarial_loss  # noqa: E402
from robust_attn.train.recipe import AdversarialConfig  # noqa: E402
from robust_attn.utils.hardware import cpu_name, hardware_label, native_bf16  # noqa: E402


@contextlib.contextmanager
def _half_attention_autocast():
    """bf16 autocast with SAN's and SASA's operators in bf16 too (what a GPU's autocast does; on a
    CPU they run in float32 by default, robust_attn/layers/precision.py)."""
    saved = precision.CPU_AUTOCAST_FLOAT32
    precision.CPU_AUTOCAST_FLOAT32 = False
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    finally:
        precision.CPU_AUTOCAST_FLOAT32 = saved


def make_step(name: str, width: float, stem: int, amp: str, channels_last: bool, batch: int, method: str = "none",
              compiled: bool = False):
    torch.manual_seed(0)
    model = create_model(name, 10, "cifar", width=width, stem_downsample=stem)
    images = torch.rand(batch, 3, 32, 32)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (batch,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.2)

    autocast = {"none": contextlib.nullcontext, "bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                "bf16-half": lambda: _half_attention_autocast()}[amp]
    adversarial = AdversarialConfig(method=method) if method != "none" else None
    forward = torch.compile(model) if compiled else model  # as the trainer's runtime.compile

    def step() -> float:
        start = time.process_time()
        if adversarial is not None:  # the trainer's adversarial step (8/255, the method's defaults)
            loss = adversarial_loss(adversarial, forward, model, criterion, images, labels, adversarial.eps, 0, autocast)
        else:
            with autocast():
                loss = criterion(forward(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return time.process_time() - start

    return step


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["resnet26"])
    p.add_argument("--widths", nargs="+", type=float, default=[0.25])
    p.add_argument("--stems", nargs="+", type=int, default=[2])
    p.add_argument("--amps", nargs="+", choices=["none", "bf16", "bf16-half"], default=["none", "bf16"],
                   help="bf16: autocast, SAN's and SASA's operators in float32 (the default on a CPU); "
                        "bf16-half: those operators in bf16 too")
    p.add_argument("--channels-last", nargs="+", choices=["no", "yes"], default=["no"])
    p.add_argument("--methods", nargs="+", choices=["none", "fgsm", "pgd", "trades"], default=["none"],
                   help="training method: standard or adversarial (robust_attn.train.adversarial)")
    p.add_argument("--compile", nargs="+", choices=["no", "yes"], default=["no"],
                   help="torch.compile of the training forward (runtime.compile); the first step, which "
                        "compiles, is reported as compile_cpu_s")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    variants = list(itertools.product(args.models, args.widths, args.stems, args.amps, args.channels_last,
                                      args.methods, args.compile))
    steps = {v: make_step(*v[:4], v[4] == "yes", args.batch, v[5], v[6] == "yes") for v in variants}
    times: dict = {v: [] for v in variants}
    first_step: dict = {}
    for round_ in range(args.repeats + 1):
        for v in variants:
            seconds = steps[v]()
            if round_:  # the first round warms up (and compiles)
                times[v].append(seconds)
            else:
                first_step[v] = seconds
    rows = []
    first: dict = {}
    print(f"{'model':16s} {'width':>5s} {'stem':>4s} {'amp':>9s} {'cl':>3s} {'method':>6s} {'comp':>4s} {'cpu s/step':>10s} "
          f"{'img/cpu-s':>9s} {'ratio':>6s} {'epoch cpu-min':>13s} {'first step s':>12s}")
    for v in variants:
        median = statistics.median(times[v])
        first.setdefault(v[0], median)
        row = {"model": v[0], "width": v[1], "stem": v[2], "amp": v[3], "channels_last": v[4] == "yes", "method": v[5],
               "compile": v[6] == "yes", "first_step_cpu_s": first_step[v], "cpu_s_per_step": median, "images_per_cpu_s": args.batch / median,
               "ratio_to_first": median / first[v[0]], "epoch_cpu_minutes_50k": 50000 / (args.batch / median) / 60}
        rows.append(row)
        print(f"{v[0]:16s} {v[1]:5g} {v[2]:4d} {v[3]:>9s} {v[4]:>3s} {v[5]:>6s} {v[6]:>4s} {median:10.3f} "
              f"{row['images_per_cpu_s']:9.1f} {row['ratio_to_first']:6.2f} {row['epoch_cpu_minutes_50k']:13.1f} "
              f"{first_step[v]:12.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "batch": args.batch,
                                              "threads": args.threads, "repeats": args.repeats,
                                              "torch": torch.__version__, "machine": cpu_name(),
                                              "hardware": hardware_label("cpu"), "native_bf16": native_bf16("cpu"),
                                              "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
