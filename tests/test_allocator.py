"""robust_attn.utils.allocator: freed tensors stay in the process (no page faults on the next
pass), only where asked and only on glibc."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from robust_attn.utils.allocator import glibc

# passes that allocate, touch and free a 64 MiB tensor: ten to warm up (glibc's aligned allocations
# ask for a few bytes more than a freed chunk of the same size holds, so the heap grows by a few
# such chunks before freed ones merge and serve), then ten whose minor page faults it prints, with
# whether the setting took
PASSES = """
import resource, sys, torch
from robust_attn.utils.allocator import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "keep" else False
def one_pass():
    torch.empty(16 * 2 ** 20).fill_(1.0)
for _ in range(10):
    one_pass()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    one_pass()
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES = 10 * 64 * 2 ** 20 // 4096   # the faults of ten passes that map the tensor anew


def _run(mode: str, **env) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "ROBUST_ATTN_KEEP"))}
    out = subprocess.run([sys.executable, "-c", PASSES, mode], env={**clean, **env}, capture_output=True,
                         text=True, check=True, timeout=120).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(glibc() is None, reason="glibc's malloc only")
def test_freed_tensors_are_not_faulted_in_again_and_the_opt_outs_leave_malloc_alone():
    took, faults = _run("default")
    assert took == "False" and faults > 0.8 * PAGES       # glibc maps each 64 MiB tensor anew
    took, faults = _run("keep")
    assert took == "True" and faults < 0.02 * PAGES       # the heap keeps it for the next pass
    for opt_out in ({"ROBUST_ATTN_KEEP_FREED_MEMORY": "0"}, {"MALLOC_ARENA_MAX": "2"}):
        took, faults = _run("keep", **opt_out)
        assert took == "False" and faults > 0.8 * PAGES, opt_out
