"""Durations as people read them, for the lines that say how long something takes."""
from __future__ import annotations

__all__ = ["format_seconds"]


def format_seconds(seconds: float | None) -> str:
    """``"12 s"``, ``"10 min"``, ``"3.0 h"``, ``"5.0 days"``; ``"?"`` for None (not known)."""
    if seconds is None:
        return "?"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
