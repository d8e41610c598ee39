"""After the README's install, the study on the shipped zoo runs from the test sets
embedded in the package: no data root, no Debian package, no download, no ../shared.

The short form of ``robust-attn study --dataset DATASET`` (a few images, one model, the SAN
protocols) through the CLI, with ``$ROBUST_ATTN_DATA`` pointing at an empty folder and the
Debian location of Fashion-MNIST hidden."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from robust_attn.cli import main
from robust_attn.models.manifest import Manifest


@pytest.fixture
def bare_machine(tmp_path, monkeypatch):
    """Nothing to read but what the package ships."""
    from robust_attn.data import fashion_mnist

    empty = tmp_path / "no-data"
    empty.mkdir()
    monkeypatch.setenv("ROBUST_ATTN_DATA", str(empty))
    monkeypatch.setattr(fashion_mnist, "KNOWN_LOCATIONS", [tmp_path / "no-debian-package"])
    return empty


@pytest.mark.parametrize("dataset", ["cifar10", "fashion_mnist"])
def test_readme_study_runs_on_the_embedded_test_set(dataset, bare_machine, tmp_path, capsys):
    if not any(e.dataset == dataset and e.name == "resnet26" for e in Manifest().entries.values()):
        pytest.skip(f"no zoo resnet26 for {dataset}")
    runs, report = tmp_path / "runs", tmp_path / "report"
    argv = ["study", "--dataset", dataset, "--models", "resnet26", "--limit", "12", "--batch-size", "6",
            "--protocols", "rotation,pgd", "--angle-step", "0", "--sweep-eps", "2/255", "--workers", "1",
            "--runs", str(runs), "--out", str(report), "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "embedded" in err and "default location" in err           # the command says where the data came from
    run = json.loads((runs / "rotation-resnet26" / "run.json").read_text())
    assert "embedded" in run["data_source"] and run["dataset"]["limit"] == 12
    assert run["data_variant"] == ("cifar10-jpeg" if dataset == "cifar10" else "fashion_mnist")
    table10 = pd.read_csv(report / "table10_pgd.csv")
    assert len(table10) == 1 and 0 <= table10.iloc[0]["clean_top1"] <= 100
    assert (report / "report.md").is_file()
