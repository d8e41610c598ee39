"""``report.html``: a report folder as one self-contained page, and ``index.html`` over many.

The page is made from the files the report wrote (:func:`robust_attn.reports.make_report`):
``report.md`` (findings with their intervals, Tables 9 and 10, every section), its PNG plots
embedded as base64, the models' provenance cards from ``models.csv`` (source, spec, weights and
their sha256, preprocessing, parameters, the hardware that computed them), the gradient-masking
verdicts from ``masking_checks.csv`` and a headline table from ``comparison.csv``. Nothing is
recomputed, so a committed report gets its page without its runs::

    python -m robust_attn.reports.html reports/study-cifar10      # reports/study-cifar10/report.html
    python -m robust_attn.reports.html --index reports             # reports/index.html over every report

Markup comes from a Jinja2 template (autoescaped) and tables from pandas' ``to_html``; the
Markdown of ``report.md`` is the small subset :mod:`robust_attn.reports.formats` writes
(headings, paragraphs, lists, pipe tables, images, bold, code and links)."""
from __future__ import annotations

import argparse
import base64
import re
from pathlib import Path

import pandas as pd
from jinja2 import Environment
from markupsafe import Markup, escape

from robust_attn.utils.io import atomic_write_text

__all__ = ["write_html", "write_index", "headline_table", "markdown_blocks"]

IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")
# the measures of a study's one-line summary on the index: SAN's two protocols, the attacks, the shifts
INDEX_MEASURES = re.compile(r"^(rotation_drop|pgd_drop:pgd_eps8_step2_n4|attack_drop:.*|shift_drop:.*)$")

STYLE = """
body { font-family: system-ui, sans-serif; margin: 0 auto; max-width: 1200px; padding: 1em 2em; color: #222; }
h1 { border-bottom: 2px solid #446; } h2 { border-bottom: 1px solid #ccd; margin-top: 2em; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.85em; display: block; overflow-x: auto; }
th, td { border: 1px solid #ccd; padding: 0.25em 0.5em; text-align: right; white-space: nowrap; }
th { background: #eef; } td:first-child, th:first-child { text-align: left; }
tr:nth-child(even) td { background: #f8f8fc; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
code { background: #f2f2f6; padding: 0 0.2em; }
.cards { display: flex; flex-wrap: wrap; gap: 0.8em; }
.card { border: 1px solid #ccd; border-radius: 6px; padding: 0.6em 0.9em; width: 340px; font-size: 0.85em; }
.card h3 { margin: 0 0 0.4em 0; font-size: 1.05em; } .card dt { font-weight: 600; } .card dd { margin: 0 0 0.3em 0; word-break: break-all; }
table.text td { white-space: normal; text-align: left; min-width: 8em; }
.flag { color: #a00; font-weight: 600; } .pass { color: #070; }
nav { font-size: 0.85em; columns: 3; } details { font-size: 0.8em; color: #555; }
"""

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }}</title><style>{{ style }}</style></head>
<body>
<h1>{{ title }}</h1>
{% if sections %}<nav><ul>{% for s in sections %}<li><a href="#{{ s.id }}">{{ s.text }}</a></li>{% endfor %}</ul></nav>{% endif %}
{% if headline is not none %}<h2 id="at-a-glance">At a glance</h2>
<p>Each model's loss per measure (lower is better), with its {{ level }} bootstrap interval over images
(<code>comparison.csv</code>).</p>
{{ headline }}{% endif %}
{% if cards %}<h2 id="provenance">Models: provenance</h2><div class="cards">
{% for card in cards %}<div class="card"><h3>{{ card.label }}</h3><dl>
{% for key, value in card.fields %}<dt>{{ key }}</dt><dd>{{ value }}</dd>{% endfor %}
</dl></div>{% endfor %}</div>{% endif %}
{% if masking is not none %}<h2 id="masking-flags">Gradient-masking flags</h2>
<p class="{{ 'flag' if masking.flagged else 'pass' }}">{{ masking.flagged }} of {{ masking.total }} checks flag{{ ':' if masking.flagged else '.' }}</p>
{% if masking.flagged %}{{ masking.flagged_table }}{% endif %}
<details><summary>every check, with its evidence</summary>{{ masking.table }}</details>{% endif %}
{{ body }}
</body></html>
"""

INDEX = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }}</title><style>{{ style }}</style></head>
<body>
<h1>{{ title }}</h1>
<p>Every committed report: its headline table (each model's loss per measure, lower is better, with its
bootstrap interval over images) and links to its page, its Markdown and its notes.</p>
{% for r in reports %}<h2 id="{{ r.id }}">{{ r.name }}</h2>
<p>{% for text, href in r.links %}<a href="{{ href }}">{{ text }}</a>{{ " · " if not loop.last }}{% endfor %}</p>
{% if r.summary %}<p>{{ r.summary }}</p>{% endif %}
{{ r.table }}{% endfor %}
</body></html>
"""

ENV = Environment(autoescape=True)


def inline(text: str, base: str = "") -> Markup:
    """One line of the reports' Markdown as HTML: escaped, then ``**bold**``, `` `code` `` and
    ``[text](link)`` (a relative link prefixed with ``base``)."""
    html = str(escape(text))
    html = re.sub(r"`([^`]+)`", r"<code>\1</code>", html)
    html = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", html)

    def link(m: re.Match) -> str:
        href = m.group(2) if re.match(r"[a-z]+:|#|/", m.group(2)) else base + m.group(2)
        return f'<a href="{href}">{m.group(1)}</a>'

    return Markup(re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", link, html))


def _table(frame: pd.DataFrame, classes: str = "data") -> Markup:
    """A DataFrame as an HTML table, its cells formatted as :func:`inline` Markdown."""
    shown = frame.astype(str).map(lambda cell: str(inline(cell)))
    shown.columns = [str(inline(str(c))) for c in shown.columns]
    return Markup(shown.to_html(index=False, escape=False, border=0, classes=classes))


def markdown_blocks(text: str) -> list[tuple[str, object]]:
    """``report.md`` as blocks: ``("heading", (level, text))``, ``("table", DataFrame)``,
    ``("images", [(alt, file)])``, ``("list", [item])`` and ``("paragraph", text)``."""
    blocks: list[tuple[str, object]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("#"):
            hashes = len(line) - len(line.lstrip("#"))
            blocks.append(("heading", (hashes, line[hashes:].strip())))
            i += 1
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            body = [r for r in rows[1:] if not set("".join(r)) <= set("-: ")]
            width = len(rows[0])
            blocks.append(("table", pd.DataFrame([(r + [""] * width)[:width] for r in body], columns=rows[0])))
        elif IMAGE.fullmatch(line.strip()) or (IMAGE.match(line.strip()) and not IMAGE.sub("", line).strip()):
            blocks.append(("images", IMAGE.findall(line)))
            i += 1
        elif line.startswith("- "):
            items = []
            while i < len(lines) and (lines[i].startswith("- ") or lines[i].startswith("  ")):
                if lines[i].startswith("- "):
                    items.append(lines[i][2:])
                else:
                    items[-1] += " " + lines[i].strip()
                i += 1
            blocks.append(("list", items))
        else:
            para = []
            while i < len(lines) and lines[i].strip() and not lines[i].startswith(("#", "|", "- ")):
                para.append(lines[i].strip())
                i += 1
            blocks.append(("paragraph", " ".join(para)))
    return blocks


def _image(folder: Path, name: str, alt: str) -> Markup:
    """An ``<img>`` with the PNG's bytes inline (a missing file is named in its place)."""
    path = folder / name
    if not path.is_file():
        return Markup(f"<p><em>{escape(alt)}: {escape(name)} is missing</em></p>")
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return Markup(f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">')


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _body(folder: Path, text: str) -> tuple[Markup, list[dict]]:
    """``report.md`` as HTML (its first heading, the page's title, left out), and its sections."""
    parts, sections = [], []
    for kind, value in markdown_blocks(text):
        if kind == "heading":
            level, title = value
            if level == 1:
                continue
            sections.append({"id": _slug(title), "text": title})
            parts.append(Markup(f'<h{level} id="{_slug(title)}">{inline(title)}</h{level}>'))
        elif kind == "table":
            parts.append(_table(value))
        elif kind == "images":
            parts += [_image(folder, name, alt) for alt, name in value]
        elif kind == "list":
            parts.append(Markup("<ul>" + "".join(f"<li>{inline(item)}</li>" for item in value) + "</ul>"))
        elif value.startswith("Runs: "):   # the long list of run folders, folded
            parts.append(Markup(f"<details><summary>Runs</summary>{inline(value[6:])}</details>"))
        else:
            parts.append(Markup(f"<p>{inline(value)}</p>"))
    return Markup("\n".join(parts)), sections


def headline_table(comparison: pd.DataFrame, measures: re.Pattern | None = None) -> pd.DataFrame:
    """One row per model, one column per measure of ``comparison.csv`` (all, or those whose key
    ``measures`` matches): ``value [low, high]`` to two decimals, in the measures' order."""
    table = comparison if measures is None else comparison[comparison["measure"].str.match(measures)]
    if table.empty:
        return pd.DataFrame()
    columns = {}
    for key, title, unit in table[["measure", "title", "unit"]].drop_duplicates("measure").itertuples(index=False):
        name, _, what = str(title).partition(": ")
        columns[key] = f"{name}: success (%)" if "success" in what else f"{name}: drop ({unit})"
    cells = table.assign(cell=[f"{v:.2f} [{lo:.2f}, {hi:.2f}]" for v, lo, hi in
                               zip(table["value"], table["low"], table["high"])])
    wide = cells.pivot_table(index="model", columns="measure", values="cell", aggfunc="first", sort=False)
    wide = wide[list(columns)].rename(columns=columns).fillna("-")
    return wide.reset_index()


def _cards(models: pd.DataFrame) -> list[dict]:
    """Each model's provenance: source and spec, weights (origin, full sha256), preprocessing,
    parameters, protocols and the hardware its records were computed on."""
    cards = []
    for row in models.astype(object).where(models.notna(), "").to_dict("records"):
        params = row.get("params", "")
        fields = [("source", row.get("source", "")), ("spec", row.get("spec", "")),
                  ("weights", row.get("weights_origin", "")), ("weights sha256", row.get("weights_sha256", "")),
                  ("preprocessing", row.get("preprocessing", "")),
                  ("parameters", f"{int(params):,}" if str(params).isdigit() else params),
                  ("protocols", row.get("protocols", "")), ("computed on", row.get("computed_on", ""))]
        cards.append({"label": row.get("label") or row.get("model"), "fields": [(k, v) for k, v in fields if v != ""]})
    return cards


def write_html(folder, title: str | None = None) -> Path:
    """Write ``folder/report.html`` from the report files in ``folder``; returns its path."""
    folder = Path(folder)
    body, sections = _body(folder, (folder / "report.md").read_text())
    headline, level = None, "95%"
    if (folder / "comparison.csv").is_file():
        comparison = pd.read_csv(folder / "comparison.csv")
        level = f"{comparison['level'].iloc[0]:.0%}" if "level" in comparison and len(comparison) else level
        headline = _table(headline_table(comparison))
    cards = _cards(pd.read_csv(folder / "models.csv")) if (folder / "models.csv").is_file() else []
    masking = None
    if (folder / "masking_checks.csv").is_file():
        checks = pd.read_csv(folder / "masking_checks.csv")
        flagged = checks[checks["verdict"] != "pass"]
        masking = {"flagged": len(flagged), "total": len(checks), "table": _table(checks, "data text"),
                   "flagged_table": _table(flagged, "data text")}
    html = ENV.from_string(PAGE).render(
        title=title or f"Robustness report: {folder.resolve().name}", style=STYLE, body=body, level=level,
        sections=[{"id": "at-a-glance", "text": "At a glance"}] * (headline is not None)
        + [{"id": "provenance", "text": "Models: provenance"}] * bool(cards)
        + [{"id": "masking-flags", "text": "Gradient-masking flags"}] * (masking is not None) + sections,
        headline=headline, cards=cards, masking=masking)
    out = folder / "report.html"
    atomic_write_text(out, html)
    return out


def write_index(reports_dir, title: str = "robust-attn: committed reports") -> Path:
    """Write ``reports_dir/index.html``: for every report below it (a folder with ``report.md``,
    runs excluded), its headline table and links to its page, Markdown and README."""
    reports_dir = Path(reports_dir)
    entries = []
    for md in sorted(reports_dir.rglob("report.md")):
        folder = md.parent
        if "runs" in folder.relative_to(reports_dir).parts:
            continue
        rel = folder.relative_to(reports_dir).as_posix()
        links = [(name, f"{rel}/{name}") for name in ("report.html", "report.md", "README.md")
                 if (folder / name).is_file()]
        summary = ""
        if (folder / "README.md").is_file():
            paragraphs = [p for p in (folder / "README.md").read_text().split("\n\n") if p and not p.startswith("#")]
            summary = " ".join(paragraphs[0].split()) if paragraphs else ""
            summary = re.split(r"(?<=[.:])\s+(?=[A-Z])", summary)[0]   # its first sentence
        if (folder / "comparison.csv").is_file():
            table = headline_table(pd.read_csv(folder / "comparison.csv"), INDEX_MEASURES)
        elif (folder / "headline_ci.csv").is_file():
            ci = pd.read_csv(folder / "headline_ci.csv")
            table = ci.assign(interval=[f"{v:.2f} [{lo:.2f}, {hi:.2f}]" for v, lo, hi in
                                        zip(ci["value"], ci["low"], ci["high"])])
            table = table.pivot_table(index="model", columns="metric", values="interval", aggfunc="first",
                                      sort=False).reset_index()
        else:
            table = pd.DataFrame()
        entries.append({"id": _slug(rel), "name": rel, "links": links, "summary": inline(summary, base=f"{rel}/"),
                        "table": _table(table) if not table.empty else ""})
    out = reports_dir / "index.html"
    atomic_write_text(out, ENV.from_string(INDEX).render(title=title, style=STYLE, reports=entries))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m robust_attn.reports.html", description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="report folders (with report.md); with --index, the folder of reports")
    parser.add_argument("--index", action="store_true", help="write FOLDER/index.html over every report below it")
    args = parser.parse_args(argv)
    for folder in args.folders:
        print(write_index(folder) if args.index else write_html(folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
