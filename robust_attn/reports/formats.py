"""Report tables as GitHub Markdown and LaTeX (booktabs), without a tabulate dependency."""
from __future__ import annotations

import math

from pathlib import Path

import numpy as np
import pandas as pd

from robust_attn.utils.io import atomic_path

__all__ = ["to_markdown", "to_latex", "write_csv"]


def to_markdown(frame: pd.DataFrame) -> str:
    """A GitHub Markdown table (no tabulate dependency)."""
    cols = [str(c) for c in frame.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(":--" if i == 0 else "--:" for i in range(len(cols))) + "|"]
    for _, row in frame.iterrows():
        lines.append("| " + " | ".join(_fmt(v) for v in row.tolist()) + " |")
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    if isinstance(v, (float, np.floating)):
        return "-" if math.isnan(v) else f"{v:.1f}"
    return str(v).replace("|", "\\|")


_LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "°": r"$^\circ$"}


def _tex(text) -> str:
    return "".join(_LATEX_ESCAPES.get(ch, ch) for ch in _fmt(text))


def to_latex(frame: pd.DataFrame, groups: list[tuple[str, int]] | None = None,
             subheaders: list[str] | None = None, caption: str = "", label: str = "") -> str:
    """A booktabs table; ``groups`` adds a first header row of ``(title, column span)`` after the
    first column and ``subheaders`` replaces the column names below it (the paper's two-level
    header)."""
    cols = list(frame.columns)
    lines = [r"\begin{table}[t]", r"\centering", r"\begin{tabular}{l" + "c" * (len(cols) - 1) + "}", r"\toprule"]
    if groups:
        lines.append(" & " + " & ".join(rf"\multicolumn{{{span}}}{{c}}{{{_tex(t)}}}" for t, span in groups) + r" \\")
        lines.append(" & ".join(_tex(c) for c in (subheaders or cols)) + r" \\")
    else:
        lines.append(" & ".join(_tex(c) for c in cols) + r" \\")
    lines.append(r"\midrule")
    for _, row in frame.iterrows():
        lines.append(" & ".join(_tex(v) for v in row.tolist()) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    if caption:
        lines.append(rf"\caption{{{_tex(caption)}}}")
    if label:
        lines.append(rf"\label{{{label}}}")
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


def write_csv(frame: pd.DataFrame, path: Path) -> Path:
    """A report table as CSV (4 decimals), written atomically."""
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False, float_format="%.4f")
    return path
