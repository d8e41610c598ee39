"""Stopping a long attack on a signal without losing its progress.

A run that is stopped from outside (``timeout``, a batch scheduler's preemption, Ctrl-C) used to
die at once, losing whatever its attack had done since the last periodic save
(:mod:`robust_attn.attacks.progress`, every 5 minutes): on a lent GPU that was minutes of work
per process. While an attack that can save runs inside :func:`stop_deferred`, SIGTERM and SIGINT
are noted instead: the attack saves its progress at its next save point (:meth:`Progress.due
<robust_attn.attacks.progress.Progress.due>` is then true at once) and raises
:class:`StopRequested`; the command exits with 128 + the signal's number, as if killed by it, and
running it again resumes from the save. A second signal stops at once (``KeyboardInterrupt``),
for a user who will not wait for the save point (one APGD run, one FAB iteration or one
Square query away).

Signals can be caught only in a process's main thread; elsewhere :func:`stop_deferred` changes
nothing.
"""
from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager

__all__ = ["StopRequested", "stop_deferred", "stop_requested", "raise_if_stop_requested"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_received: int | None = None   # the signal noted inside stop_deferred, if any
_depth = 0                     # nested stop_deferred blocks (the handlers are installed once)


class StopRequested(KeyboardInterrupt):
    """A stop signal arrived; the attack saved its progress first. A ``KeyboardInterrupt``, so that
    nothing that handles ordinary errors (a study going on to its next model) swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name} after saving the attack's progress: "
                         f"run the same command again to resume")


def stop_requested() -> bool:
    """Whether a stop signal was noted (inside :func:`stop_deferred`)."""
    return _received is not None


def raise_if_stop_requested() -> None:
    """Raise :class:`StopRequested` if a stop signal was noted (call it right after a save)."""
    if _received is not None:
        raise StopRequested(_received)


def _note(signum, frame) -> None:
    global _received
    if _received is not None:
        raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopped without saving")
    _received = signum
    print(f"robust-attn: {signal.Signals(signum).name} received: the attack saves its progress at its next "
          f"save point, then stops (send it again to stop at once, without saving)", file=sys.stderr, flush=True)


@contextmanager
def stop_deferred():
    """Inside: SIGTERM and SIGINT are noted rather than stopping the process (see the module).
    Leaving the block normally with a signal noted raises :class:`StopRequested` (whatever the
    block finished was saved by it); the handlers before the block are put back."""
    global _received, _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth == 0:
        previous = {s: signal.signal(s, _note) for s in SIGNALS}
    _depth += 1
    try:
        yield
        raise_if_stop_requested()
    finally:
        _depth -= 1
        if _depth == 0:
            for s, handler in previous.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
            _received = None
