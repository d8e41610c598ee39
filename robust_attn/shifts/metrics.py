"""Corruption error and mean corruption error (Hendrycks & Dietterich, ICLR 2019, section 4.1),
from per-image records of the corruption protocol.

With ``E^f_{s,c}`` the top-1 error rate of model f under corruption c at severity s, and
``E^f_clean`` its clean error:

* corruption error:  ``CE^f_c = sum_s E^f_{s,c} / sum_s E^b_{s,c}``;
* relative CE:       ``rCE^f_c = sum_s (E^f_{s,c} - E^f_clean) / sum_s (E^b_{s,c} - E^b_clean)``;
* mCE and relative mCE: their means over the corruptions c;

where b is the baseline model. The paper's baseline is AlexNet; here it is a model of the study
(by default ``resnet26``, the convolutional reference of the zoo), so an mCE of 100 means "as
robust as the baseline" and values below 100 more robust. The unnormalised mean error
``mean_{c,s} E^f_{s,c}`` (RobustBench's corruption metric is its complement, the mean accuracy)
is reported beside them. All numbers are in percent. A relative CE whose baseline degrades by
nothing (denominator 0) is undefined (NaN).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["error_table", "corruption_errors", "mce_summary"]


def error_table(records: pd.DataFrame, conditions: list[dict]) -> pd.DataFrame:
    """Top-1 error (percent) per corruption and severity, plus the clean error: columns
    ``corruption`` (``clean`` for the clean images), ``severity`` (0 for clean), ``n``, ``error``."""
    by_name = {c["name"]: c for c in conditions}
    grouped = records.groupby("condition", sort=False)["top1"].agg(["size", "mean"])
    rows = []
    for name, row in grouped.iterrows():
        c = by_name.get(name, {})
        rows.append({"corruption": c.get("corruption", name), "severity": int(c.get("severity", 0)),
                     "n": int(row["size"]), "error": 100 * (1 - row["mean"])})
    return pd.DataFrame(rows)


def corruption_errors(errors: pd.DataFrame, baseline: pd.DataFrame) -> pd.DataFrame:
    """Per corruption of ``errors`` (an :func:`error_table`): ``CE`` and ``relative_CE`` against
    ``baseline`` (another :func:`error_table`, same corruptions and severities) and the model's
    mean ``error`` over severities. A corruption or severity the baseline lacks is an error."""
    clean_f = _clean(errors, "model")
    clean_b = _clean(baseline, "baseline")
    f = errors[errors["corruption"] != "clean"].set_index(["corruption", "severity"])["error"]
    b = baseline[baseline["corruption"] != "clean"].set_index(["corruption", "severity"])["error"]
    missing = sorted(set(f.index) - set(b.index))
    if missing:
        raise ValueError(f"the baseline has no records for {missing[:3]}{'...' if len(missing) > 3 else ''}; "
                         f"run it with the same corruptions and severities")
    rows = []
    for corruption, group in f.groupby(level=0, sort=False):
        keys = list(group.index)
        fe, be = group.to_numpy(), b.loc[keys].to_numpy()
        rel_den = (be - clean_b).sum()
        rows.append({"corruption": corruption, "severities": len(keys), "error": fe.mean(),
                     "CE": 100 * fe.sum() / be.sum() if be.sum() > 0 else np.nan,
                     "relative_CE": 100 * (fe - clean_f).sum() / rel_den if rel_den != 0 else np.nan})
    return pd.DataFrame(rows)


def _clean(table: pd.DataFrame, what: str) -> float:
    clean = table.loc[table["corruption"] == "clean", "error"]
    if clean.empty:
        raise ValueError(f"the {what}'s records have no clean condition; relative CE needs the clean error")
    return float(clean.iloc[0])


def mce_summary(errors: pd.DataFrame, baseline: pd.DataFrame) -> dict:
    """``clean_error``, ``mean_error`` (over corruptions and severities), ``mCE``,
    ``relative_mCE`` and the number of ``corruptions``."""
    per = corruption_errors(errors, baseline)
    corrupted = errors[errors["corruption"] != "clean"]
    return {"clean_error": _clean(errors, "model"), "mean_error": float(corrupted["error"].mean()),
            "mCE": float(per["CE"].mean()), "relative_mCE": float(per["relative_CE"].mean()),
            "corruptions": int(len(per))}
