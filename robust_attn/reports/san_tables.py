"""The report's sections of SAN's two tables: Table 9 (rotation and flipping) and Table 10
(targeted PGD), each as CSV, Markdown and LaTeX beside the published numbers, with the sweeps
in long format and their plots."""
from __future__ import annotations

from pathlib import Path

from robust_attn.protocols.report_section import ReportContext, report_section
from robust_attn.reports.formats import to_latex, to_markdown, write_csv
from robust_attn.reports.plots import plot_pgd, plot_rotation
from robust_attn.reports.tables import (TABLE9_CONDITIONS, format_pgd, format_rotation, pgd_sweep, pgd_table,
                                        rotation_sweep, rotation_table)
from robust_attn.utils.io import atomic_write_text

__all__ = ["TABLE9_CAPTION", "TABLE10_CAPTION", "rotation_section", "pgd_section"]

TABLE9_CAPTION = ("Robustness to rotation and flipping at test time (SAN Table 9 layout): top-1 / top-5 "
                  "accuracy (%), drop from the unrotated result in brackets (lower is better).")
TABLE10_CAPTION = ("Targeted white-box L-inf PGD (SAN Table 10 layout): eps = 8/255; n = 2 with step 4/255, "
                   "n = 4 with step 2/255. s. rate: attack success rate (%), top-1: accuracy under attack (%).")


def _paper_table(ctx: ReportContext, table, shown, stem: str, **latex) -> list[Path]:
    """``table`` as ``<stem>.csv``, and as shown in the paper's layout as ``<stem>.md`` and
    ``<stem>.tex`` (``latex``: the arguments of :func:`~robust_attn.reports.formats.to_latex`)."""
    files = [write_csv(table, ctx.out / f"{stem}.csv")]
    atomic_write_text(ctx.out / f"{stem}.md", to_markdown(shown))
    atomic_write_text(ctx.out / f"{stem}.tex", to_latex(shown, **latex))
    return files + [ctx.out / f"{stem}.md", ctx.out / f"{stem}.tex"]


@report_section("rotation", order=10)
def rotation_section(ctx: ReportContext) -> tuple[list[str], list[Path]]:
    """SAN Table 9 and every rotation condition, from the rotation runs."""
    md: list[str] = []
    files: list[Path] = []
    t9 = rotation_table(ctx.runs)
    if not t9.empty:
        shown = format_rotation(t9)
        files += _paper_table(ctx, t9, shown, "table9_rotation", groups=[(title, 2) for _, title in TABLE9_CONDITIONS],
                              subheaders=["Method"] + ["top-1", "top-5"] * 5, caption=TABLE9_CAPTION,
                              label="tab:rotation")
        sweep = rotation_sweep(ctx.runs)
        files.append(write_csv(sweep, ctx.out / "rotation_conditions.csv"))
        md += ["## Table 9: rotation and flipping", "", TABLE9_CAPTION, "", to_markdown(shown),
               "All conditions (including the left-right flip and the angle sweep): `rotation_conditions.csv`.", ""]
        if ctx.plots:
            files += plot_rotation(sweep, ctx.out)
            md += ["![accuracy against rotation angle](rotation_angle.png)", ""]
    return md, files


@report_section("pgd", order=20)
def pgd_section(ctx: ReportContext) -> tuple[list[str], list[Path]]:
    """SAN Table 10 and every PGD setting, from the pgd runs."""
    md: list[str] = []
    files: list[Path] = []
    t10 = pgd_table(ctx.runs)
    if not t10.empty:
        shown = format_pgd(t10)
        files += _paper_table(ctx, t10, shown, "table10_pgd",
                              groups=[("clean", 1), ("attack n=2", 2), ("attack n=4", 2)],
                              subheaders=["Method", "top-1", "s. rate", "top-1", "s. rate", "top-1"],
                              caption=TABLE10_CAPTION, label="tab:pgd")
        sweep = pgd_sweep(ctx.runs)
        files.append(write_csv(sweep, ctx.out / "pgd_conditions.csv"))
        cc = t10[t10["source"] == "ours"][["label", "n", "n2_success_rate_clean_correct",
                                           "n2_top1_clean_correct", "n4_success_rate_clean_correct",
                                           "n4_top1_clean_correct"]]
        md += ["## Table 10: targeted PGD", "", TABLE10_CAPTION, "", to_markdown(shown),
               "On the clean-correct images only:", "", to_markdown(cc),
               "Every attack setting (sweeps included): `pgd_conditions.csv`.", ""]
        if ctx.plots:
            files += plot_pgd(sweep, ctx.out)
            md += ["![PGD against steps](pgd_steps.png) ![PGD against eps](pgd_eps.png)", ""]
    return md, files
