"""How long a run still needs, from the pace its record chunks were written at
(``robust-attn status``; the study's own clock is :class:`robust_attn.study.estimate.StudyClock`).

The pace is that of the last chunks written (their files' modification times), so it is the
pace of the process writing now, not of an earlier call that was interrupted; chunks of different
conditions can cost different times, so it is an estimate that settles as chunks land.
"""
from __future__ import annotations

import time

from robust_attn.utils.durations import format_seconds

__all__ = ["chunk_pace", "eta_line", "RECENT"]

#: how many of the last chunks written the pace is taken over
RECENT = 20


def chunk_pace(mtimes: list[float], recent: int = RECENT) -> float | None:
    """Seconds per chunk over the last ``recent`` chunks written (their files' modification
    times); None with fewer than two."""
    last = sorted(mtimes)[-recent:]
    if len(last) < 2 or last[-1] <= last[0]:
        return None
    return (last[-1] - last[0]) / (len(last) - 1)


def eta_line(store, missing: list, now: float | None = None) -> str | None:
    """``ETA: about X left at the pace of the last N chunks (one every S s), last written M ago``
    for an unfinished run; None where fewer than two chunks are written."""
    mtimes = []
    for condition, start, stop in store.chunks():
        try:
            mtimes.append(store.chunk_path(condition, start, stop).stat().st_mtime)
        except OSError:   # a repair under way
            continue
    pace = chunk_pace(mtimes)
    if pace is None or not missing:
        return None
    now = time.time() if now is None else now
    left = pace * len(missing)
    since = max(0.0, now - max(mtimes))
    return (f"  ETA: about {format_seconds(left)} left (until about "
            f"{time.strftime('%H:%M', time.localtime(now + left))}) at the pace of the last "
            f"{min(len(mtimes), RECENT)} chunks, one every {format_seconds(pace)}; the last was written "
            f"{format_seconds(since)} ago")
