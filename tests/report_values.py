"""What the committed reports say, per model, for the docs' numbers test (test_readme_numbers.py):
each report folder's CSVs read into the values a README table cell or sentence may quote, keyed
by model and by what the number is (a robust-accuracy column, a Table 9/10 condition, a
finding's measure, a difference between two models, an adversarial-training answer, an
across-scale finding)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"[-+]?\d+(?:\.\d+)?"
TAU = re.compile(rf"Kendall's tau ({NUMBER}) \[({NUMBER}), ({NUMBER})\]")


@dataclass
class Report:
    """One committed report folder: its dataset and, per model, what its CSVs give."""
    path: str
    dataset: str
    # (model, key) -> set of tuples; key names the column or measure and the kind of number
    values: dict = field(default_factory=dict)
    # (model, protocol) -> seconds summed over the timed calls
    timings: dict = field(default_factory=dict)
    text: str = ""   # report.md, its whitespace collapsed

    def add(self, model, key, numbers):
        self.values.setdefault((model, key), set()).add(tuple(float(x) for x in numbers))


def _triples(frame: pd.DataFrame, cols):
    return frame[list(cols)].itertuples(index=False)


@lru_cache(maxsize=None)
def reports() -> dict[str, Report]:
    """Every committed report folder, keyed by its path from the repository root."""
    found = {}
    for md in sorted(ROOT.glob("reports/**/report.md")):
        if "runs" in md.parent.relative_to(ROOT).parts:
            continue
        report = read_report(md.parent)
        found[report.path] = report
    return found


def _adversarial_training(report: Report, table: pd.DataFrame) -> None:
    """The adversarial-training section's answers (robust_attn/reports/adversarial.py): each
    model's difference from the most robust of its training, each adversarial model's gain over
    its standard one per measure, and SAN10 pairwise minus the baseline per attack and training."""
    for row in table.to_dict("records"):
        value = [row["value"], row["low"], row["high"]]
        if row["question"] == "most_robust" and not pd.isna(row["minus_best"]):
            same = table[(table["question"] == "most_robust") & (table["training"] == row["training"])]
            best = same.loc[same["minus_best"].isna(), "model"].iloc[0]
            minus = [row["minus_best"], row["minus_best_low"], row["minus_best_high"]]
            radius = re.search(rf"eps ({NUMBER})/255", row["training"])   # AutoAttack at the training radius
            if radius:
                report.add(row["model"], ("adversarial", f"AutoAttack {radius.group(1)}/255 minus best"), minus)
            report.add(row["model"], ("pair", "adversarial:most_robust", "minus_best", best), minus)
        elif row["question"] == "gain":
            report.add(row["model"], ("adversarial_gain", row["measure"]), value)
            report.add(row["model"], ("pair", f"adversarial_gain:{row['measure']}", "gain", row["standard"]), value)
        elif row["question"] == "weakness":
            weak, baseline = row["model"].split(" minus ")
            report.add(weak, ("pair", f"weakness:{row['family']}:{row['attack']}", "minus_baseline", baseline), value)


def _across_scale(report: Report, table: pd.DataFrame) -> None:
    """The across-scale findings (robust_attn/reports/across_scale.py): each finding's statistic in
    each zoo under its claim and verdict (for the tables that copy them), and for the text as a
    difference between the two models it compares (``A minus B``), or model-free (a chance level,
    a Kendall's tau)."""
    for row in table.to_dict("records"):
        if row["verdict"] == "not measured":
            continue
        value = [row["value"], row["low"], row["high"]]
        report.add("*", ("across_claim", row["claim"], row["zoo"], row["verdict"]), value)
        key = f"across:{row['finding']}:{row['zoo']}:{row['measure']}"
        pair = re.match(r"(\S+) minus (\S+?)(?:;|$)", str(row["detail"]))   # "A minus B[; k of n pairs ...]"
        if row["kind"] == "less" and pair:
            report.add(pair.group(1), ("pair", key, "minus", pair.group(2)), value)
        else:
            report.add("*", ("across", key), value)


def read_report(folder: Path) -> Report:
    """What one report folder's CSVs give, per model."""
    csvs = {p.stem: pd.read_csv(p) for p in folder.glob("*.csv")}
    datasets = {d for t in csvs.values() if "dataset" in t for d in t["dataset"].dropna().unique()}
    report = Report(folder.relative_to(ROOT).as_posix() if folder.is_relative_to(ROOT) else str(folder),
                    datasets.pop() if len(datasets) == 1 else "")
    if "robust_accuracy" in csvs:
        for model, column, *v in _triples(csvs["robust_accuracy"], ["model", "column", "top1", "low", "high"]):
            report.add(model, ("robust", column), v)
    for name in ("table9_rotation", "table10_pgd"):
        if name in csvs:
            table = csvs[name][csvs[name]["source"] == "ours"]
            for row in table.to_dict("records"):
                for key, value in row.items():
                    if isinstance(value, float):
                        report.add(row["model"], (name, key), [value])
    if "comparison" in csvs:
        comparison = csvs["comparison"]
        # the other model of each difference: the measure's best, and the baseline (no difference of its own)
        best = comparison[comparison["minus_best"].isna()].set_index("measure")["model"].to_dict()
        baseline = comparison[comparison["minus_baseline"].isna()].set_index("measure")["model"].to_dict()
        for row in comparison.to_dict("records"):
            for kind, other in (("value", None), ("minus_best", best), ("minus_baseline", baseline)):
                cols = [kind, f"{kind}_low", f"{kind}_high"] if kind != "value" else ["value", "low", "high"]
                if not pd.isna(row[cols[0]]):
                    report.add(row["model"], ("measure", row["measure"], kind), [row[c] for c in cols])
                    report.add(row["model"], ("title", row["title"], kind), [row[c] for c in cols])
                    if other is not None:   # for the text: a difference between two models
                        report.add(row["model"], ("pair", row["measure"], kind, other.get(row["measure"])),
                                   [row[c] for c in cols])
    if "corruption_summary" in csvs:
        for model, value in _triples(csvs["corruption_summary"], ["model", "relative_mCE"]):
            report.add(model, ("relative_mCE",), [value])
    if "transfer_matrix" in csvs:
        matrix = csvs["transfer_matrix"].set_index("source")
        for model in matrix.index:
            report.add(model, ("whitebox_pgd10",), [matrix.loc[model, model]])
    if "autoattack_members" in csvs:
        members = csvs["autoattack_members"]
        for row in members.to_dict("records"):
            report.add(row["model"], ("members", row["attack"], "apgd-t"), [row["apgd-t"]])
        for model, group in members.groupby("model"):
            for member in ("fab-t", "square"):
                report.add(model, ("members_all", member), [group[member].sum()])
    if "headline_ci" in csvs:
        for model, metric, *v in _triples(csvs["headline_ci"], ["model", "metric", "value", "low", "high"]):
            report.add(model, ("headline", metric), v)
    if "timings" in csvs:
        timed = csvs["timings"][csvs["timings"]["chunks_written"] > 0]
        report.timings = timed.groupby(["model", "protocol"])["seconds"].sum().to_dict()
    if "adversarial_training" in csvs:
        _adversarial_training(report, csvs["adversarial_training"])
    if "across_scale" in csvs:
        _across_scale(report, csvs["across_scale"])
    text = (folder / "report.md").read_text()
    for m in TAU.finditer(text):
        report.add("*", ("tau",), m.groups())
    report.text = " ".join(text.split())
    return report
