"""Which implementation a model's local-attention layers compute with: one function, two paths.

SAN (:class:`~robust_attn.layers.san.SelfAttention2d`, Zhao et al. 2020, Eq. 3-5) and SASA
(:class:`~robust_attn.layers.sasa.SASAttention2d`, Ramachandran et al. 2019, Eq. 2-3) each have a
reference and a memory-lean implementation of the same function (their modules' docstrings; the
tests check they agree). GSA (:class:`~robust_attn.layers.gsa.GlobalSelfAttention2d`) computes its
axial positional layers on the lean path, on CPU, in the cheaper order of their two contractions
(:mod:`robust_attn.layers.gsa_axial`), on the reference path in the paper's order:

* ``"lean"`` (default): loops over the footprint's offsets, a few operators per offset, so no
  ``k^2``-expanded activation is kept. On a CPU it is the faster path as well
  (``benchmarks/results/layer_paths_cpu.json``; docs/performance.md, "Why each path exists").
* ``"reference"``: SAN's ``unfold``, SASA's ``reference``: the same work in fewer, larger operators,
  at several times the memory. On a GPU the lean paths are launch-bound (thousands of small
  operators per forward), and there the reference paths were the faster for an attack step
  (``benchmarks/results/layer_paths_cuda.json``, ``benchmarks/bench_layer_paths.py``; the
  figures, per family, in docs/performance.md, "Why each path exists").

The path changes float rounding only, as a
device does, so a run records it as how it ran, not what it computes (``attention_path`` in
``run.json``, among :data:`robust_attn.runs.identity.VOLATILE_KEYS`): a run started on one path resumes on
the other.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ATTENTION_PATHS", "ATTENTION_PATH_HELP", "check_attention_path", "set_attention_path"]

ATTENTION_PATHS = ("lean", "reference")
#: the ``--attention-path`` option's help, for every command that has it
ATTENTION_PATH_HELP = ("how the SAN, SASA and GSA layers compute (the same function): lean (default; faster on "
                       "a CPU) or reference (faster attack steps on a GPU, more memory); recorded in run.json")


def check_attention_path(path: str) -> str:
    """``path`` if it is one of :data:`ATTENTION_PATHS`, else a ValueError naming them."""
    if path not in ATTENTION_PATHS:
        raise ValueError(f"attention path must be one of {', '.join(ATTENTION_PATHS)}, got {path!r}")
    return path


def set_attention_path(model: nn.Module, path: str) -> int:
    """Put every SAN, SASA and GSA layer of ``model`` on ``path`` (:data:`ATTENTION_PATHS`); returns
    how many layers it set (0 for a model without such layers, which then computes as before)."""
    from robust_attn.layers.gsa import GlobalSelfAttention2d
    from robust_attn.layers.san import SelfAttention2d
    from robust_attn.layers.sasa import SASAttention2d

    check_attention_path(path)
    n = 0
    for m in model.modules():
        if isinstance(m, SelfAttention2d):
            m.implementation = "lean" if path == "lean" else "unfold"
            n += 1
        elif isinstance(m, (SASAttention2d, GlobalSelfAttention2d)):
            m.impl = path
            n += 1
    return n
