"""Saving an attack's progress in the middle of its run, so that a run killed after hours resumes
where it was, with the same result.

On a CPU one member of AutoAttack on one chunk can take hours (Square's 5000 queries, or APGD-T's
nine target runs, on the images still robust at a small eps), longer than the process may live.
:class:`~robust_attn.attacks.autoattack.AutoAttack` saves its own state after each member; an
attack that can also save *within* its run reads and writes its progress through the
:class:`Progress` the ensemble sets on it (``attack.progress``; ``None``: the attack runs
without):

* ``Square`` after an iteration of its random search (:mod:`robust_attn.attacks.square`);
* ``APGD-CE`` / ``APGD-T`` before each of their runs (one per target class and restart) and
  after each iterate of a run (:mod:`robust_attn.attacks.apgd`);
* ``FAB-T`` before each target class and after each iteration of a targeted run
  (:func:`robust_attn.attacks.fab.multi_targeted`, :mod:`robust_attn.attacks.fab_run`).

An attack saves only when :meth:`Progress.due` (``every_s`` seconds since the last save), and
saves everything its remaining work depends on, its random generator's state included, so a
resumed run returns what an uninterrupted one returns, bit for bit on the same device. A
generator's state is its device's own (a CUDA generator's state means nothing to a CPU one), so
a progress is tagged with its generator's device type and used only where the attack's generator
is of that type (else the member starts again; a warning says so). APGD and Square draw from a
CPU generator on every device (:mod:`robust_attn.attacks.rng`), FAB-T from the CPU's global one
(``Attack.portable_progress``): their progress is tagged ``cpu`` and moves between devices
(started on a lent GPU, finished on a CPU, with the random numbers of an uninterrupted run).
Progress that APGD and Square saved on a GPU before they did so holds a CUDA generator's state
(tagged ``cuda``) and starts the member again; FAB-T's, tagged ``None`` then, fits any device.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable

import torch

from robust_attn.attacks.stopping import raise_if_stop_requested, stop_requested

__all__ = ["Progress", "rows", "put_rows", "changed_rows", "to_cpu"]

#: seconds between two saves of an attack's progress
EVERY_S = 300.0


class Progress:
    """An attack's saved progress (``state``: what it saved last, for these inputs; ``None``: start
    afresh) and where to save more (``save_fn``, called with a dict of tensors and numbers).
    ``device``: where the attack's random generator lives (its state's tag); ``None``: it saves no
    generator state of a device's own. ``log``: told, at each save, where the run stands (a line
    for the user)."""

    def __init__(self, state: dict | None, save_fn: Callable[[dict], None], attack: str,
                 device: torch.device | None, every_s: float = EVERY_S, log: Callable[[str], None] | None = None):
        here = device.type if device is not None else None   # None: progress that fits any device
        theirs = state.get("device") if state is not None else None
        if state is not None and (state.get("attack") != attack or (None not in (here, theirs) and theirs != here)):
            warnings.warn(f"saved progress of {state.get('attack')!r} on {state.get('device')!r} does not fit "
                          f"{attack!r} on {here!r}: {attack} starts again from its beginning", stacklevel=2)
            state = None
        self.state, self.attack, self.device = state, attack, here
        self._save_fn, self.every_s, self._last, self.log = save_fn, every_s, time.monotonic(), log
        # the member's time: seconds counted so far (over resumptions) and the fraction of its work
        # done when counting began (0: from its start; None: not yet, a state saved before the count
        # existed, where counting begins at the next save)
        self._started, self._before, self._from = self._last, 0.0, 0.0
        if state is not None:
            counted = "elapsed" in state and "counted_from" in state
            self._before = float(state["elapsed"]) if counted else 0.0
            self._from = state["counted_from"] if counted else None

    def due(self) -> bool:
        """Whether ``every_s`` seconds have passed since the last save (or the start), or a stop
        signal arrived (:mod:`robust_attn.attacks.stopping`: save now, then stop)."""
        return stop_requested() or time.monotonic() - self._last >= self.every_s

    def save(self, state: dict, note: str = "", fraction: float | None = None) -> None:
        """Save ``state`` (moved to the CPU), tagged with the attack, the device type, ``note``
        (where the run stands, e.g. for ``robust-attn status``, which also goes to ``log``), the
        ``fraction`` of the attack's work done (its iterations; None: unknown) and the seconds it
        has run (``elapsed``, over every process that resumed it) since it had done
        ``counted_from`` of its work; then, if a stop signal arrived, raises
        :class:`~robust_attn.attacks.stopping.StopRequested`."""
        now = time.monotonic()
        if self._from is None:   # resumed from a state without a count: the count starts here
            self._from, self._started = fraction, now
        elapsed = self._before + now - self._started
        self._save_fn(to_cpu({**state, "attack": self.attack, "device": self.device, "note": note,
                              "fraction": fraction, "elapsed": elapsed, "counted_from": self._from}))
        self._last = time.monotonic()
        if self.log is not None and note:
            self.log(f"{self.attack}: {note} (progress saved)")
        raise_if_stop_requested()


def to_cpu(obj):
    """``obj`` with every tensor in it (in dicts and lists) moved to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def rows(t: torch.Tensor, mask: torch.Tensor) -> dict:
    """The rows of ``t`` where ``mask`` holds, with their indices (a state keeps only what differs)."""
    index = mask.nonzero().flatten()
    return {"index": index, "values": t[index]}


def changed_rows(t: torch.Tensor, base: torch.Tensor) -> dict:
    """:func:`rows` of ``t`` where it differs from ``base`` (e.g. adversarial images from the inputs)."""
    return rows(t, (t != base).flatten(1).any(1))


def put_rows(t: torch.Tensor, saved: dict) -> torch.Tensor:
    """``t`` with the rows :func:`rows` saved written back (in place; returned)."""
    index = saved["index"].to(t.device)
    t[index] = saved["values"].to(t.device, t.dtype)
    return t
