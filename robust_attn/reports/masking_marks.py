"""Gradient-masking flags travel with the numbers: a model flagged by any masking check carries
:data:`MARK` (:data:`robust_attn.reports.runs.MASKING_MARK`) in every row label of the report
(findings, Tables 9 and 10, robust accuracy, AutoAttack's members, the headline intervals), so no
sentence or table ranks it most robust without it.

The flags are the ``checks.json`` entries with ``verdict == "flag"`` of the report's masking runs
(the study's ``masking`` step) and attack runs (``eval attack``'s checks), matched to every run
of the same model, dataset and weights (:func:`~robust_attn.reports.runs.weights_label`).
:func:`annotate_masking` notes them on the runs (``run.masking_flags``: the flagged check names),
where the labelling functions of :mod:`robust_attn.reports.runs` read them (:func:`marked`).
"""
from __future__ import annotations

import json

from robust_attn.reports.runs import MASKING_MARK as MARK
from robust_attn.reports.runs import marked, weights_label

__all__ = ["MARK", "LEGEND", "annotate_masking", "marked", "flags_of"]

LEGEND = ("**[masking flag]** marks a model that a gradient-masking check flagged ({checks}): its robust accuracy "
          "is an upper bound a stronger or different attack may lower, not evidence of robustness; the checks' "
          "details are in the Gradient-masking checks section.")


def _key(run) -> tuple:
    return run.model, run.dataset, weights_label(run)


def _flagged(run) -> list[str]:
    path = run.path / "checks.json"
    if not path.is_file():
        return []
    try:
        checks = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [c["name"] for c in checks if isinstance(c, dict) and c.get("verdict") == "flag"]


def annotate_masking(runs) -> dict[tuple, list[str]]:
    """Note on every run the masking checks that flagged its model (``run.masking_flags``);
    returns model key -> flagged check names."""
    flags: dict[tuple, list[str]] = {}
    for run in runs:
        if run.protocol in ("masking", "attack"):
            for name in _flagged(run):
                names = flags.setdefault(_key(run), [])
                if name not in names:
                    names.append(name)
    for run in runs:
        run.masking_flags = tuple(flags.get(_key(run), ()))
    return flags


def flags_of(run) -> tuple[str, ...]:
    """The masking checks that flagged the run's model (after :func:`annotate_masking`)."""
    return tuple(getattr(run, "masking_flags", ()) or ())
