"""``report.html`` and ``reports/index.html``: one self-contained page per report (plots inline,
every table, the findings with their intervals, the masking verdicts, each model's provenance
card) and one page over every committed report; both render in a real browser (headless
Chromium, where it is installed)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from robust_attn.cli import main
from robust_attn.reports.html import headline_table, markdown_blocks, write_html, write_index

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = sorted(p.parent for p in (ROOT / "reports").rglob("report.md") if "runs" not in p.parts)


def _copy_report(folder: Path, dest: Path) -> Path:
    """The report's own files (not its packed runs), in ``dest/<its name>``."""
    out = dest / folder.name
    out.mkdir(parents=True)
    for path in folder.iterdir():
        if path.is_file() and path.suffix in (".md", ".csv", ".png"):
            shutil.copy(path, out / path.name)
    return out


@pytest.fixture(scope="module")
def cifar_page(tmp_path_factory) -> tuple[Path, str]:
    folder = _copy_report(ROOT / "reports" / "study-cifar10", tmp_path_factory.mktemp("html"))
    return folder, write_html(folder).read_text()


def test_the_page_holds_every_table_image_card_and_masking_verdict(cifar_page):
    folder, html = cifar_page
    md = (folder / "report.md").read_text()
    kinds = [kind for kind, _ in markdown_blocks(md)]
    assert html.count("<table") >= kinds.count("table") + 2   # the report's tables, the headline and the masking table
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", md)
    assert images and html.count('src="data:image/png;base64,') == len(images)
    assert not re.search(r'src="(?!data:)', html)                                  # self-contained
    models = pd.read_csv(folder / "models.csv")
    for sha, label in zip(models["weights_sha256"], models["label"]):
        assert sha in html and f"<h3>{label}</h3>" in html
    checks = pd.read_csv(folder / "masking_checks.csv")
    flagged = int((checks["verdict"] != "pass").sum())
    assert f"{flagged} of {len(checks)} checks flag" in html


def test_the_findings_and_the_headline_keep_their_intervals(cifar_page):
    folder, html = cifar_page
    comparison = pd.read_csv(folder / "comparison.csv")
    row = comparison.iloc[0]
    assert f"{row['value']:.2f} [{row['low']:.2f}, {row['high']:.2f}]" in html      # the headline table
    first = re.search(r"\*\*(.+?)\*\*: (\S+) loses least", (folder / "report.md").read_text())
    assert first and f"<strong>{first.group(1)}</strong>" in html


def test_the_headline_table_puts_each_number_in_its_model_and_measure():
    comparison = pd.DataFrame({"measure": ["a", "a", "b"], "title": ["A 1/255: top-1 drop"] * 2 + ["B: success"],
                               "unit": ["points", "points", "%"], "model": ["m1", "m2", "m1"],
                               "value": [1.0, 2.0, 3.0], "low": [0.5, 1.5, 2.5], "high": [1.5, 2.5, 3.5]})
    table = headline_table(comparison).set_index("model")
    assert table.loc["m2", "A 1/255: drop (points)"] == "2.00 [1.50, 2.50]"
    assert table.loc["m1", "B: success (%)"] == "3.00 [2.50, 3.50]" and table.loc["m2", "B: success (%)"] == "-"


@pytest.mark.parametrize("folder", COMMITTED, ids=[str(p.relative_to(ROOT)) for p in COMMITTED])
def test_each_committed_report_has_its_page_up_to_date(folder, tmp_path):
    """The committed report.html is what its committed files give now."""
    committed = folder / "report.html"
    assert committed.is_file(), f"no {committed.relative_to(ROOT)}: python -m robust_attn.reports.html {folder}"
    fresh = write_html(_copy_report(folder, tmp_path)).read_text()
    assert fresh == committed.read_text(), f"python -m robust_attn.reports.html {folder.relative_to(ROOT)}"


def test_the_index_lists_every_report_with_its_headline(tmp_path):
    for folder in COMMITTED:
        dest = tmp_path / folder.relative_to(ROOT / "reports")
        dest.mkdir(parents=True)
        for name in ("report.md", "report.html", "README.md", "comparison.csv", "headline_ci.csv"):
            if (folder / name).is_file():
                shutil.copy(folder / name, dest / name)
    html = write_index(tmp_path).read_text()
    for folder in COMMITTED:
        rel = folder.relative_to(ROOT / "reports").as_posix()
        assert f'href="{rel}/report.html"' in html and f'href="{rel}/README.md"' in html
    top = pd.read_csv(ROOT / "reports" / "study-fashion_mnist" / "comparison.csv").iloc[0]
    assert f"{top['value']:.2f} [{top['low']:.2f}, {top['high']:.2f}]" in html
    assert (ROOT / "reports" / "index.html").read_text() == html, "python -m robust_attn.reports.html --index reports"


def test_the_report_command_writes_the_page_and_takes_a_study_folder(tmp_path, capsys):
    """``robust-attn report`` writes report.html beside report.md, and reads a study's runs folder
    as the study wrote it (whole, or FOLDER/* with its timings.csv among the runs)."""
    runs = tmp_path / "runs"
    argv = ["study", "--dataset", "fashion_mnist", "--models", "resnet26,aa_resnet26", "--limit", "12",
            "--batch-size", "6", "--protocols", "rotation", "--angle-step", "0", "--workers", "1",
            "--runs", str(runs), "--out", str(tmp_path / "study-report"), "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    assert (runs / "timings.csv").is_file() and (tmp_path / "study-report" / "report.html").is_file()
    given = sorted(str(p) for p in runs.iterdir())
    assert main(["report", *given, "--out", str(tmp_path / "glob"), "--partial"]) == 0, capsys.readouterr().err
    assert main(["report", str(runs), "--out", str(tmp_path / "whole")]) == 0, capsys.readouterr().err
    for out in ("glob", "whole"):
        assert (tmp_path / out / "report.html").is_file()
        table9 = pd.read_csv(tmp_path / out / "table9_rotation.csv")
        assert sorted(table9[table9["source"] == "ours"]["model"]) == ["aa_resnet26", "resnet26"]
    assert main(["report", str(tmp_path / "nothing-here.csv"), "--out", str(tmp_path / "x")]) == 2


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _render(page: Path, shot: Path) -> str:
    """The DOM Chromium builds from ``page``, and a screenshot of it in ``shot``."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,1600"]
    subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=180)
    return subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                          timeout=180).stdout


def _not_blank(shot: Path) -> bool:
    """More than 2% of the screenshot's pixels are not the background, in more than two colours."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3)
    colours, counts = np.unique(pixels, axis=0, return_counts=True)
    return counts.max() < 0.98 * len(pixels) and len(colours) > 2


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (Debian: apt-get install chromium)")
@pytest.mark.parametrize("page", ["study-cifar10/report.html", "index.html"])
def test_the_pages_render_in_headless_chromium(page, tmp_path):
    path = ROOT / "reports" / page
    dom = _render(path, tmp_path / "shot.png")
    assert (tmp_path / "shot.png").is_file(), "chromium wrote no screenshot"
    assert _not_blank(tmp_path / "shot.png")
    assert dom.count("<table") >= (10 if page != "index.html" else 5)
    if page != "index.html":
        assert dom.count('<img alt="') >= 5 and "Models: provenance" in dom
