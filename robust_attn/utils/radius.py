"""One syntax for attack radii in every command and every config file: image units.

An image is in [0, 1], and a radius is a distance in those units: ``8/255`` (a fraction: eight
grey levels of 255) or a plain float (``0.031``, ``0.5``). A bare number means the same in every
command and every study TOML, a fraction of the whole pixel range, so an L-inf radius above 1 is
refused with the fraction it probably meant (``--eps 8`` -> ``8/255``). Settings fields that hold
radii (:func:`robust_attn.protocols.settings.setting` with ``radius=``) are read by this parser
on the command line and in TOML (``"8/255"`` strings or numbers). ``docs/eps.md`` is the user's
page on it.
"""
from __future__ import annotations

import math

__all__ = ["RadiusError", "parse_radius", "parse_radii", "shown_radius"]


class RadiusError(ValueError):
    """A radius that cannot be read; the message names the option or key and the syntax."""


def parse_radius(text: str | float, option: str = "--eps", norm: str = "linf") -> float:
    """``"8/255"`` -> 8/255, ``"0.5"`` or ``0.5`` -> 0.5 (image units); a clear error otherwise."""
    if isinstance(text, bool):
        raise RadiusError(f"{option} takes a radius such as 8/255 or 0.031, got {text!r}")
    raw = str(text).strip()
    try:
        if "/" in raw:
            num, den = raw.split("/", 1)
            value = float(num) / float(den)
        else:
            value = float(raw)
    except (ValueError, ZeroDivisionError):
        raise RadiusError(f"{option} {raw!r} is not a number; write a fraction of the pixel range such as 8/255 "
                          f"or a float such as 0.031") from None
    if not math.isfinite(value):
        raise RadiusError(f"{option} takes finite numbers, got {raw!r}")
    if value < 0:
        raise RadiusError(f"{option} {raw}: eps must be >= 0 (image units, e.g. 8/255)")
    if norm == "linf" and value > 1:
        hint = f"; for {raw} of 255 grey levels write {raw}/255" if "/" not in raw and value <= 255 else ""
        raise RadiusError(f"{option} {raw} is more than the whole [0, 1] pixel range: every command and config "
                          f"reads a radius in image units (8/255 or 0.031){hint}")
    return value


def parse_radii(text: str | None, option: str = "--eps", norm: str = "linf") -> list[float] | None:
    """A comma list of :func:`parse_radius` values (None stays None; an empty item is an error)."""
    if text is None:
        return None
    items = [v.strip() for v in str(text).split(",")]
    if items == [""] or "" in items:
        raise RadiusError(f"{option} has an empty item in {text!r}; write e.g. {option} 1/255,2/255,4/255")
    return [parse_radius(v, option, norm) for v in items]


def shown_radius(value: float) -> str:
    """An L-inf radius as people write it, in grey levels: ``8/255``, ``0.5/255`` (to 1e-6)."""
    return f"{round(value * 255, 6):g}/255"
