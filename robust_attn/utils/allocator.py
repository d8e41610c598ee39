"""Keep freed memory in the process on glibc, so that large tensors are not page-faulted anew on
every forward pass.

glibc's malloc serves a request above its mmap threshold (at most 32 MiB, however it adapts)
with a fresh ``mmap`` and gives it back with ``munmap`` when freed. The activation maps of an
attack batch are far larger (one 64-channel 32x32 map of 800 images is 210 MB), so every forward
pass maps them again, and the kernel zero-fills each 4 KiB page on first touch: measured on this
machine, the Fashion-MNIST zoo's aa_resnet26 on 800 images spent a third of its time in the
kernel (3.8 million minor page faults in seven passes). :func:`keep_freed_memory` turns mmap off
for allocations (they come from the heap) and heap trimming off below 2 GiB of free memory (what
is freed stays for the next pass), the documented ``mallopt`` settings behind
``MALLOC_MMAP_MAX_=0`` and ``MALLOC_TRIM_THRESHOLD_``. It changes where tensors live, never a
number: PyTorch aligns every CPU tensor to 64 bytes whatever the allocator
(``benchmarks/bench_allocator.py`` checks the outputs and input gradients bit for bit, and
measures the speed-up side by side).

The cost: the process keeps its peak memory until it ends, which is what a long attack or
training loop reaches again on its next batch anyway, plus some slack: an aligned allocation asks
for a few bytes more than a freed chunk of the same size holds, so the heap grows by a few such
chunks before freed neighbours merge and serve (measured peaks over twelve passes on 800 images:
2,570 against 2,535 MB for aa_resnet26, 2,627 against 2,388 MB for san10_patchwise).
``robust-attn`` calls it on start; it does nothing where the C library is not glibc, where
``ROBUST_ATTN_KEEP_FREED_MEMORY=0``, or where a ``MALLOC_*`` variable of the environment already
tunes malloc.
"""
from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["keep_freed_memory", "glibc", "M_TRIM_THRESHOLD", "M_MMAP_THRESHOLD", "M_MMAP_MAX"]

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
TRIM_ABOVE = 2 ** 31 - 1   # the largest int mallopt takes: only a free heap top above 2 GiB is handed back


def glibc():
    """The process's C library if it is glibc, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version   # only glibc has it (not musl)
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Serve every allocation from the heap and keep what is freed (module docstring); True if set.

    Idempotent. Affects allocations made from now on; where it does nothing (not glibc,
    ``ROBUST_ATTN_KEEP_FREED_MEMORY=0``, or ``MALLOC_*`` set by the user) it returns False."""
    if os.environ.get("ROBUST_ATTN_KEEP_FREED_MEMORY", "1") == "0":
        return False
    if any(key.startswith("MALLOC_") for key in os.environ):
        return False
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE))
