"""The README's results say what the committed reports say.

Every cell ``X [L, H]`` (a value with its interval) in a README table row that starts with a
model name must be a value and interval of that model in some CSV of ``reports/`` (robust
accuracy, comparison, headline and corruption tables), and every cell under a column header
that names a robust-accuracy column (``clean``, ``APGD-CE 2/255``, ``AutoAttack 8/255``, ...)
must be that model's top-1 there, each to the decimals the README gives; every ``X [L, H]`` in
its text must be one a report gives (in a CSV or its report.md) for a model its sentence names
(or a Kendall's tau, where the sentence says tau); and the zoo tables must list
every shipped checkpoint as ``zoo/manifest.json`` records it. A README number copied
by hand, rounded twice (-5.65 from -5.6465 written -5.7) or left behind when a report was
regenerated fails here."""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the (value, low, high) column triples of the report CSVs
TRIPLES = (("value", "low", "high"), ("top1", "low", "high"),
           ("minus_best", "minus_best_low", "minus_best_high"),
           ("minus_baseline", "minus_baseline_low", "minus_baseline_high"))
NUMBER = r"[-+]?\d+(?:\.\d+)?"
CELL = re.compile(rf"^({NUMBER})(?: \[({NUMBER}), ({NUMBER})\])?")
INTERVAL = re.compile(rf"({NUMBER}) \[({NUMBER}), ({NUMBER})\]")
TAU = re.compile(rf"Kendall's tau ({NUMBER}) \[({NUMBER}), ({NUMBER})\]")


def _committed():
    """Per model: every (value, low, high) of the report CSVs and of the report.md tables, and
    every robust-accuracy top-1 per column name; and every Kendall's tau interval a report.md
    writes."""
    triples, top1, taus = defaultdict(set), defaultdict(set), set()
    for report in sorted(ROOT.glob("reports/*/report.md")):
        text = report.read_text()
        taus |= {tuple(float(x) for x in m.groups()) for m in TAU.finditer(text)}
        for _, _, cells in table_rows(text):
            model = cells[0].split(" [")[0]
            triples[model] |= {tuple(float(x) for x in m.groups()) for c in cells for m in INTERVAL.finditer(c)}
    for csv in sorted(ROOT.glob("reports/*/*.csv")):
        table = pd.read_csv(csv)
        if "model" not in table:
            continue
        for cols in TRIPLES:
            if set(cols) <= set(table.columns):
                for model, *values in table[["model", *cols]].itertuples(index=False):
                    triples[model].add(tuple(values))
        if {"column", "top1"} <= set(table.columns):
            for model, column, value in table[["model", "column", "top1"]].itertuples(index=False):
                top1[(model, column)].add(value)
    return triples, top1, taus


def _matches(written: tuple[str, ...], values) -> bool:
    """``values`` rounded to the decimals of ``written`` (strings as the README gives them)."""
    decimals = [len(w.split(".")[1]) if "." in w else 0 for w in written]
    return all(abs(float(w) - v) <= 0.5 * 10 ** -d + 1e-9 for w, v, d in zip(written, values, decimals))


def table_rows(text: str):
    """``(line number, header cells, cells)`` of every row of the README's tables, below the
    header and its separator."""
    header: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            header = []
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not header:
            header = cells
        elif not set("".join(cells)) <= set("-: "):
            yield number, header, cells


def readme_result_cells(text: str, models: set[str]) -> list[tuple[int, str, str, str]]:
    """``(line number, model, column header, cell)`` of the README's table rows whose first cell
    is a model (``name`` or ``name [dataset]``)."""
    return [(number, model, h, c) for number, header, cells in table_rows(text)
            if (model := cells[0].split(" [")[0]) in models for h, c in zip(header[1:], cells[1:])]


TRIPLE_SETS, TOP1, TAUS = _committed()
# the cells with something to check: a value with its interval, or a value under a robust-accuracy column
CELLS = [c for c in readme_result_cells(README.read_text(), set(TRIPLE_SETS) | {m for m, _ in TOP1})
         if (m := CELL.match(c[3])) and (m.group(2) is not None or (c[1], c[2]) in TOP1)]


def test_the_readme_has_results_to_check():
    with_interval = [c for c in CELLS if (m := CELL.match(c[3])) and m.group(2) is not None]
    assert len(with_interval) >= 80
    assert len([c for c in CELLS if (c[1], c[2]) in TOP1]) >= 60
    assert len(readme_prose_intervals(README.read_text())) >= 40


@pytest.mark.parametrize("line, model, header, cell", CELLS, ids=[f"{c[0]}-{c[1]}" for c in CELLS])
def test_each_readme_result_is_in_a_committed_report(line, model, header, cell):
    written = CELL.match(cell)
    value, low, high = written.groups()
    if low is not None:
        assert any(_matches((value, low, high), t) for t in TRIPLE_SETS[model]), (
            f"README line {line}: {model} {header} {cell} is in no committed report")
    if (model, header) in TOP1:
        assert any(_matches((value,), (t,)) for t in TOP1[(model, header)]), (
            f"README line {line}: {model} {header} {value}, the reports say {sorted(TOP1[(model, header)])}")


# a value and its interval in prose: "5.8 [2.9, 8.7]", and as the reports' findings write them,
# "0.83 points more [0.16, 1.54]", "68.97 points, 95% interval [68.17, 69.75]", "28.48 %, 95% interval [...]"
PROSE_INTERVAL = re.compile(rf"({NUMBER})(?:\s?%|\s+points?)?(?:\s+(?:more|less))?(?:,\s+95%\s+interval)?"
                            rf"\s+\[({NUMBER}),\s+({NUMBER})\]")
# how the README's text names the models (besides their zoo names)
MODEL_NAMES = {"ResNet-26": "resnet26", "SASA": "sasa_resnet26", "AA": "aa_resnet26", "GSA": "gsa_resnet26",
               "EA": "ea_resnet26", "SAN10 pairwise": "san10_pairwise", "SAN10 patchwise": "san10_patchwise",
               "sasa": "sasa_resnet26", "aa": "aa_resnet26", "gsa": "gsa_resnet26", "ea": "ea_resnet26"}
# where a statement ends: a full stop, a blank line, a list item, a table row
STATEMENT_END = re.compile(r"(?<=[.])\s+(?=[A-Z*(])|\n\s*\n|\n(?=\s*(?:- |\|))|(?<=\|)\n")


def models_named(text: str, models) -> set[str]:
    """The models ``text`` names, by zoo name or as ``MODEL_NAMES`` writes them (whole words; a
    name of two words may wrap a line)."""
    names = {m: m for m in models} | MODEL_NAMES
    pattern = {name: re.escape(name).replace(r"\ ", r"\s+") for name in names}
    return {model for name, model in names.items() if re.search(rf"(?<![\w-]){pattern[name]}(?![\w-])", text)}


def readme_prose_intervals(text: str) -> list[tuple[int, str, frozenset, bool]]:
    """``(line number, "X [L, H]", models its statement names, whether it names Kendall's tau)`` of
    every interval in the README outside its top-level tables (an interval may wrap a line; the
    statement is the sentence, list item or table row that holds it)."""
    prose = "\n".join("" if line.startswith("|") else line for line in text.splitlines())
    models = set(TRIPLE_SETS)
    found, start = [], 0
    for end in [m.start() for m in STATEMENT_END.finditer(prose)] + [len(prose)]:
        statement = prose[start:end]
        named = frozenset(models_named(statement, models))
        for m in PROSE_INTERVAL.finditer(statement):
            found.append((prose.count("\n", 0, start + m.start()) + 1,
                          f"{m.group(1)} [{m.group(2)}, {m.group(3)}]", named, "tau" in statement))
        start = end
    return found


PROSE = readme_prose_intervals(README.read_text())


def in_reports(interval: str, named: frozenset, tau: bool) -> bool:
    """Whether a report gives ``interval`` (either sign) for one of the ``named`` models (any
    model's where none is named), or as a Kendall's tau where its statement names one."""
    written = INTERVAL.fullmatch(interval).groups()
    known = set().union(*(TRIPLE_SETS[m] for m in (named or TRIPLE_SETS))) | (TAUS if tau or not named else set())
    return any(_matches(written, t) or _matches(written, (-t[0], -t[2], -t[1])) for t in known)


@pytest.mark.parametrize("line, interval, named, tau", PROSE, ids=[f"{p[0]}" for p in PROSE])
def test_each_interval_in_the_readme_text_is_in_a_committed_report(line, interval, named, tau):
    """A value with its interval in the README's text (a paired difference, written with either
    sign, "5.8 points more lost"; a Kendall's tau) is one a report gives, for one of the models
    its sentence names (any model's where it names none)."""
    assert in_reports(interval, named, tau), (
        f"README line {line}: {interval} is in no committed report"
        + (f" for {', '.join(sorted(named))}, the models its sentence names" if named else ""))


def test_an_interval_written_for_the_wrong_model_is_caught():
    """The prose check reads which model a sentence is about: aa_resnet26's own interval passes
    beside its name and fails beside another's; a tau passes only where the sentence says tau."""
    aa = sorted(t for t in TRIPLE_SETS["aa_resnet26"] if t not in TRIPLE_SETS["ea_resnet26"])[0]
    cell = f"{aa[0]:.4f} [{aa[1]:.4f}, {aa[2]:.4f}]"
    text = (f"AA keeps {cell} here.\nAnd the wrapped sentence about EA keeps\n{cell} there.\n\n"
            f"- ResNet-26 and SAN10 pairwise: {cell}.\n- And SAN10\n  patchwise's, wrapped: {cell}.\n")
    (_, _, aa_named, _), (line, _, ea_named, _), (_, _, pair, _), (_, _, wrapped, _) = readme_prose_intervals(text)
    assert (aa_named, ea_named, line) == ({"aa_resnet26"}, {"ea_resnet26"}, 3)
    assert pair == {"resnet26", "san10_pairwise"} and wrapped == {"san10_patchwise"}
    assert in_reports(cell, aa_named, False) and not in_reports(cell, ea_named, False)
    assert in_reports(cell, frozenset(), False)
    tau = sorted(TAUS)[0]
    tau_cell = f"{tau[0]:+.2f} [{tau[1]:+.2f}, {tau[2]:+.2f}]"
    assert in_reports(tau_cell, ea_named, True) and not in_reports(tau_cell, ea_named, False)


def readme_zoo_rows(text: str) -> list[tuple[int, dict[str, str]]]:
    """``(line number, {header: cell})`` of the README's table rows that name a checkpoint by the
    first 12 characters of its sha256."""
    return [(number, dict(zip(header, cells))) for number, header, cells in table_rows(text)
            if any(re.fullmatch(r"`[0-9a-f]{12}`", c) for c in cells)]


ZOO_ROWS = readme_zoo_rows(README.read_text())


def test_the_readme_zoo_tables_list_every_checkpoint():
    from robust_attn.models.manifest import Manifest

    shipped = {e.sha256[:12] for e in Manifest().entries.values() if e.source == "checkpoint"}
    listed = {row["sha256 (first 12)"].strip("`") for _, row in ZOO_ROWS}
    assert shipped <= listed, f"checkpoints the README's zoo tables do not list: {sorted(shipped - listed)}"


@pytest.mark.parametrize("line, row", ZOO_ROWS, ids=[str(n) for n, _ in ZOO_ROWS])
def test_each_readme_zoo_row_is_its_manifest_entry(line, row):
    """Model, test top-1 and top-5 and final train loss as the manifest records the checkpoint's
    training (the manifest's own test re-evaluates the checkpoints)."""
    from robust_attn.models.manifest import Manifest

    sha = row["sha256 (first 12)"].strip("`")
    entries = [e for e in Manifest().entries.values() if e.sha256.startswith(sha)]
    assert len(entries) == 1, f"README line {line}: no single manifest entry with sha256 {sha}"
    entry = entries[0]
    assert row["model"] == entry.name, f"README line {line}"
    metrics = entry.metrics
    assert row["test top-1"] == f"{metrics['eval_top1']:.2f}%", f"README line {line}"
    assert row["test top-5"] == f"{metrics['eval_top5']:.2f}%", f"README line {line}"
    if "final train loss" in row:
        assert row["final train loss"] == f"{metrics['train_loss']:.3f}", f"README line {line}"


# the README's table of attack speed against torchattacks: its columns, and the attack of
# benchmarks/results/attacks.json each shows (a ratio, ours over torchattacks; or our images/s)
ATTACK_SPEED_COLUMNS = {"PGD-10": ("pgd", "speedup"), "Table 10 {8,2,4}": ("table10", "speedup"),
                        "APGD-CE": ("apgd-ce", "speedup"), "APGD-T": ("apgd-t", "speedup"),
                        "Square": ("square", "speedup"), "FAB-T (ours)": ("fab-t", "ours_img_s"),
                        "AutoAttack (ours)": ("autoattack", "ours_img_s")}


def test_the_readme_attack_speed_table_is_benchmarks_results_attacks_json():
    import json

    rows = {(r["model"], r["attack"]): r for r in
            json.loads((ROOT / "benchmarks" / "results" / "attacks.json").read_text())["rows"]}
    checked = 0
    for number, header, cells in table_rows(README.read_text()):
        if set(ATTACK_SPEED_COLUMNS) <= set(header):
            for column, cell in zip(header[1:], cells[1:]):
                attack, key = ATTACK_SPEED_COLUMNS[column]
                written = cell.split()[0].rstrip("x")
                assert _matches((written,), (rows[(cells[0], attack)][key],)), (number, cells[0], column, cell)
                checked += 1
    assert checked == 7 * len(ATTACK_SPEED_COLUMNS)
