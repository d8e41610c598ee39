"""What differs between two stored values, said in a line: for the errors that refuse to resume
a run under another description (:class:`robust_attn.runs.store.RunMismatchError`), whose
conditions and parameters can be hundreds of lines long."""
from __future__ import annotations

__all__ = ["describe_difference"]


def _cut(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _short(value, width: int = 100) -> str:
    return _cut(repr(value), width)


def _item(value) -> str:
    """A list item as a mismatch message names it: a condition by its name, else its repr."""
    return repr(value["name"]) if isinstance(value, dict) and "name" in value else _short(value, 60)


def describe_difference(stored, now, depth: int = 0) -> str:
    """What differs between two stored values, briefly: the sub-keys of dicts (recursively), the
    items of lists only one side has, else both values cut to a line. A run's conditions and
    parameters can be hundreds of lines; the message names what to look at, not all of it."""
    if isinstance(stored, dict) and isinstance(now, dict) and depth < 2:
        keys = sorted((k for k in set(stored) | set(now) if stored.get(k) != now.get(k)), key=str)
        parts = [f"{k}: {describe_difference(stored.get(k), now.get(k), depth + 1)}" for k in keys[:3]]
        return "{" + "; ".join(parts) + (f"; and {len(keys) - 3} more keys" if len(keys) > 3 else "") + "}"
    if isinstance(stored, list) and isinstance(now, list):
        old, new = [_item(v) for v in stored], [_item(v) for v in now]
        gone, added = [v for v in old if v not in new], [v for v in new if v not in old]
        if not gone and not added:
            if old != new:
                return (f"the same {len(old)} items in another order: stored [{_cut(', '.join(old))}], "
                        f"now [{_cut(', '.join(new))}]")
            changed = [i for i, (a, b) in enumerate(zip(stored, now)) if a != b]   # same names: contents differ
            i = changed[0]
            return (f"item {_item(stored[i])}: {describe_difference(stored[i], now[i], depth + 1)}"
                    + (f" (and {len(changed) - 1} more items)" if len(changed) > 1 else ""))
        listed = lambda items: ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
        return (f"{len(old)} items stored, {len(new)} now" + (f"; only stored: {listed(gone)}" if gone else "")
                + (f"; only now: {listed(added)}" if added else ""))
    return f"stored {_short(stored)}, now {_short(now)}"
