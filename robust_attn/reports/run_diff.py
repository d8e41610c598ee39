"""Do two runs of one protocol agree, image by image?

The question a reproduction asks: a run computed again (on another machine, with other code, or
resumed after a stop) against the one a report was made from. Two runs' per-image records
(:meth:`robust_attn.runs.store.RunStore.records`, checksums verified) are joined on
``(condition, index)``; for every condition the two share, :func:`diff_runs` counts the images
both hold, those only one holds, and per record field the images where the field differs. Real
numbers (margins, norms) differ when ``|a - b| > atol`` (both missing counts as equal); integers
(classes, counts) and text when they are not equal.
Two runs are *the same* when they share at least one condition, each shared condition is defined
alike (its attack, eps, seed, ... in ``run.json``), and its records hold the same images with every
field equal: a run of radii {8} reproduces the 8/255 part of a run of {1, 2, 4, 8}. What else
differs is put beside the verdict: conditions one run has and the other lacks, the rest of the
runs' settings (``run.json`` less where and how each ran, :data:`robust_attn.runs.identity.VOLATILE_KEYS`),
and the hardware that computed each (:meth:`~robust_attn.runs.store.RunStore.computed_on`), because
float rounding differs between machines: a borderline image can flip where the code is the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from robust_attn.runs.identity import VOLATILE_KEYS
from robust_attn.runs.store import RunStore, condition_definitions
from robust_attn.utils.differences import describe_difference

__all__ = ["ConditionDiff", "RunDiff", "diff_runs", "diff_lines"]

KEYS = ("condition", "index")


@dataclass
class ConditionDiff:
    """One condition of two runs: images in both and in one only, the top-1 (%) of each run over
    the images in both, and per field the indices of the images in both where it differs."""
    condition: str
    common: int
    only_a: list[int]
    only_b: list[int]
    top1_a: float
    top1_b: float
    fields: dict[str, list[int]] = field(default_factory=dict)
    definition: str = ""               # how the two runs define the condition differently ("" if alike)

    @property
    def same(self) -> bool:
        return not (self.definition or self.only_a or self.only_b or any(self.fields.values()))


@dataclass
class RunDiff:
    """Two runs compared (:func:`diff_runs`)."""
    a: str
    b: str
    settings: str                      # what else differs in the runs' settings ("" where nothing does)
    computed_on_a: dict[str, int]
    computed_on_b: dict[str, int]
    conditions: list[ConditionDiff]
    only_a: list[str]                  # conditions with records in one run only
    only_b: list[str]

    @property
    def same(self) -> bool:
        return bool(self.conditions) and all(c.same for c in self.conditions)


def _differs(a: pd.Series, b: pd.Series, atol: float) -> np.ndarray:
    """Per row: whether two columns' values differ: real numbers (margins, norms) beyond ``atol``,
    with missing on both sides equal; integers (classes, counts) and text exactly."""
    if pd.api.types.is_numeric_dtype(a) and pd.api.types.is_numeric_dtype(b):
        x, y = a.to_numpy(dtype=float), b.to_numpy(dtype=float)
        tol = atol if pd.api.types.is_float_dtype(a) or pd.api.types.is_float_dtype(b) else 0.0
        both_nan = np.isnan(x) & np.isnan(y)
        with np.errstate(invalid="ignore"):
            return ~both_nan & ~(np.abs(x - y) <= tol)
    return (a.astype(str).to_numpy() != b.astype(str).to_numpy())


def _settings(a: dict, b: dict) -> str:
    """What differs in two run descriptions, less where each ran and the conditions (compared one
    by one where both runs have them)."""
    da, db = ({k: v for k, v in d.items() if k not in VOLATILE_KEYS | {"conditions"}} for d in (a, b))
    return "" if da == db else describe_difference(da, db)


def diff_runs(a: str | RunStore, b: str | RunStore, atol: float = 0.0) -> RunDiff:
    """Compare two runs' records (module docstring). ``atol``: how far two numbers may be apart
    and count as equal (0: exactly equal, as the records store them). Raises
    :class:`~robust_attn.runs.store.DamagedRecordsError` where a run's records fail their checksums."""
    if atol < 0:
        raise ValueError(f"atol must be at least 0, got {atol}")
    a, b = (s if isinstance(s, RunStore) else RunStore(s) for s in (a, b))
    ra, rb = a.records(), b.records()
    names_a, names_b = list(dict.fromkeys(ra["condition"])), list(dict.fromkeys(rb["condition"]))
    shared = [c for c in names_a if c in names_b]
    fields = [c for c in ra.columns if c in rb.columns and c not in KEYS]
    desc_a, desc_b = a.description(), b.description()
    defs_a, defs_b = condition_definitions(desc_a), condition_definitions(desc_b)
    conditions = []
    for name in shared:
        xa = ra[ra["condition"] == name].set_index("index")
        xb = rb[rb["condition"] == name].set_index("index")
        common = xa.index.intersection(xb.index).sort_values()
        only_a, only_b = (sorted(int(i) for i in x.index.difference(common)) for x in (xa, xb))
        xa, xb = xa.loc[common], xb.loc[common]
        differing = {f: [int(i) for i in common[_differs(xa[f], xb[f], atol)]] for f in fields}
        top1 = [float(x["top1"].mean() * 100) if "top1" in x and len(x) else float("nan") for x in (xa, xb)]
        conditions.append(ConditionDiff(
            name, len(common), only_a, only_b, top1[0], top1[1], {f: v for f, v in differing.items() if v},
            "" if defs_a.get(name) == defs_b.get(name) else describe_difference(defs_a.get(name), defs_b.get(name))))
    return RunDiff(str(a.root), str(b.root), _settings(desc_a, desc_b), a.computed_on(), b.computed_on(), conditions,
                   [c for c in names_a if c not in names_b], [c for c in names_b if c not in names_a])


def _indices(values: list[int], shown: int) -> str:
    more = f" and {len(values) - shown} more" if len(values) > shown else ""
    return ", ".join(map(str, values[:shown])) + more


def diff_lines(diff: RunDiff, shown: int = 5) -> list[str]:
    """The comparison as lines of text: the two runs, their settings and hardware, one line per
    condition (``shown``: image indices named per field), and a verdict."""
    def hardware(counts: dict[str, int]) -> str:
        return ", ".join(f"{k} ({v} chunks)" for k, v in counts.items()) or "not recorded"

    lines = [f"A: {diff.a}, computed on {hardware(diff.computed_on_a)}",
             f"B: {diff.b}, computed on {hardware(diff.computed_on_b)}",
             f"other settings: {'differ: ' + diff.settings if diff.settings else 'the same'}"]
    for c in diff.conditions:
        head = f"{c.condition}: {c.common} images in both, top-1 {c.top1_a:.1f} (A) and {c.top1_b:.1f}% (B)"
        if c.only_a or c.only_b:
            head += f"; only in A {len(c.only_a)}, only in B {len(c.only_b)}"
        if c.definition:
            head += f"; defined differently: {c.definition}"
        body = "; ".join(f"{f} on {len(v)} (images {_indices(v, shown)})" for f, v in c.fields.items())
        lines.append(f"  {head}: " + (f"differ in {body}" if body else "every field the same"))
    for side, names in (("A", diff.only_a), ("B", diff.only_b)):
        if names:
            lines.append(f"  conditions with records in {side} only: {', '.join(names)}")
    if not diff.conditions:
        lines.append("they differ: no condition has records in both runs")
    elif diff.same:
        lines.append(f"the same: every field of every image in the {len(diff.conditions)} conditions both runs have")
    else:
        differing = [c for c in diff.conditions if not c.same]
        images = sorted({i for c in differing for v in c.fields.values() for i in v})
        lines.append(f"they differ in {len(differing)} of the {len(diff.conditions)} conditions both runs have "
                     f"({len(images)} images in both differ in some field)")
    return lines
