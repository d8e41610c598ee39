"""The published numbers (SAN Tables 3, 9, 10; SASA, GSA, AA tables; Bai et al. 2021), shipped in
``reports/reference`` of the source tree and as package data."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pandas as pd

__all__ = ["REFERENCE_DIR", "reference_table", "imagenet_reference"]

REFERENCE_DIR = Path(__file__).resolve().parents[2] / "reports" / "reference"


def reference_table(name: str) -> pd.DataFrame:
    """One of ``imagenet_params_flops``, ``san_table9_rotation``, ``san_table10_pgd``,
    ``cifar100_reference``, ``bai2021_adversarial`` as a DataFrame."""
    path = REFERENCE_DIR / f"{name}.csv"
    if not path.is_file():
        raise FileNotFoundError(f"reference table {path} is missing; it ships in the repository's "
                                f"reports/reference/ (install robust-attn from a clone with -e)")
    return pd.read_csv(path)


@lru_cache(maxsize=None)
def imagenet_reference() -> dict[str, dict]:
    """``{model: {"params_M", "flops_G", "macs_G", "top1", ...}}`` from the papers' ImageNet tables.

    ``macs_G`` puts every paper on one convention: SAN counts multiply-adds, while SASA, GSA and
    AA count multiplies and adds separately, so their ``flops_G`` is halved.
    """
    table = reference_table("imagenet_params_flops")
    separate = table["flops_convention"].str.contains("separately")
    table["macs_G"] = table["flops_G"].where(~separate, table["flops_G"] / 2)
    return {row["model"]: row for row in table.to_dict("records")}
