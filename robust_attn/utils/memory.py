"""Out-of-memory errors said in one line with a batch size to try.

``MemoryError`` (Python), ``torch.OutOfMemoryError`` (CUDA's, ``torch.cuda.OutOfMemoryError``)
and the CPU allocator's ``RuntimeError`` ("can't allocate memory") all mean that the images of one
batch, with their activations and gradients, did not fit. Every protocol, attack and check runs the
model on at most ``--batch-size`` images at a time, so the peak shrinks with it
(``benchmarks/bench_memory.py`` measures it per protocol); the message names a quarter of the batch
size that failed. Where a command has more than one batch size (a study: ``batch_size`` and
``attack_batch_size``), the step that failed says which with :func:`names_batch_size`.
"""
from __future__ import annotations

from contextlib import contextmanager

__all__ = ["is_out_of_memory", "out_of_memory_message", "smaller_batch", "OutOfMemory", "names_batch_size"]

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


class OutOfMemory(MemoryError):
    """An out-of-memory error of a step that ran ``batch`` images at a time, set by ``option``
    (e.g. ``--attack-batch-size``), in ``where`` (e.g. "the study's apgd step")."""

    def __init__(self, batch: int, option: str, where: str, cause: BaseException):
        super().__init__(f"out of memory in {where} at {option} {batch}: {cause}")
        self.batch, self.option, self.where = int(batch), option, where


@contextmanager
def names_batch_size(batch: int, option: str, where: str):
    """Turn an out-of-memory error inside the block into :class:`OutOfMemory` naming ``option``."""
    try:
        yield
    except OutOfMemory:
        raise
    except (MemoryError, RuntimeError) as err:
        if not is_out_of_memory(err):
            raise
        raise OutOfMemory(batch, option, where, err) from err


def smaller_batch(batch_size: int) -> int:
    """The batch size to try after ``batch_size`` ran out of memory: a quarter, at least 1."""
    return max(1, int(batch_size) // 4)


def out_of_memory_message(err: BaseException, args) -> str | None:
    """One line for an out-of-memory ``err`` of a command with ``args`` (None: not one)."""
    if not is_out_of_memory(err):
        return None
    device = getattr(args, "device", None) or "the default device"
    if isinstance(err, OutOfMemory):
        if err.batch > 1:
            return (f"out of memory on {device} in {err.where} at {err.option} {err.batch} (it runs the model on at "
                    f"most that many images at a time); run the same command with {err.option} "
                    f"{smaller_batch(err.batch)}, and smaller again if that does not fit either")
        return (f"out of memory on {device} in {err.where} with one image at a time: the model at this resolution "
                f"does not fit; use a device with more memory or the model's smaller input size")
    batch = getattr(args, "batch_size", None)
    if isinstance(batch, int) and batch > 1:
        return (f"out of memory on {device} at --batch-size {batch} (every protocol and check runs the model on at "
                f"most that many images at a time); run the same command with --batch-size {smaller_batch(batch)}, "
                f"and smaller again if that does not fit either")
    if isinstance(batch, int):
        return (f"out of memory on {device} with one image at a time: the model at this resolution does not fit; "
                f"use a device with more memory or the model's smaller input size")
    said = f" ({err})" if isinstance(err, MemoryError) and str(err) else ""
    return (f"out of memory on {device}{said}: lower the batch sizes to a quarter (a study: --batch-size and "
            f"--attack-batch-size, or batch_size and attack_batch_size in its config) and run the same command again")
