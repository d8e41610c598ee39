"""Check ``gain_with_strength``: success must not fall, and must grow, with the attack's steps,
restarts or eps."""
from __future__ import annotations

import numbers
from typing import Mapping, Sequence

from robust_attn.attacks.masking.evidence import MaskingCheck, verdict_word


def check_gain_with_strength(rates: Mapping, order: Sequence | None = None, tol: float = 0.0,
                             what: str = "strength") -> MaskingCheck:
    """Flag when success does not grow with the attack's strength (steps, restarts or eps).

    ``rates``: setting -> success rate in [0, 1]; ``order``: the settings from weakest to strongest
    (default: the mapping's order). Flags (our sharpening of the issue's "does not grow") when
    (a) a stronger setting's rate is below the previous one's by more than ``tol``, or (b) the
    strongest is not strictly above the weakest while the weakest is below 100% (an attack that
    gains nothing from 10x the effort is stuck, typically on a masked gradient).
    """
    order = list(rates) if order is None else list(order)
    if len(order) < 2:
        raise ValueError("give at least two settings (weakest to strongest) to compare")
    unknown = [k for k in order if k not in rates]
    if unknown:
        raise ValueError(f"order names setting(s) without a rate: {unknown}")
    values = []
    for key in order:
        rate = rates[key]
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= float(rate) <= 1.0:
            raise ValueError(f"success rate of {key!r} must be a number in [0, 1], got {rate!r} "
                             f"(divide percentages by 100)")
        values.append(float(rate))
    drops = [{"from": str(a), "to": str(b), "rate_from": ra, "rate_to": rb}
             for a, b, ra, rb in zip(order, order[1:], values, values[1:]) if rb < ra - tol]
    stuck = values[-1] <= values[0] and values[0] < 1.0
    evidence = {"order": [str(k) for k in order], "rates": values, "drops": drops, "gain": values[-1] - values[0]}
    shown = " -> ".join(f"{k}: {v:.2%}" for k, v in zip(order, values))
    if drops:
        detail = f"success falls as the {what} grows ({shown})"
    elif stuck:
        detail = f"success does not grow with the {what} ({shown})"
    elif values[0] >= 1.0:
        detail = f"already 100% at the weakest {what} ({shown})"
    else:
        detail = f"success grows with the {what} ({shown})"
    return MaskingCheck("gain_with_strength", verdict_word(bool(drops) or stuck), detail, evidence)
