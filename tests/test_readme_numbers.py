"""The README's and the docs' numbers say what the committed reports, the zoo manifest and the
benchmark results say, each in its place.

Every Markdown file a reader is sent to (``README.md``, ``docs/``, ``zoo/README.md``,
``benchmarks/README.md``, ``reports/README.md`` and each report folder's README) is read table by
table and statement by statement:

- a **results table** (its rows start with a model) is tied to the reports it comes from: a
  report folder's README to its own report (and those a ``<!-- numbers: reports/A reports/B -->``
  line before the table names, of the same dataset). Each numeric cell is looked up by its row's
  model and its column's header in that report's CSVs (robust accuracy by column, Tables 9 and 10
  by condition, the findings' measures by the bold title above the table, the adversarial-training
  answers by ``AutoAttack E/255 gain``, ``AutoAttack E/255 minus best`` and ``clean``/``rotated``/
  ``corrupted top-1 change``, timings by protocol; a model is a family's or its ``-adv`` one):
  a header no rule knows, a model the report lacks, another dataset, or a value that differs at
  the decimals written is an error;
- a table of other numbers says where they come from on the line before it:
  ``<!-- numbers: benchmarks/results/FILE.json -->`` (each number is one of that file's, at the
  decimals written), ``<!-- numbers: zoo/manifest.json (...) -->`` (the checkpoint rows) or
  ``<!-- numbers: prose (why) -->``; a table with numbers and none of these is an error;
- each ``X [L, H]`` in the text is a value with its interval that one of the statement's reports
  gives for a model the statement names, at a radius it names (``4/255``; Table 10's ``{8, 2, 4}``
  is 8/255), and as a difference (``more``, ``less``, ``larger`` ...) only where the statement
  says so near it (the adversarial-training gains, the differences from the most robust model of
  one training, and SAN10 pairwise minus ResNet-26 under each training are such differences).

A number copied by hand into the wrong column, condition, dataset or model, rounded twice, or left
behind when a report was regenerated fails here. What each report gives is read in
tests/report_values.py."""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from report_values import NUMBER, ROOT, Report, read_report, reports

NOTE = re.compile(r"^<!-- numbers: (.*?) -->$")
FAMILIES = {"resnet26", "aa_resnet26", "ea_resnet26", "gsa_resnet26", "sasa_resnet26", "san10_pairwise",
            "san10_patchwise"}
MODELS = FAMILIES | {f"{m}-adv" for m in FAMILIES}   # a family's model, and its adversarially trained one
# how the text names the models (besides their zoo names)
MODEL_NAMES = {"ResNet-26": "resnet26", "SASA": "sasa_resnet26", "AA": "aa_resnet26", "GSA": "gsa_resnet26",
               "EA": "ea_resnet26", "External Attention": "ea_resnet26", "SAN10 pairwise": "san10_pairwise",
               "SAN10 patchwise": "san10_patchwise", "sasa": "sasa_resnet26", "aa": "aa_resnet26",
               "gsa": "gsa_resnet26", "ea": "ea_resnet26", "AA-ResNet-26": "aa_resnet26"}


def doc_files(root: Path = ROOT) -> list[Path]:
    """The Markdown files a reader is sent to (a report's packed runs excluded)."""
    found = [root / "README.md", root / "zoo" / "README.md", root / "benchmarks" / "README.md"]
    found += sorted((root / "docs").glob("*.md"))
    found += [p for p in sorted((root / "reports").rglob("README.md")) if "runs" not in p.relative_to(root).parts]
    return [p for p in found if p.is_file()]


DOCS = doc_files()



def _matches(written, values) -> bool:
    """``values`` rounded to the decimals of ``written`` (strings as the docs give them)."""
    decimals = [len(w.split(".")[1]) if "." in w else 0 for w in written]
    return len(written) == len(values) and all(
        abs(float(w) - v) <= 0.5 * 10 ** -d + 1e-9 for w, v, d in zip(written, values, decimals))


# -- tables --------------------------------------------------------------------------------------

@dataclass
class Table:
    path: Path
    line: int
    note: str | None
    caption: str
    header: list
    rows: list   # (line number, cells)


def tables(path: Path, text: str | None = None) -> list[Table]:
    """The pipe tables of a Markdown file (indented ones too), each with the ``<!-- numbers: -->``
    note on the line before it (blank lines between allowed) and the paragraph above it."""
    lines = (path.read_text() if text is None else text).splitlines()
    found, i = [], 0
    while i < len(lines):
        if not lines[i].strip().startswith("|"):
            i += 1
            continue
        start, rows = i, []
        while i < len(lines) and lines[i].strip().startswith("|"):
            rows.append((i + 1, [c.strip() for c in lines[i].strip().strip("|").split("|")]))
            i += 1
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        note = NOTE.match(lines[j].strip()) if j >= 0 else None
        above = []
        while j >= 0 and lines[j].strip() and not lines[j].strip().startswith("|"):
            above.insert(0, lines[j].strip())
            j -= 1
        body = [r for r in rows[1:] if not set("".join(r[1])) <= set("-: ")]
        found.append(Table(path, start + 1, note.group(1) if note else None, " ".join(above), rows[0][1], body))
    return found


def has_number(cell: str) -> bool:
    """Whether a cell is a number (a value, a ratio, a size, a value with its interval; ``- (V
    points)``), not text that mentions one."""
    return re.match(r"[-+]?\d", cell.strip()) is not None or BASELINE_CELL.match(cell.strip()) is not None


def model_of(cell: str) -> tuple[str, str | None]:
    """``name`` or ``name [dataset]`` -> (name, dataset)."""
    m = re.fullmatch(r"(\S+)(?: \[(\w+)\])?", cell)
    return (m.group(1), m.group(2)) if m else (cell, None)


def table_reports(table: Table) -> list[Report]:
    """The reports a results table comes from: those its note names, else its folder's own."""
    known = reports()
    if table.note and table.note.startswith("reports/"):
        names = table.note.split()
    else:
        folder = table.path.parent.relative_to(ROOT).as_posix()
        names = [folder] if folder in known else []
    missing = [n for n in names if n not in known]
    assert not missing, f"{table.path.name}:{table.line}: no committed report {missing}"
    return [known[n] for n in names]


# a cell: a value, with an interval or a bracketed second number (Table 9's drop; minus the baseline)
CELL = re.compile(rf"^({NUMBER})(?: \[({NUMBER}), ({NUMBER})\])?(?:\s?\(({NUMBER})(?: n\.s\.)?\))?"
                  rf"(?: \(n\.s\.\)| n\.s\.)?$")
BASELINE_CELL = re.compile(rf"^- \(({NUMBER}) points\)$")
TABLE9 = {"no rotation": "none", "clockwise 90°": "cw90", "cw 90°": "cw90", "clockwise 180°": "cw180",
          "cw 180°": "cw180", "clockwise 270°": "cw270", "cw 270°": "cw270", "upside-down": "flip_ud"}
TABLE10 = {"clean top-1": "clean_top1", "n=2 s. rate": "n2_success_rate", "n=2 top-1": "n2_top1",
           "n=4 s. rate": "n4_success_rate", "n=4 top-1": "n4_top1"}


def _title(caption: str) -> str | None:
    m = re.search(r"\*\*(.+?)\*\*", caption)
    return m.group(1) if m else None


def cell_keys(header: str, caption: str) -> tuple[tuple, tuple | None] | None:
    """Where a results table's column is in a report: the key of the cell's first number and of its
    bracketed second one (None where the column has none); None for a header no rule knows."""
    h = header
    if h in TABLE10:
        return ("table10_pgd", TABLE10[h]), None
    m = re.fullmatch(r"(.+) top-([15])", h)
    if m and m.group(1) in TABLE9:
        cond = f"{TABLE9[m.group(1)]}_top{m.group(2)}"
        return ("table9_rotation", cond), ("table9_rotation", f"{cond}_drop")
    if h == "10-step PGD 8/255":
        return ("whitebox_pgd10",), None
    if re.fullmatch(r"Table 10 \{8, 2, 4\} \([\d,]+ images\)", h):
        return ("table10_pgd", "n4_top1"), None
    if h == "Table 10 {8, 2, 4}: top-1 drop":
        return ("measure", "pgd_drop:pgd_eps8_step2_n4", "value"), ("measure", "pgd_drop:pgd_eps8_step2_n4",
                                                                      "minus_baseline")
    m = re.fullmatch(r"eps (\d+), step ([\d.]+), n (\d+)", h)
    if m and "drop" in caption.lower():
        return ("measure", f"pgd_drop:pgd_eps{m.group(1)}_step{m.group(2)}_n{m.group(3)}", "value"), None
    shifted = {"rotation: Table 9 mean drop": "rotation_drop", "corruptions: mean top-1 drop": "shift_drop:corruption"}
    if h in shifted:
        return ("measure", shifted[h], "value"), ("measure", shifted[h], "minus_baseline")
    if h.endswith(", minus resnet26") and h[: -len(", minus resnet26")] in shifted:
        return ("measure", shifted[h[: -len(", minus resnet26")]], "minus_baseline"), None
    if h == "relative mCE":
        return ("relative_mCE",), None
    m = re.fullmatch(r"APGD-T added at (\d+)/255", h)
    if m:
        return ("members", f"AutoAttack {m.group(1)}/255", "apgd-t"), None
    m = re.fullmatch(r"(FAB-T|Square) added, all radii", h)
    if m:
        return ("members_all", m.group(1).lower()), None
    m = re.fullmatch(rf"(AutoAttack {NUMBER}/255) gain", h)   # adversarial minus standard training, per family
    if m:
        return ("adversarial_gain", m.group(1)), None
    changed = {"clean top-1 change": "clean", "rotated top-1 change": "rotation",
               "corrupted top-1 change": "corruption"}
    if h in changed:
        return ("adversarial_gain", changed[h]), None
    if re.fullmatch(rf"AutoAttack {NUMBER}/255 minus best", h):   # under the same adversarial training, at its radius
        return ("adversarial", h), None
    title = _title(caption)
    kinds = {"points [interval]": "value", "% [interval]": "value", "minus best": "minus_best",
             "minus resnet26": "minus_baseline"}
    if h in kinds and title:
        return ("title", title, kinds[h]), None
    if re.fullmatch(r"[\w-]+(?: [\w-]+)* \d+/255|clean", h):
        return ("robust", h), None
    return None


def check_results_cell(table: Table, model: str, header: str, cell: str, line: int) -> str | None:
    """None where the cell is what its reports give; else what is wrong."""
    where = f"{table.path.relative_to(ROOT)}:{line}: {model} | {header} | {cell}"
    keys = cell_keys(header, table.caption)
    if keys is None:
        return f"{where}: no rule says where the column {header!r} is in a report"
    found = table_reports(table)
    if not found:
        return f"{where}: the table names no report (a `<!-- numbers: reports/... -->` line before it)"
    if BASELINE_CELL.match(cell):   # the baseline's own row: "- (44.2 points)"
        written = (BASELINE_CELL.match(cell).group(1),)
        first = (keys[0][0], keys[0][1], "value")
        ok = any(_matches(written, v[:1]) for r in found for v in r.values.get((model, first), ()))
        return None if ok else f"{where}: the reports give {model} another value"
    m = CELL.match(cell)
    if m is None:
        return f"{where}: not a value, a value with its interval, or a value with a bracketed number"
    value, low, high, second = m.groups()
    candidates = [v for r in found for v in r.values.get((model, keys[0]), ())]
    if not candidates:
        return f"{where}: the reports {[r.path for r in found]} have no {keys[0]} for {model}"
    written = (value, low, high) if low is not None else (value,)
    if not any(_matches(written, v[:len(written)]) for v in candidates):
        return f"{where}: the reports give {sorted(candidates)}"
    if second is not None:
        if keys[1] is None:
            return f"{where}: a bracketed number where the column has none"
        seconds = [v for r in found for v in r.values.get((model, keys[1]), ())]
        if not any(_matches((second,), v[:1]) for v in seconds):
            return f"{where}: the bracketed {second} is not {keys[1]}: {sorted(seconds)}"
    return None


def check_timings_cell(table: Table, model: str, header: str, cell: str, line: int) -> str | None:
    where = f"{table.path.relative_to(ROOT)}:{line}: {model} | {header} | {cell}"
    protocol = re.fullmatch(r"(.+) \(s\)", header)
    m = re.fullmatch(rf"({NUMBER})(?: \(shared\))?", cell)
    if not protocol or not m:
        return f"{where}: a timings table holds seconds under 'PROTOCOL (s)'"
    timings = table_reports(table)[0].timings
    wanted = protocol.group(1).lower()
    if model == "all seven":
        value = sum(s for (mod, p), s in timings.items() if p == wanted and mod != "all")
    elif (model, wanted) in timings:
        value = timings[(model, wanted)]
    else:
        return f"{where}: timings.csv has no {wanted} for {model}"
    return None if _matches((m.group(1),), (value,)) else f"{where}: timings.csv sums to {value:.1f}"


def _json_numbers(path: Path) -> list[float]:
    found = []

    def walk(x):
        if isinstance(x, bool):
            return
        if isinstance(x, (int, float)):
            found.append(float(x))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(json.loads(path.read_text()))
    return found


def check_benchmark_cell(files: list[Path], cell: str) -> list[str]:
    """The numbers of a benchmark table's cell that none of its results files holds."""
    numbers = [n for f in files for n in _json_numbers(f)]
    missing = []
    for token in re.findall(r"(?<![\w/.\-])(\d+(?:\.\d+)?)", cell):
        if not any(_matches((token,), (n,)) for n in numbers):
            missing.append(token)
    return missing


# the train-step benchmark's columns and the fields of its results rows
TRAIN_STEP_COLUMNS = {"params": "params_M", "ms/step": "ms_per_step", "img/s": "images_per_s",
                      "time x resnet26": "slowdown_vs_resnet26", "peak MiB": "peak_memory_MiB",
                      "memory x resnet26": "memory_vs_resnet26"}


# a cell of an across-scale table: "yes: +5.6 [+4.7, +6.5] (resnet26 minus san10_pairwise; 10,000 images)"
VERDICT_CELL = re.compile(rf"^(yes|no|unresolved): ({NUMBER}) \[({NUMBER}), ({NUMBER})\]")


def across_problems(table: Table) -> list[str]:
    """A table of findings laid out as the across-scale report's (``finding``: a claim as it
    writes it; then the reference zoo, the other zoo): each ``verdict: value [low, high]`` cell is
    that claim's in its column's zoo, with that verdict, in the reports the table names."""
    where = f"{table.path.relative_to(ROOT)}:{table.line}"
    found = table_reports(table)
    if not found:
        return [f"{where}: the table names no report (a `<!-- numbers: reports/... -->` line before it)"]
    problems = []
    for line, cells in table.rows:
        for column, cell in enumerate(cells[1:], start=1):
            m = VERDICT_CELL.match(cell)
            if m is None:
                if re.search(r"\d", cell):
                    problems.append(f"{where} line {line}: {cell}: a number in a table of findings outside a "
                                    f"finding's statistic ('yes: +5.6 [+4.7, +6.5] ...')")
                continue
            if column > 2:
                problems.append(f"{where} line {line}: {cell}: a finding's statistic in column {column + 1}; the "
                                f"table's columns are the finding, the reference zoo and the other zoo")
                continue
            verdict, *written = m.groups()
            zoo = ("reference", "other")[column - 1]
            values = [v for r in found for v in r.values.get(("*", ("across_claim", cells[0], zoo, verdict)), ())]
            if not any(_matches(written, v) for v in values):
                problems.append(f"{where} line {line}: {cells[0]!r} | {cell}: the reports give "
                                f"{sorted(values) if values else f'no such claim with that verdict in the {zoo} zoo'}")
    return problems


def table_problems(table: Table) -> list[str]:
    """Every number of ``table`` that is not tied to where it comes from."""
    if table.header and table.header[0] == "finding":
        return across_problems(table)
    numeric = [(line, cells) for line, cells in table.rows if any(has_number(c) for c in cells[1:])]
    if not numeric:
        return []
    where = f"{table.path.relative_to(ROOT)}:{table.line}"
    note = table.note or ""
    if note.startswith("prose"):
        return [] if re.fullmatch(r"prose \(.+\)", note) else [f"{where}: a prose note says why: prose (...)"]
    if note.startswith("zoo/manifest.json"):
        return []   # the checkpoint rows: test_each_zoo_row_is_its_manifest_entry
    if note.startswith("benchmarks/results/"):
        files = [ROOT / f.rstrip(",") for f in note.split() if f.startswith("benchmarks/results/")]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            return [f"{where}: no {absent}"]
        problems = [f"{where} line {line}: {c!r} has {missing}, in none of {note}"
                    for line, cells in numeric for c in cells[1:] if (missing := check_benchmark_cell(files, c))]
        if len(files) == 1 and set(table.header[1:]) <= set(TRAIN_STEP_COLUMNS):   # each cell its own row's field
            rows = {r["model"]: r for r in json.loads(files[0].read_text())["results"]}
            for line, cells in numeric:
                for header, cell in zip(table.header[1:], cells[1:]):
                    value = rows[cells[0]][TRAIN_STEP_COLUMNS[header]]
                    if not _matches((re.match(NUMBER, cell).group(0),), (value,)):
                        problems.append(f"{where} line {line}: {cells[0]} {header} {cell}, the file says {value}")
        return problems
    problems = []
    timings = note.startswith("timings ")
    if timings:
        table = Table(table.path, table.line, note.split(" ", 1)[1], table.caption, table.header, table.rows)
    for line, cells in numeric:
        model, dataset = model_of(cells[0])
        if model not in MODELS and not (timings and model == "all seven"):
            problems.append(f"{where} line {line}: {cells[0]!r} is no model, and the table has no "
                            f"`<!-- numbers: -->` note saying where its numbers come from")
            continue
        found = table_reports(table)
        if dataset and found and any(r.dataset != dataset for r in found):
            problems.append(f"{where} line {line}: {dataset} in a table of {[r.dataset for r in found]}")
        for header, cell in zip(table.header[1:], cells[1:]):
            if not has_number(cell) and cell.strip() not in ("-",) and not BASELINE_CELL.match(cell):
                continue
            if cell.strip() == "-":
                continue
            check = check_timings_cell if timings else check_results_cell
            problem = check(table, model, header, cell, line)
            if problem:
                problems.append(problem)
    return problems


TABLES = [t for doc in DOCS for t in tables(doc) if any(has_number(c) or VERDICT_CELL.match(c)
                                                       for _, cells in t.rows for c in cells[1:])]


@pytest.mark.parametrize("table", TABLES, ids=[f"{t.path.relative_to(ROOT)}:{t.line}" for t in TABLES])
def test_each_number_of_a_table_is_where_it_comes_from(table):
    problems = table_problems(table)
    assert not problems, "\n".join(problems)


def test_the_docs_have_results_to_check():
    """The rules reach the tables: most numeric cells are checked against a report."""
    checked = sum(1 for t in TABLES if not (t.note or "").startswith(("prose", "benchmarks/", "zoo/"))
                  for _, cells in t.rows for c in cells[1:] if has_number(c))
    assert checked >= 500
    assert len(PROSE) >= 70


def test_a_cell_in_the_wrong_column_or_dataset_is_caught():
    """A value moved to the neighbouring column, written for another model, or given a dataset the
    report is not about, fails; the same cell in its place passes."""
    report = reports()["reports/study-fashion_mnist"]
    apgd2 = sorted(report.values[("sasa_resnet26", ("robust", "APGD-CE 2/255"))])[0]
    cell = f"{apgd2[0]:.1f} [{apgd2[1]:.1f}, {apgd2[2]:.1f}]"
    path = ROOT / "reports" / "study-fashion_mnist" / "README.md"
    right = f"| model | APGD-CE 2/255 | APGD-CE 4/255 |\n|---|--:|--:|\n| sasa_resnet26 | {cell} | - |\n"
    wrong = f"| model | APGD-CE 2/255 | APGD-CE 4/255 |\n|---|--:|--:|\n| sasa_resnet26 | - | {cell} |\n"
    other = right.replace("sasa_resnet26", "resnet26")
    dataset = right.replace("sasa_resnet26 |", "sasa_resnet26 [cifar10] |")
    assert not table_problems(tables(path, right)[0])
    for text in (wrong, other, dataset):
        assert table_problems(tables(path, text)[0]), text
    unnoted = "| thing | ms |\n|---|--:|\n| a step | 12.5 |\n"
    assert table_problems(tables(ROOT / "docs" / "x.md", unnoted)[0])


def _adversarial_report(tmp_path) -> Report:
    """A report folder with the adversarial-training section's CSV as robust_attn/reports/adversarial.py
    writes it (two families, made-up numbers) and the robust accuracies beside it."""
    folder = tmp_path / "adv"
    folder.mkdir()
    training = "adversarial fgsm, eps 8/255, 1 step"
    rows = [("most_robust", "resnet26-adv", "resnet", 31.3, 28.6, 34.3, None, None, None, None, None, None),
            ("most_robust", "sasa_resnet26-adv", "sasa", 30.3, 27.4, 33.3, -1.0, -3.0, 0.8, None, None, None),
            ("weakness", "san10_pairwise minus resnet26", "standard", -19.0, -22.3, -15.8, None, None, None,
             "APGD-CE 1/255", None, None),
            ("weakness", "san10_pairwise minus resnet26", "adversarial", -3.6, -5.8, -1.4, None, None, None,
             "AutoAttack 8/255", None, None),
            ("gain", "resnet26-adv", "resnet", 31.3, 28.6, 34.3, None, None, None, None, "resnet26",
             "AutoAttack 8/255"),
            ("gain", "resnet26-adv", "resnet", -26.5, -29.7, -23.4, None, None, None, None, "resnet26", "clean"),
            ("gain", "sasa_resnet26-adv", "sasa", 30.3, 27.4, 33.3, None, None, None, None, "sasa_resnet26",
             "AutoAttack 8/255"),
            ("gain", "sasa_resnet26-adv", "sasa", -8.1, -10.6, -5.6, None, None, None, None, "sasa_resnet26",
             "rotation")]
    pd.DataFrame([(training, *r) for r in rows], columns=[
        "training", "question", "model", "family", "value", "low", "high", "minus_best", "minus_best_low",
        "minus_best_high", "attack", "standard", "measure"]).to_csv(folder / "adversarial_training.csv", index=False)
    pd.DataFrame([("resnet26-adv", "cifar10", "AutoAttack 8/255", 31.3, 28.6, 34.3),
                  ("sasa_resnet26-adv", "cifar10", "AutoAttack 8/255", 30.3, 27.4, 33.3)],
                 columns=["model", "dataset", "column", "top1", "low", "high"]).to_csv(folder / "robust_accuracy.csv",
                                                                                     index=False)
    (folder / "report.md").write_text("# Robustness report\n")
    return read_report(folder)


def test_the_adversarial_training_answers_are_checked_in_tables_and_text(tmp_path, monkeypatch):
    """A README's table of the adversarially trained models (robust top-1, minus the best, the gain
    and the change per measure) and its sentences on the gain and on SAN10 pairwise's weakness are
    checked against the adversarial-training CSV: right as written, caught in another row, column or
    model."""
    known = {"reports/adv": _adversarial_report(tmp_path)}
    monkeypatch.setattr(sys.modules[__name__], "reports", lambda: known)
    path = ROOT / "reports" / "adv" / "README.md"
    header = ("| model | AutoAttack 8/255 | AutoAttack 8/255 minus best | AutoAttack 8/255 gain | clean top-1 change | "
              "rotated top-1 change |\n|---|--:|--:|--:|--:|--:|\n")
    right = header + ("| resnet26-adv | 31.3 [28.6, 34.3] | - | 31.3 [28.6, 34.3] | -26.5 [-29.7, -23.4] | - |\n"
                      "| sasa_resnet26-adv | 30.3 | -1.0 [-3.0, +0.8] (n.s.) | 30.3 [27.4, 33.3] | - | -8.1 |\n")
    assert not table_problems(tables(path, right)[0])
    for wrong in (right.replace("| -26.5 [-29.7, -23.4] | - |", "| - | -26.5 [-29.7, -23.4] |"),   # another column
                  right.replace("| -1.0 [-3.0, +0.8] (n.s.) |", "| -1.1 [-3.0, +0.8] (n.s.) |"),
                  right.replace("| resnet26-adv |", "| resnet26 |"),                                  # another model
                  right.replace("| - | 31.3 [28.6, 34.3] |", "| -1.0 [-3.0, +0.8] | 31.3 [28.6, 34.3] |"),
                  right.replace("AutoAttack 8/255 minus best", "AutoAttack 2/255 minus best")):   # another radius
        assert table_problems(tables(path, wrong)[0]), wrong
    said = {
        "Adversarial training gives resnet26-adv 31.3 [28.6, 34.3] points more than resnet26 at 8/255.": True,
        "Adversarial training gives sasa_resnet26-adv 31.3 [28.6, 34.3] points more than sasa_resnet26 at 8/255.":
            False,
        "After adversarial training SAN10 pairwise keeps 3.6 [1.4, 5.8] points less than ResNet-26 at 8/255.": True,
        "After adversarial training SASA keeps 3.6 [1.4, 5.8] points less than ResNet-26 at 8/255.": False,
        "After adversarial training SAN10 pairwise keeps 3.6 [1.4, 5.8] points less than ResNet-26 at 4/255.": False,
        "sasa_resnet26-adv keeps 1.0 [-0.8, 3.0] points less than resnet26-adv at 8/255.": True,
        "sasa_resnet26-adv keeps 1.0 [-0.8, 3.0] points less than resnet26 at 8/255.": False,
    }
    for text, ok in said.items():
        assert in_reports(prose_intervals(path, text + "\n")[0]) is ok, text


def test_the_across_scale_findings_are_checked_in_tables_and_text(tmp_path, monkeypatch):
    """A table of findings copied from the across-scale report (robust_attn/reports/across_scale.py)
    and sentences quoting a finding's statistic are checked against across_scale.csv (made-up
    numbers): right as written; caught under another claim or verdict, with another number, for
    other models, or where a finding was not measured."""
    folder = tmp_path / "across"
    folder.mkdir()
    rotation = "SAN10 pairwise loses less top-1 to rotation than ResNet-26"
    chance = "No family keeps more than chance-level top-1 at 8/255"
    pd.DataFrame([("rotation_vs_resnet26", rotation, "less", "reference", "rotation", 10000, 5.57, 4.66, 6.51,
                   "resnet26 minus san10_pairwise", "yes", "holds"),
                  ("rotation_vs_resnet26", rotation, "less", "other", "rotation", 1000, 4.28, 1.17, 7.33,
                   "resnet26 minus san10_pairwise; 2 of 2 pairs resolved as the claim says", "yes", "holds"),
                  ("none_robust_at_8", chance, "chance", "reference", "chance", 1000, 10.0, 10.0, 10.0,
                   "chance-level top-1 10% minus aa_resnet26's (0.0%)", "yes", "not measured"),
                  ("none_robust_at_8", chance, "chance", "other", "-", 0, None, None, None, "", "not measured",
                   "not measured")],
                 columns=["finding", "claim", "kind", "zoo", "measure", "n", "value", "low", "high", "detail",
                          "verdict", "across"]).assign(dataset="cifar10").to_csv(folder / "across_scale.csv",
                                                                                 index=False)
    (folder / "report.md").write_text("# What survives across scale\n")
    known = {"reports/across": read_report(folder)}
    monkeypatch.setattr(sys.modules[__name__], "reports", lambda: known)
    path = ROOT / "reports" / "across" / "README.md"
    right = (f"| finding | width 0.25 | efficient | across scale |\n|---|--:|--:|--:|\n"
             f"| {rotation} | yes: +5.6 [+4.7, +6.5] (resnet26 minus san10_pairwise) | yes: +4.3 [+1.2, +7.3] | "
             f"holds |\n"
             f"| {chance} | yes: +10.0 [+10.0, +10.0] | not measured | not measured |\n")
    assert not table_problems(tables(path, right)[0])
    for wrong in (right.replace("yes: +4.3", "no: +4.3"), right.replace("+4.3 [+1.2", "+4.4 [+1.2"),
                  right.replace(f"| {rotation} |", "| SAN10 pairwise loses less top-1 to rotation |"),
                  right.replace("| not measured | not measured |", "| yes: +10.0 [+10.0, +10.0] | not measured |"),
                  right.replace("| yes: +5.6 [+4.7, +6.5] (resnet26 minus san10_pairwise) | yes: +4.3 [+1.2, +7.3] |",
                                "| yes: +4.3 [+1.2, +7.3] | yes: +5.6 [+4.7, +6.5] |"),   # the zoos swapped
                  right.replace("| holds |", "| 99.9 [99.0, 99.9] |"),   # a number that is no finding's
                  right.replace("| holds |", "| holds (99.9 [99.0, 99.9]) |")):
        assert table_problems(tables(path, wrong)[0]), wrong
    said = {
        "On CIFAR-10 SAN10 pairwise loses 4.3 [1.2, 7.3] points less than ResNet-26 to rotation.": True,
        "On CIFAR-10 SASA loses 4.3 [1.2, 7.3] points less than ResNet-26 to rotation.": False,
        "On Fashion-MNIST SAN10 pairwise loses 4.3 [1.2, 7.3] points less than ResNet-26 to rotation.": False,
        "The best model keeps 10.0 [10.0, 10.0] points less than chance at 8/255.": True,
        "SAN10 pairwise keeps 4.3 [1.2, 7.3] points at 8/255.": False,   # the rotation pair, as a value
    }
    for text, ok in said.items():
        assert in_reports(prose_intervals(path, text + "\n")[0]) is ok, text


# -- intervals in the text -----------------------------------------------------------------------

# a value and its interval in prose: "5.8 [2.9, 8.7]", "0.83 points more [0.16, 1.54]",
# "68.97 points, 95% interval [68.17, 69.75]", "28.48 %, 95% interval [...]"
PROSE_INTERVAL = re.compile(rf"({NUMBER})(?:\s?%|\s+points?)?(?:\s+(?:more|less))?(?:,\s+95%\s+interval)?"
                            rf"\s+\[({NUMBER}),\s+({NUMBER})\]")
# where a statement ends: a full stop, a blank line, a list item, a table row
STATEMENT_END = re.compile(r"(?<=[.])\s+(?=[A-Z*(])|\n\s*\n|\n(?=\s*(?:- |\|))|(?<=\|)\n")
DIFFERENCE = re.compile(r"\b(more|less|larger|smaller|minus|difference|fewer)\b")
# "4/255", "1, 2, 4 and 8/255", and Table 10's "{8, 2, 4}" (8/255)
RADIUS = re.compile(r"((?:\d+(?:,? and |, | or ))*\d+)/255|\{8, [24], [24]\}")


def models_named(text: str) -> set[str]:
    """The models ``text`` names, by zoo name or as ``MODEL_NAMES`` writes them (whole words; a
    name of two words may wrap a line)."""
    names = {m: m for m in MODELS} | MODEL_NAMES
    pattern = {name: re.escape(name).replace(r"\ ", r"\s+") for name in names}
    return {model for name, model in names.items() if re.search(rf"(?<![\w-]){pattern[name]}(?![\w-])", text)}


def radii(text: str) -> set[str]:
    return {r for m in RADIUS.finditer(text) for r in (re.findall(r"\d+", m.group(1)) if m.group(1) else ["8"])}


def _radius_of(key: tuple) -> str | None:
    m = re.search(r"eps(\d+)|(\d+)/255", " ".join(str(k) for k in key))
    return (m.group(1) or m.group(2)) if m else None


@dataclass
class Prose:
    path: Path
    line: int
    interval: tuple
    named: frozenset
    radii: frozenset
    difference: bool
    tau: bool
    reports: tuple
    statement: str = ""


def prose_reports(path: Path, note: str | None) -> tuple[str, ...]:
    """The reports a file's text draws on: a ``<!-- numbers: reports/... -->`` line above it, else
    for a report folder's README every report of its dataset, else none named (any report)."""
    if note and note.startswith("reports/"):
        return tuple(note.split())
    known = reports()
    folder = path.parent.relative_to(ROOT).as_posix()
    if folder in known:
        return tuple(p for p, r in known.items() if r.dataset == known[folder].dataset)
    return ()


def prose_intervals(path: Path, text: str | None = None) -> list[Prose]:
    """Every ``X [L, H]`` outside the tables of a file, with the statement that holds it."""
    text = path.read_text() if text is None else text
    lines = text.splitlines()
    notes, note = [], None
    for i, line in enumerate(lines):   # a note above a table is the table's; any other one holds for the text below
        m = NOTE.match(line.strip())
        following = next((x.strip() for x in lines[i + 1:] if x.strip()), "")
        if m and m.group(1).startswith("reports/") and not following.startswith("|"):
            note = m.group(1)
        notes.append(note)
    prose = "\n".join("" if line.strip().startswith("|") else line for line in lines)
    found, start = [], 0
    for end in [m.start() for m in STATEMENT_END.finditer(prose)] + [len(prose)]:
        statement = prose[start:end]
        named = frozenset(models_named(statement))
        previous = 0
        for m in PROSE_INTERVAL.finditer(statement):
            line = prose.count("\n", 0, start + m.start()) + 1
            # what the number is: the words of its clause before it (since the last interval, colon,
            # semicolon or comma), and after it up to the next comma, semicolon or bracket
            # ("a drop 7.0 [4.8, 9.2] points larger")
            before = re.split(r"[:;,(]", statement[max(previous, m.start() - 60):m.start()])[-1]
            after = re.split(r"[,;(]", statement[m.end():])[0]
            found.append(Prose(path, line, m.groups(), named, frozenset(radii(statement)),
                               DIFFERENCE.search(before + m.group(0) + after) is not None, "tau" in statement,
                               prose_reports(path, notes[line - 1]), " ".join(statement.split())))
            previous = m.end()
        start = end
    return found


def in_reports(p: Prose) -> bool:
    """Whether a report the statement draws on gives its interval (either sign where it is a
    difference) for a model it names (any model where it names none), at a radius it names, as a
    value or a difference as the statement says (a difference between two models it names), or as a
    Kendall's tau where it says tau; or the statement is a sentence of the report's own text."""
    known = reports()
    chosen = [known[r] for r in p.reports] if p.reports else list(known.values())
    said = {d for d, name in (("fashion_mnist", "Fashion-MNIST"), ("cifar10", "CIFAR-10")) if name in p.statement}
    if len(said) == 1:   # a statement about one dataset draws on that dataset's reports
        chosen = [r for r in chosen if r.dataset in said]
    if len(p.statement) > 40 and any(p.statement in r.text for r in chosen):
        return True   # a sentence of a report's findings, quoted whole
    for report in chosen:
        for (model, key), values in report.values.items():
            if key == ("tau",):
                if not p.tau:
                    continue
            elif key[0] == "across_claim" or (p.named and model not in p.named and model != "*"):
                continue   # a claim's cell is for the tables; the text reads its pair or model-free value
            radius = _radius_of(key)
            if p.radii and radius is not None and radius not in p.radii:
                continue
            if key[0] in ("measure", "title") and key[-1] != "value":
                continue   # a difference is read as a pair of models, below
            difference = key[0] == "pair"
            if difference and p.named and key[3] not in p.named:
                continue   # a difference between two models: the text names both
            if key != ("tau",) and difference != p.difference and key[0] not in ("headline", "across"):
                continue
            for v in values:
                if len(v) < 3:
                    continue
                if _matches(p.interval, v[:3]) or (difference and _matches(p.interval, (-v[0], -v[2], -v[1]))):
                    return True
    return False


PROSE = [p for doc in DOCS for p in prose_intervals(doc)]


@pytest.mark.parametrize("p", PROSE, ids=[f"{p.path.relative_to(ROOT)}:{p.line}" for p in PROSE])
def test_each_interval_in_the_text_is_in_a_committed_report(p):
    assert in_reports(p), (
        f"{p.path.relative_to(ROOT)}:{p.line}: {p.interval[0]} [{p.interval[1]}, {p.interval[2]}] is in no "
        f"committed report{' of ' + ', '.join(p.reports) if p.reports else ''}"
        + (f" for {', '.join(sorted(p.named))}" if p.named else "")
        + (f" at {', '.join(sorted(p.radii))}/255" if p.radii else "")
        + (" as a difference" if p.difference else " as a value"))


def test_an_interval_written_for_the_wrong_model_radius_or_dataset_is_caught():
    """The prose check reads which model, radius and dataset a statement is about."""
    report = reports()["reports/autoattack-fashion_mnist"]
    sasa4 = sorted(report.values[("sasa_resnet26", ("robust", "AutoAttack 4/255"))])[0]
    cell = f"{sasa4[0]:.1f} [{sasa4[1]:.1f}, {sasa4[2]:.1f}]"
    path = ROOT / "reports" / "autoattack-fashion_mnist" / "README.md"
    right, wrong_model, wrong_radius = (f"SASA keeps {cell} at 4/255.\n", f"AA keeps {cell} at 4/255.\n",
                                        f"SASA keeps {cell} at 2/255.\n")
    assert in_reports(prose_intervals(path, right)[0])
    assert not in_reports(prose_intervals(path, wrong_model)[0])
    ahead = sorted(report.values[("sasa_resnet26", ("pair", "attack_drop:autoattack_linf_eps4", "minus_baseline",
                                                    "resnet26"))])[0]
    lead = f"{-ahead[0]:.1f} [{-ahead[2]:.1f}, {-ahead[1]:.1f}]"
    assert in_reports(prose_intervals(path, f"At 4/255 SASA loses {lead} points less than ResNet-26.\n")[0])
    assert not in_reports(prose_intervals(path, f"At 4/255 AA loses {lead} points less than ResNet-26.\n")[0])
    assert not in_reports(prose_intervals(path, wrong_radius)[0])
    other_dataset = ROOT / "reports" / "study-cifar10" / "README.md"
    assert not in_reports(prose_intervals(other_dataset, right)[0])
    assert not in_reports(prose_intervals(ROOT / "README.md", right.replace("/255.", "/255 on CIFAR-10."))[0])
    assert in_reports(prose_intervals(ROOT / "README.md", right.replace("/255.", "/255 on Fashion-MNIST."))[0])
    wrapped = prose_intervals(path, f"- And SAN10\n  patchwise's, wrapped: {cell}.\n")[0]
    assert wrapped.named == {"san10_patchwise"} and wrapped.line == 2


# -- the zoo tables and the benchmarks ----------------------------------------------------------

def zoo_rows() -> list[tuple[Path, int, dict[str, str]]]:
    """``(file, line, {header: cell})`` of the rows that name a checkpoint by the first 12
    characters of its sha256."""
    return [(t.path, line, dict(zip(t.header, cells))) for doc in DOCS for t in tables(doc) for line, cells in t.rows
            if any(re.fullmatch(r"`[0-9a-f]{12}`", c) for c in cells)]


ZOO_ROWS = zoo_rows()


def test_the_zoo_tables_list_every_checkpoint():
    from robust_attn.models.manifest import Manifest

    shipped = {e.sha256[:12] for e in Manifest().entries.values() if e.source == "checkpoint"}
    listed = {row["sha256 (first 12)"].strip("`") for _, _, row in ZOO_ROWS}
    assert shipped <= listed, f"checkpoints the zoo tables do not list: {sorted(shipped - listed)}"


@pytest.mark.parametrize("path, line, row", ZOO_ROWS, ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _ in ZOO_ROWS])
def test_each_zoo_row_is_its_manifest_entry(path, line, row):
    """Model, test top-1 and top-5 and final train loss as the manifest records the checkpoint's
    training (the manifest's own test re-evaluates the checkpoints)."""
    from robust_attn.models.manifest import Manifest

    sha = row["sha256 (first 12)"].strip("`")
    entries = [e for e in Manifest().entries.values() if e.sha256.startswith(sha)]
    assert len(entries) == 1, f"{path}:{line}: no single manifest entry with sha256 {sha}"
    entry, metrics = entries[0], entries[0].metrics
    assert row["model"] == entry.name, f"{path}:{line}"
    assert row["test top-1"] == f"{metrics['eval_top1']:.2f}%", f"{path}:{line}"
    assert row["test top-5"] == f"{metrics['eval_top5']:.2f}%", f"{path}:{line}"
    if "final train loss" in row:
        assert row["final train loss"] == f"{metrics['train_loss']:.3f}", f"{path}:{line}"


# the table of attack speed against torchattacks: its columns, and the attack of
# benchmarks/results/attacks.json each shows (a ratio, ours over torchattacks; or our images/s)
ATTACK_SPEED_COLUMNS = {"PGD-10": ("pgd", "speedup"), "Table 10 {8,2,4}": ("table10", "speedup"),
                        "APGD-CE": ("apgd-ce", "speedup"), "APGD-T": ("apgd-t", "speedup"),
                        "Square": ("square", "speedup"), "FAB-T (ours)": ("fab-t", "ours_img_s"),
                        "AutoAttack (ours)": ("autoattack", "ours_img_s")}


def test_the_attack_speed_table_is_benchmarks_results_attacks_json():
    """Each cell is its own model's and attack's figure, not just a number of the file."""
    rows = {(r["model"], r["attack"]): r for r in
            json.loads((ROOT / "benchmarks" / "results" / "attacks.json").read_text())["rows"]}
    checked = 0
    for table in tables(ROOT / "benchmarks" / "README.md"):
        if set(ATTACK_SPEED_COLUMNS) <= set(table.header):
            for number, cells in table.rows:
                for column, cell in zip(table.header[1:], cells[1:]):
                    attack, key = ATTACK_SPEED_COLUMNS[column]
                    written = cell.split()[0].rstrip("x")
                    assert _matches((written,), (rows[(cells[0], attack)][key],)), (number, cells[0], column, cell)
                    checked += 1
    assert checked == 7 * len(ATTACK_SPEED_COLUMNS)
