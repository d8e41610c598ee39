"""What a record was computed with, finer than the device type: float rounding differs between machines.

Two runs of the same code, weights, images and seeds agree bit for bit on one machine but not
always across machines: ATen and oneDNN pick their kernels by the CPU's instruction set, and the
CPU kernels are built with ``-march=native`` (:mod:`robust_attn.layers.cpu_kernels`), so a
borderline image can go another way (measured: the Fashion-MNIST study's AutoAttack run of
sasa_resnet26 at 8/255, computed on another machine two days earlier, differs from a run here in
the margins of 88 of 1,000 images and the prediction of 3, while the study's own commit run
again here reproduces today's run on every field). Each record chunk therefore names its
hardware (:meth:`robust_attn.runs.store.RunStore.write_chunk`): the CPU's kernel level as PyTorch
dispatches it, a short hash of the CPU's model and flags, and the threads; or the GPU's name.
"""
from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path

__all__ = ["cpu_fingerprint", "cpu_name", "hardware_label", "native_bf16"]


@functools.lru_cache(maxsize=None)
def _cpuinfo_lines() -> tuple[str, ...] | None:
    """The lines of ``/proc/cpuinfo``, or None where there is no such file."""
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return None


def cpu_name() -> str:
    """This CPU's model name (``AMD EPYC ...``), or the platform's processor name where
    ``/proc/cpuinfo`` names none."""
    for ln in _cpuinfo_lines() or ():
        if ln.startswith("model name"):
            return ln.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def cpu_fingerprint() -> str:
    """Short hash of this CPU's model name and instruction-set flags (the first of each in
    ``/proc/cpuinfo``; elsewhere the processor and machine names)."""
    info = _cpuinfo_lines()
    if info is None:
        lines = [platform.processor(), platform.machine()]
    else:
        lines = [ln for ln in info if ln.startswith(("model name", "flags"))][:2]
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:10]


def hardware_label(device: str) -> str:
    """``cpu AVX512 96ccc860eb 1 thread`` for a CPU process (PyTorch's CPU capability, the CPU's
    fingerprint, ``torch.get_num_threads()``), ``cuda NVIDIA H200`` for a GPU one (the current
    device's name); the device type alone for anything else."""
    import torch   # here, so that the results store imports without torch

    kind = str(device).split(":")[0]
    if kind == "cpu":
        threads = torch.get_num_threads()
        return (f"cpu {torch.backends.cpu.get_cpu_capability()} {cpu_fingerprint()} "
                f"{threads} thread{'s' if threads != 1 else ''}")
    if kind == "cuda" and torch.cuda.is_available():
        return f"cuda {torch.cuda.get_device_name()}"
    return kind


def native_bf16(device) -> bool:
    """Whether ``device`` computes bf16 in hardware: a CUDA GPU that supports it, or a CPU with
    AVX512-BF16 or AMX (Intel since Cooper Lake and Sapphire Rapids, AMD since Zen 4). Elsewhere
    PyTorch emulates bf16 on the CPU, and autocast is far slower than float32: resnet26's training
    step 8.5x (its FGSM step 9.7x) on an AVX2-only EPYC (benchmarks/results/calibration/options_avx2.json)."""
    import torch

    kind = str(device).split(":")[0]
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False
