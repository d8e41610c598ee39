"""The report's attack sections: a RobustBench-style table, the transfer matrix as a
heat map, and the gradient-masking verdicts.

* Robust accuracy table: per model, clean top-1 and top-1 under AutoAttack at each eps (and
  under Square alone), each with its percentile bootstrap interval over the attacked images,
  and the number of images (RobustBench reports clean and AutoAttack accuracy the same way,
  without intervals).
* AutoAttack's members: per model and radius, how many images each member fooled first (the
  records' ``by``), so the table shows what APGD-T, FAB-T and Square add to APGD-CE alone.
* Transfer matrix: top-1 of every target under the images crafted on every source (the
  diagonal is the white-box attack on the model itself); drawn as a heat map.
* Masking verdicts: every check of ``checks.json`` in the masking runs, per model: name, verdict
  and the evidence's summary.

Everything is computed from the per-image records (:func:`robust_attn.runs.store.load_records`).
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from robust_attn.protocols.report_section import ReportContext, report_section
from robust_attn.reports.runs import model_names
from robust_attn.reports.stats import bootstrap_mean_ci

__all__ = ["ATTACK_LABELS", "robust_accuracy_table", "autoattack_members_table", "autoattack_disagreements",
           "format_robust_accuracy", "transfer_matrix", "plot_transfer_matrix", "masking_table", "eps_label"]


#: how the report names the attacks of the study's attack protocols
ATTACK_LABELS = {"autoattack": "AutoAttack", "square": "Square", "apgd-ce": "APGD-CE"}


def eps_label(condition: dict) -> str:
    """``AutoAttack 8/255`` for an L-inf condition of run.json, ``... L2 0.5`` for L2."""
    name = ATTACK_LABELS.get(condition["attack"], condition["attack"])
    if condition.get("norm", "linf") == "linf":
        return f"{name} {condition['eps'] * 255:.3g}/255"
    return f"{name} L2 {condition['eps']:.3g}"


def robust_accuracy_table(runs, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> pd.DataFrame:
    """Long format: model, dataset, column (``clean`` or an attack label), n, top1, low, high.
    From the runs of the ``attack`` protocol (AutoAttack and Square runs alike); the clean
    accuracy is taken once per model, from the first run that has it. Models are named by
    :func:`~robust_attn.reports.runs.model_names` (two checkpoints of one model stay apart)."""
    rows = []
    seen_clean = set()
    names = model_names(runs)
    for run in (r for r in runs if r.protocol == "attack"):
        by_name = {c["name"]: c for c in run.description["conditions"]}
        for condition, group in run.records.groupby("condition", sort=False):
            if condition == "clean":
                key = (names[id(run)], run.dataset)
                if key in seen_clean:
                    continue
                seen_clean.add(key)
                label = "clean"
            else:
                label = eps_label(by_name[condition])
            ci = bootstrap_mean_ci(group["top1"].to_numpy(), n_boot=n_boot, seed=seed, level=level)
            order = (0, "", 0.0) if label == "clean" else (1, by_name[condition]["attack"], by_name[condition]["eps"])
            rows.append({"model": names[id(run)], "dataset": run.dataset, "column": label, "n": len(group),
                         "top1": ci.value, "low": ci.low, "high": ci.high, "_order": order})
    if not rows:
        return pd.DataFrame()
    # one order whatever the order of the runs: by model, then clean, then attack and eps
    frame = pd.DataFrame(rows).sort_values(["model", "dataset", "_order"], kind="stable")
    return frame.drop(columns="_order").reset_index(drop=True)


def format_robust_accuracy(table: pd.DataFrame) -> pd.DataFrame:
    """Wide: one row per model, ``top1 [low, high]`` per column, clean first, the image count: the
    largest of the model's columns, followed by each column on fewer images and its count
    (``1000 (AutoAttack 2/255: 500)``, an attack run on a subset of the attack images)."""
    if table.empty:
        return table
    cells = table.assign(cell=[f"{v:.1f} [{lo:.1f}, {hi:.1f}]" for v, lo, hi in
                               zip(table["top1"], table["low"], table["high"])])
    order = ["clean", *sorted(set(cells["column"]) - {"clean"}, key=_column_key)]
    wide = cells.pivot_table(index=["model", "dataset"], columns="column", values="cell", aggfunc="first",
                             sort=False)
    wide = wide[[c for c in order if c in wide.columns]].reset_index()
    images = pd.DataFrame([{"model": model, "dataset": dataset, "images": _image_counts(rows)}
                           for (model, dataset), rows in cells.groupby(["model", "dataset"], sort=False)])
    return wide.merge(images, on=["model", "dataset"])


def _image_counts(rows: pd.DataFrame) -> int | str:
    """The largest image count of one model's columns (its rows of the long table), then each
    column on fewer images with its count."""
    largest = int(rows["n"].max())
    fewer = [f"{column}: {int(n)}" for column, n in zip(rows["column"], rows["n"]) if n < largest]
    return largest if not fewer else f"{largest} ({', '.join(fewer)})"


def _column_key(label: str) -> tuple:
    """Columns by attack, then norm, then radius (whichever models have them), from
    :func:`eps_label`'s ``Name E/255`` or ``Name L2 E``."""
    name, _, eps = label.rpartition(" ")
    norm = "linf"
    if name.endswith(" L2"):
        name, norm = name[:-3], "l2"
    try:
        return (name, norm, float(eps.removesuffix("/255")))
    except ValueError:
        return (label, "", 0.0)


def autoattack_members_table(runs) -> pd.DataFrame:
    """Per model and AutoAttack condition: the images counted by who fooled them first
    (``clean``: misclassified without attack; a member's name; ``none``: robust to all four),
    in the ensemble's order, from the records' ``by`` column."""
    from robust_attn.attacks.autoattack import STANDARD

    rows = []
    names = model_names(runs)
    for run, label, group, by in _autoattack_groups(runs):
        counts = by.value_counts()
        members = [m for m in counts.index if m not in ("clean", "none", *STANDARD)]
        rows.append({"model": names[id(run)], "attack": label, "images": len(group),
                     **{m: int(counts.get(m, 0)) for m in ("clean", *STANDARD, *members, "none")}})
    return pd.DataFrame(rows).fillna(0) if rows else pd.DataFrame()


def _autoattack_groups(runs):
    """``(run, label, records, by)`` per AutoAttack condition of the attack runs; ``by`` with
    empty entries as ``"none"``."""
    for run in (r for r in runs if r.protocol == "attack"):
        by_name = {c["name"]: c for c in run.description["conditions"]}
        for condition, group in run.records.groupby("condition", sort=False):
            if by_name.get(condition, {}).get("attack") == "autoattack":
                yield run, eps_label(by_name[condition]), group, group["by"].fillna("none").replace("", "none")


def autoattack_disagreements(runs) -> pd.DataFrame:
    """Per model and AutoAttack condition with any: the images whose ``by`` and record disagree
    (a member named but the record classifies the image correctly, or ``none`` but the record
    misclassifies it). The ensemble judges each member in the chunk's batch, yet a later member's
    images change that batch, and float rounding depends on it, so a borderline image can still
    flip; the robust accuracy is the records' (``top1``) either way. Columns: ``model, attack,
    named_but_correct, none_but_wrong, indices`` (the first few)."""
    rows = []
    names = model_names(runs)
    for run, label, group, by in _autoattack_groups(runs):
        named = ~by.isin(("clean", "none")) & (group["top1"] == 1)
        unnamed = (by == "none") & (group["top1"] == 0)
        if named.any() or unnamed.any():
            rows.append({"model": names[id(run)], "attack": label, "named_but_correct": int(named.sum()),
                         "none_but_wrong": int(unnamed.sum()),
                         "indices": " ".join(map(str, group["index"][named | unnamed].head(10)))})
    return pd.DataFrame(rows)


def transfer_matrix(runs, attack: str | None = None) -> pd.DataFrame:
    """Top-1 (percent) of each target (columns) under the images crafted on each source (rows),
    for one crafting ``attack`` (default: the untargeted one, else the first). A source named as
    its run's model is named by :func:`~robust_attn.reports.runs.model_names` (two checkpoints of
    one model are two rows, not one row of their mean)."""
    names = model_names(runs)
    frames = [r.records.replace({"source": {r.model: names[id(r)]}}) for r in runs if r.protocol == "transfer"]
    if not frames:
        return pd.DataFrame()
    records = pd.concat(frames, ignore_index=True)
    records["attack"] = records["condition"].str.partition(".")[0]
    attacks = [a for a in dict.fromkeys(records["attack"]) if a != "clean"]
    if attack is None:
        untargeted = [a for a in attacks if (records.loc[records["attack"] == a, "target"] == -1).all()]
        attack = (untargeted or attacks)[0]
    chosen = records[records["attack"] == attack]
    matrix = chosen.pivot_table(index="source", columns="target_model", values="top1", aggfunc="mean") * 100
    matrix.attrs["attack"] = attack
    return matrix


def plot_transfer_matrix(matrix: pd.DataFrame, path: Path) -> Path | None:
    """A heat map of :func:`transfer_matrix`, the value in every cell."""
    if matrix.empty:
        return None
    from robust_attn.reports import plots  # noqa: F401  (selects the Agg backend)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.1 * len(matrix.columns) + 2.5, 0.7 * len(matrix) + 1.8))
    image = ax.imshow(matrix.to_numpy(), cmap="viridis", vmin=0, vmax=100)
    ax.set_xticks(range(len(matrix.columns)), matrix.columns, rotation=45, ha="right")
    ax.set_yticks(range(len(matrix.index)), matrix.index)
    ax.set_xlabel("target model")
    ax.set_ylabel("source model (adversarial images crafted on)")
    for i in range(len(matrix.index)):
        for j in range(len(matrix.columns)):
            value = matrix.iat[i, j]
            ax.text(j, i, f"{value:.0f}", ha="center", va="center", color="white" if value < 50 else "black")
    fig.colorbar(image, ax=ax, label="target top-1 (%)")
    ax.set_title(f"transfer: {matrix.attrs.get('attack', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def masking_table(run_dirs) -> pd.DataFrame:
    """model, check, verdict, detail: every gradient-masking check saved with the runs
    (``checks.json`` entries that carry a ``verdict``)."""
    rows = []
    for d in run_dirs:
        path = Path(d) / "checks.json"
        if not path.is_file():
            continue
        description = json.loads((Path(d) / "run.json").read_text())
        for check in json.loads(path.read_text()):
            if "verdict" in check:
                rows.append({"model": description["model"], "check": check["name"], "verdict": check["verdict"],
                             "detail": check.get("detail", "")})
    return pd.DataFrame(rows)


def attack_sections(runs, out: Path, n_boot: int = 1000, seed: int = 0, level: float = 0.95,
                    plots: bool = True) -> tuple[list[str], list[Path]]:
    """The report's Markdown lines and files for the attack, transfer and masking runs."""
    from robust_attn.reports.formats import to_markdown
    from robust_attn.utils.io import atomic_path

    md: list[str] = []
    files: list[Path] = []

    def write_csv(frame: pd.DataFrame, name: str) -> None:
        with atomic_path(out / name) as tmp:
            frame.to_csv(tmp, index=False, float_format="%.4f")
        files.append(out / name)

    table = robust_accuracy_table(runs, n_boot=n_boot, seed=seed, level=level)
    if not table.empty:
        write_csv(table, "robust_accuracy.csv")
        md += ["## Robust accuracy (RobustBench layout)", "",
               f"Top-1 (%) on the clean images and under each attack (untargeted L-inf; AutoAttack: the worst case "
               f"per image over APGD-CE, APGD-T, FAB-T and Square; APGD-CE: its first member alone, an upper "
               f"bound on AutoAttack's number), with {level:.0%} percentile bootstrap intervals "
               f"over the attacked images ({n_boot} resamples).", "",
               to_markdown(format_robust_accuracy(table)), ""]
    members = autoattack_members_table(runs)
    if not members.empty:
        write_csv(members, "autoattack_members.csv")
        md += ["## What each AutoAttack member adds", "",
               "Images per model counted by who fooled them first: misclassified already (`clean`), each member "
               "in the ensemble's order, or none (`none`: robust to all four). What the members after APGD-CE "
               "fool is what APGD-CE alone would have missed.", "", to_markdown(members), ""]
        disagree = autoattack_disagreements(runs)
        if not disagree.empty:
            md += [f"**{int(disagree[['named_but_correct', 'none_but_wrong']].sum().sum())} images' `by` disagrees "
                   "with their record** (float rounding depends on the batch, and a later member changed the "
                   "batch a borderline image was judged in); the top-1 above is the records':", "",
                   to_markdown(disagree), ""]
    matrix = transfer_matrix(runs)
    if not matrix.empty:
        write_csv(matrix.reset_index(), "transfer_matrix.csv")
        md += ["## Transfer matrix", "",
               f"Top-1 (%) of each target model (columns) on adversarial images crafted on each source (rows) with "
               f"`{matrix.attrs['attack']}`; the diagonal is the white-box attack. Every crafting attack, per "
               f"image: the packed transfer runs.", "", to_markdown(matrix.round(1).reset_index()), ""]
        if plots and plot_transfer_matrix(matrix, out / "transfer_matrix.png"):
            files.append(out / "transfer_matrix.png")
            md += ["![transfer matrix](transfer_matrix.png)", ""]
    verdicts = masking_table([r.path for r in runs if r.protocol == "masking"])
    if not verdicts.empty:
        write_csv(verdicts, "masking_checks.csv")
        flagged = verdicts[verdicts["verdict"] != "pass"]
        md += ["## Gradient-masking checks", "",
               f"{len(flagged)} of {len(verdicts)} checks flagged"
               + (": " + ", ".join(f"{m} ({c})" for m, c in zip(flagged["model"], flagged["check"])) if len(flagged)
                  else "") + ".", "", to_markdown(verdicts), ""]
    return md, files


@report_section("attacks", order=30, protocols=("attack", "transfer", "masking"))
def attack_report(ctx: ReportContext) -> tuple[list[str], list[Path]]:
    """The report's attack sections (:func:`attack_sections`) for the attack, transfer and masking runs."""
    return attack_sections(ctx.runs, ctx.out, n_boot=ctx.n_boot, seed=ctx.seed, level=ctx.level, plots=ctx.plots)
