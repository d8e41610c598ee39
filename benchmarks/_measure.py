"""Measurement helpers shared by the benchmark scripts: wall time and peak memory.

Peak memory on CUDA is ``torch.cuda.max_memory_allocated``. On CPU it is the growth of the
process's peak resident set (Linux ``VmHWM``) while the measured function runs, in a forked
child whose peak is reset first (``/proc/self/clear_refs``), so one measurement cannot
inflate the next. Both include every transient buffer, not only what autograd saves. The child
runs on one thread: an OpenMP pool inherited through ``fork`` from a parent that already ran
multi-threaded kernels can deadlock, and the peak of one thread's buffers is what is compared.
The child also sets glibc's mmap threshold to 64 KiB (``mallopt``), so every tensor is its own
mapping, returned to the system when freed, and first returns the free memory of malloc's heap to
the system (``malloc_trim``): memory that the parent had freed into the heap cannot be reused
unseen. (Without this, results depended on what ran before: resnet26 at width 1, batch 16,
measured anywhere from 34 to 114 MiB.)

Times of several functions compared with each other are taken interleaved
(:func:`time_interleaved_ms`: one call of each in turn, repeated), so a drift in the shared
machine's speed moves all of them alike instead of skewing their ratios. :func:`step_time_ms`
times one call the way the device calls for: process CPU time on a CPU (steadier than wall time
when other jobs share the cores), wall time between two synchronizations on CUDA (the GPU runs
asynchronously, so the host's CPU time says nothing of its work).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from robust_attn.utils.allocator import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, glibc

__all__ = ["time_ms", "time_interleaved_ms", "step_time_ms", "matmul_tf32", "json_from_fresh_process", "peak_memory_mb", "measure_layer", "run_layer_benchmark", "machine_description", "write_json"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device | str = "cpu", repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in milliseconds."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def step_time_ms(fn: Callable[[], object], device: torch.device | str = "cpu") -> tuple[float, float]:
    """``(ms, wall ms)`` of one call of ``fn``: ``ms`` is the process's CPU time on a CPU and the
    wall time from a synchronization before the call to one after it on CUDA (then both are equal)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        wall = (time.perf_counter() - start) * 1e3
        return wall, wall
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    return (time.process_time() - start_cpu) * 1e3, (time.perf_counter() - start) * 1e3


@contextlib.contextmanager
def matmul_tf32(enabled: bool):
    """``torch.backends.cuda.matmul.allow_tf32`` set to ``enabled`` inside, restored after (float32
    matmuls on CUDA round their inputs to TF32's 10-bit mantissa when it is on)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def time_interleaved_ms(fns: dict[str, Callable[[], object]], device: torch.device | str = "cpu",
                        repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median wall time (ms) of each of ``fns``, timed in turns: every round calls each once."""
    device = torch.device(device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _small_mmap_threshold() -> None:
    """Make glibc serve every allocation over 64 KiB by its own mmap, unmapped when freed, and give
    the free memory of malloc's heap back to the system (``malloc_trim``), so reusing it counts."""
    libc = glibc()
    if libc is None:  # not glibc: measure as is
        return
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    libc.mallopt(M_TRIM_THRESHOLD, 64 * 1024)
    libc.malloc_trim(0)



def json_from_fresh_process(argv: list[str]) -> dict:
    """Run ``python *argv`` in a fresh process in which glibc maps every allocation over 64 KiB on
    its own (``MALLOC_MMAP_THRESHOLD_``), and return the JSON object it prints last on stdout. For
    CPU peak memory: no other measurement's heap can hide or add memory there, while timing with
    that setting would be distorted by page faults, so time and memory are separate runs."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    done = subprocess.run([sys.executable, *argv], env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child(fn: Callable[[], object], queue) -> None:
    try:
        torch.set_num_threads(1)
        _small_mmap_threshold()
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        base = _status_kb("VmRSS")
        fn()
        queue.put((_status_kb("VmHWM") - base) / 1024)
    except Exception as err:  # report, don't hang the parent
        queue.put(err)


def peak_memory_mb(fn: Callable[[], object], device: torch.device | str = "cpu") -> float:
    """Peak memory (MiB) that ``fn()`` adds on top of what exists before it runs."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, queue))
    proc.start()
    result = queue.get()
    proc.join()
    if isinstance(result, Exception):
        raise result
    return result


def machine_description(device: torch.device | str = "cpu") -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, " \
           f"{torch.get_num_threads()} threads"


def start_one_thread(extra: str = "") -> list[str]:
    """Set one thread, print the machine and its load average (with ``extra``), return the load."""
    torch.set_num_threads(1)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"{machine_description()}; load average {' '.join(load)}{extra}")
    return load


def cifar10_test_images(root: str | os.PathLike, count: int) -> torch.Tensor:
    """The first ``count`` CIFAR-10 test images (in [0, 1]) under ``root`` (``cifar10-jpeg/``)."""
    from robust_attn.data import build_dataset

    data = build_dataset("cifar10", root=root, split="test", limit=count)
    return torch.stack([data[i][0] for i in range(len(data))])


def write_json(path: str | os.PathLike, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


def measure_layer(layer: torch.nn.Module, x: torch.Tensor, device: torch.device | str = "cpu", repeats: int = 5,
                  amp: bool = False) -> dict:
    """Forward and train-step (forward + backward of a scalar loss) time and peak memory of ``layer``
    on input ``x``; ``amp`` runs under autocast (bf16 on CPU, fp16 on CUDA)."""
    device = torch.device(device)

    def autocast():
        if not amp:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=torch.float16 if device.type == "cuda" else torch.bfloat16)

    def forward():
        with torch.no_grad(), autocast():
            layer(x)

    def train_step():
        xg = x.detach().requires_grad_()
        with autocast():
            loss = layer(xg).float().square().mean()
        loss.backward()
        layer.zero_grad(set_to_none=True)

    return {"forward_ms": time_ms(forward, device, repeats),
            "train_step_ms": time_ms(train_step, device, repeats),
            "forward_peak_mb": peak_memory_mb(forward, device),
            "train_step_peak_mb": peak_memory_mb(train_step, device)}


def run_layer_benchmark(build_layers: Callable[[int, int], dict], description: str,
                        argv: list[str] | None = None) -> tuple[argparse.Namespace, torch.device, dict]:
    """The shared driver of the per-operator benchmarks: parse the common options, then measure
    every layer of ``build_layers(channels, size)`` at an ImageNet stage (56x56) and a CIFAR stage
    (32x32) with :func:`measure_layer`. Returns the options, the device and
    ``{shape: {"batch", "size", "channels", "layers": {name: metrics}}}``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--imagenet-batch", type=int, default=8, help="batch at 56x56 (default 8)")
    parser.add_argument("--cifar-batch", type=int, default=64, help="batch at 32x32 (default 64)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--amp", action="store_true", help="run under torch.autocast")
    parser.add_argument("--skip", nargs="*", default=[], help="layer names to leave out")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    args.command = " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:]))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda given but CUDA is not available; use --device cpu")
    torch.manual_seed(0)
    results: dict[str, dict] = {}
    for shape_name, (batch, size) in {"imagenet_stage1": (args.imagenet_batch, 56),
                                      "cifar_stage1": (args.cifar_batch, 32)}.items():
        x = torch.randn(batch, args.channels, size, size, device=device)
        results[shape_name] = {"batch": batch, "size": size, "channels": args.channels, "layers": {}}
        for name, layer in build_layers(args.channels, size).items():
            if name in args.skip:
                continue
            layer.to(device).train()
            try:
                res = measure_layer(layer, x, device, args.repeats, args.amp)
            except (RuntimeError, MemoryError) as err:      # e.g. CUDA out of memory for a naive layer
                res = {"error": str(err).split("\n")[0]}
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            results[shape_name]["layers"][name] = res
            print(f"{shape_name} {name}: {res}", flush=True)
    return args, device, results
