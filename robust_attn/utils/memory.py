"""Out-of-memory errors said in one line with a batch size to try.

``MemoryError`` (Python), ``torch.cuda.OutOfMemoryError`` and the CPU allocator's
``RuntimeError`` ("can't allocate memory") all mean that the images of one batch, with their
activations and gradients, did not fit. Every protocol, attack and check runs the model on at most
``--batch-size`` images at a time, so the peak shrinks with it (``benchmarks/bench_memory.py``
measures it per protocol); the message names a quarter of the batch size that failed.
"""
from __future__ import annotations

__all__ = ["is_out_of_memory", "out_of_memory_message", "smaller_batch"]

_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory")


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` says memory ran out (Python's, CUDA's or the CPU allocator's error)."""
    if isinstance(err, MemoryError):
        return True
    try:
        import torch

        if isinstance(err, torch.cuda.OutOfMemoryError):
            return True
    except (ImportError, AttributeError):
        pass
    return isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _MARKERS)


def smaller_batch(batch_size: int) -> int:
    """The batch size to try after ``batch_size`` ran out of memory: a quarter, at least 1."""
    return max(1, int(batch_size) // 4)


def out_of_memory_message(err: BaseException, args) -> str | None:
    """One line for an out-of-memory ``err`` of a command with ``args`` (None: not one)."""
    if not is_out_of_memory(err):
        return None
    batch = getattr(args, "batch_size", None)
    device = getattr(args, "device", None) or "the default device"
    if isinstance(batch, int) and batch > 1:
        return (f"out of memory on {device} at --batch-size {batch} (every protocol and check runs the model on at "
                f"most that many images at a time); run the same command with --batch-size {smaller_batch(batch)}, "
                f"and smaller again if that does not fit either")
    if isinstance(batch, int):
        return (f"out of memory on {device} with one image at a time: the model at this resolution does not fit; "
                f"use a device with more memory or the model's smaller input size")
    return (f"out of memory on {device}: lower the batch size (a study's batch_size and attack_batch_size in its "
            f"config) to a quarter and run the same command again")
