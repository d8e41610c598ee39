"""What every gradient-masking check returns (:class:`MaskingCheck`: name, verdict, detail and
evidence, JSON-safe for ``checks.json``) and reads (per-image success by image index)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import pandas as pd
import torch

VERDICTS = ("pass", "flag")
MAX_INDICES = 20           # image indices kept in the evidence (the first ones, sorted)


def _plain(value):
    """JSON-safe copy: numpy scalars and arrays, tuples and tensors to Python types."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray, pd.Series)):
        return [_plain(v) for v in list(value)]
    if isinstance(value, torch.Tensor):
        return _plain(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


@dataclass(frozen=True)
class MaskingCheck:
    """One gradient-masking check: ``verdict`` "pass" or "flag"; ``evidence`` holds the counts
    and image indices behind it (JSON-safe after :meth:`to_dict`)."""

    name: str
    verdict: str
    detail: str
    evidence: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}, got {self.verdict!r}")

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_dict(self) -> dict:
        """For ``checks.json``: name, verdict, passed (as :class:`~robust_attn.attacks.checks.CheckResult`),
        detail and evidence."""
        return {"name": self.name, "verdict": self.verdict, "passed": self.passed, "detail": self.detail,
                "evidence": _plain(self.evidence)}


def verdict_word(flag: bool) -> str:
    return "flag" if flag else "pass"


def first_indices(indices) -> list[int]:
    return sorted(int(i) for i in indices)[:MAX_INDICES]

def success_by_index(records: pd.DataFrame, condition: str | None = None, what: str = "records") -> pd.Series:
    """``success`` (bool) indexed by image ``index`` from per-image records of one condition."""
    if not isinstance(records, pd.DataFrame):
        raise TypeError(f"{what} must be a pandas DataFrame of per-image records, got {type(records).__name__}")
    missing = {"index", "success"} - set(records.columns)
    if missing:
        raise ValueError(f"{what} lack column(s) {', '.join(sorted(missing))}; per-image records need "
                         f"'index' (image) and 'success' (1 = fooled)")
    if condition is not None:
        if "condition" not in records.columns:
            raise ValueError(f"{what} have no 'condition' column to select {condition!r} from")
        records = records[records["condition"] == condition]
        if records.empty:
            raise ValueError(f"{what} have no rows of condition {condition!r}")
    if records["index"].duplicated().any():
        hint = (f" (conditions {sorted(records['condition'].unique())}: pass condition=...)"
                if "condition" in records.columns and records["condition"].nunique() > 1 else "")
        raise ValueError(f"{what} repeat image indices{hint}; give one condition's records")
    values = pd.to_numeric(records["success"], errors="coerce")
    if values.isna().any() or not values.isin([0, 1]).all():
        raise ValueError(f"{what}: 'success' must be 0/1 (or bool) per image")
    return pd.Series(values.astype(bool).to_numpy(), index=records["index"].astype(int).to_numpy())
