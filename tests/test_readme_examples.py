"""The README's examples run as pasted: its quickstart (Python and shell), the "Evaluate your own
model" shell block (a user's network from a file, three protocols and the report) and the Python
API example of docs/model-sources.md, each in a fresh folder on the data the package ships. A
comment ``# LITERAL`` after an expression in a Python block is the value the README promises,
and is checked."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from robust_attn.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MODEL_SOURCES = (ROOT / "docs" / "model-sources.md").read_text()


def _blocks(language: str, containing: str, text: str = README) -> str:
    found = [b for b in re.findall(rf"```{language}\n(.*?)```", text, flags=re.S) if containing in b]
    assert len(found) == 1, f"expected one {language} block with {containing!r}"
    return found[0]


def _promised_values(block: str) -> list[tuple[str, object]]:
    """``(expression, value)`` for each line ``EXPR  # LITERAL`` of a Python block."""
    promised = []
    for line in block.splitlines():
        code, _, comment = line.partition("#")
        try:
            value = ast.literal_eval(comment.strip())
        except (ValueError, SyntaxError):
            continue
        if code.strip() and not re.match(r"\s*[\w.,\s]+=(?!=)", code):   # an expression, not an assignment
            promised.append((code.strip(), value))
    return promised


@pytest.fixture
def fresh_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return tmp_path


def test_quickstart_runs_and_gives_the_values_it_shows(fresh_folder):
    block = _blocks("python", "robust_attn.list_models")
    scope: dict = {}
    exec(compile(block, "README quickstart", "exec"), scope)
    promised = _promised_values(block)
    assert promised, "the quickstart shows no values"
    for expression, value in promised:
        assert eval(expression, scope) == value, expression


def test_python_api_example_runs_and_its_report_command_reads_its_runs(fresh_folder, capsys):
    exec(compile(_blocks("python", "run_pgd(model, data", MODEL_SOURCES), "docs API example", "exec"), {})
    command = re.search(r"`robust-attn (report runs/api-rotation[^`]*)`", MODEL_SOURCES).group(1).split()
    assert main(command) == 0, capsys.readouterr().err
    report = (fresh_folder / "runs" / "api-report" / "report.md").read_text()
    assert "my_cnn" in report and "resnet26" in report


def test_own_model_shell_example_runs_as_pasted(fresh_folder):
    """``export PATH=$PWD/.venv/bin:$PATH`` finds nothing in the fresh folder: the test puts this
    interpreter's ``robust-attn`` first on PATH instead, as the README's install does."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-e", "-c", _blocks("bash", "cat > runs/my_model.py")], cwd=fresh_folder, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = (fresh_folder / "runs" / "report-my_cnn" / "report.md").read_text()
    assert "Table 9" in report and "Table 10" in report and "APGD-CE" in report


def test_cli_quickstart_runs_as_pasted(fresh_folder):
    """The quickstart's shell block: the zoo list, SAN's two protocols on the embedded test set and
    the report, with its page."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-e", "-c", _blocks("bash", "robust-attn zoo list")], cwd=fresh_folder, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = fresh_folder / "runs" / "quick-report"
    assert "Table 9" in (report / "report.md").read_text() and (report / "report.html").is_file()
