"""run.json's schema versions (robust_attn.runs.migrations): Table 10's PGD runs of version 5
and before recorded eps, step and each image's linf in 1/255 units; they read in image units,
resume in their own layout, and keep their stored bytes."""
from __future__ import annotations

import gzip
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from robust_attn.protocols.pgd import AttackSetting, run_pgd
from robust_attn.reports.runs import load_runs
from robust_attn.reports.tables import pgd_sweep
from robust_attn.runs.migrations import IMAGE_UNITS, SCHEMA_VERSION
from robust_attn.runs.store import RunMismatchError, RunStore, load_records

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = sorted(ROOT.glob("reports/study-*/runs/pgd-*/run.json"))


def _condition_numbers(name: str) -> tuple[float, float]:
    """eps and step of a Table 10 condition name, in 1/255 units (``pgd_eps8_step2_n4`` -> 8, 2)."""
    match = re.fullmatch(r"pgd_eps([0-9.]+)_step([0-9.]+)_n[0-9]+", name)
    return float(match[1]), float(match[2])


@pytest.mark.skipif(not COMMITTED, reason="no committed pgd runs in this checkout")
@pytest.mark.parametrize("path", [p.parent for p in COMMITTED[:2]], ids=lambda p: f"{p.parents[1].name}/{p.name}")
def test_a_committed_pgd_run_in_1_255_units_reads_in_image_units(path):
    raw = json.loads((path / "run.json").read_text())
    if raw["parameters"].get("units") != "1/255":
        pytest.skip(f"{path} was recorded in image units")
    assert raw.get("schema", 1) < SCHEMA_VERSION
    raw_records = pd.read_csv(io.BytesIO(gzip.decompress((path / "records.csv.gz").read_bytes())))
    store = RunStore(path)
    assert store.verify() == []   # the stored bytes are untouched
    description = store.description()
    assert description["parameters"]["units"] == IMAGE_UNITS
    for old, new in zip(raw["conditions"], description["conditions"]):
        assert new["name"] == old["name"] and new["steps"] == old["steps"]
        if old["name"] != "clean":
            assert (new["eps"] * 255, new["step"] * 255) == pytest.approx(_condition_numbers(old["name"]))
    records = store.records()
    assert records.drop(columns="linf").equals(raw_records.drop(columns="linf"))
    np.testing.assert_allclose(records["linf"].to_numpy() * 255, raw_records["linf"].to_numpy(), atol=1e-9)
    assert records["linf"].max() <= 16 / 255 + 1e-6   # the largest radius of the study's sweep
    # the report's table of every setting keeps Table 10's 1/255 numbers, as the names say
    sweep = pgd_sweep(load_runs([path])).set_index("condition")
    for name in sweep.index.drop("clean"):
        assert (sweep.loc[name, "eps"], sweep.loc[name, "step"]) == pytest.approx(_condition_numbers(name))
        assert sweep.loc[name, "max_linf"] <= _condition_numbers(name)[0] + 1e-4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 5)).eval()


def _dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    return TensorDataset(torch.rand(6, 3, 8, 8, generator=gen) * 0.8 + 0.1, torch.arange(6) % 5)


SETTING = AttackSetting(8, 4, 2)


def _run(out: Path, setting: AttackSetting = SETTING):
    return run_pgd(_model(), _dataset(), out, num_classes=5, settings=[setting], seed=3, batch_size=2,
                   progress=False, checks=False)


def _as_version_5(new: Path, old: Path, chunks: int) -> None:
    """``old``: the run of ``new`` as the code of schema version 5 would have left it interrupted
    after ``chunks`` chunks of each condition: run.json and the records in 1/255 units."""
    old.mkdir()
    description = json.loads((new / "run.json").read_text())
    description["schema"] = 5
    description["parameters"]["units"] = "1/255"
    for condition in description["conditions"]:
        condition["eps"], condition["step"] = condition["eps"] * 255, condition["step"] * 255
    (old / "run.json").write_text(json.dumps(description))
    shutil.copy(new / "targets.csv", old / "targets.csv")
    records = load_records(new)
    writer = RunStore(old)   # not opened: writes the records as given
    for condition, group in records.groupby("condition"):
        for start in range(0, 2 * chunks, 2):
            chunk = group[(group["index"] >= start) & (group["index"] < start + 2)].drop(columns="condition")
            writer.write_chunk(condition, start, start + 2, chunk.assign(linf=(chunk["linf"] * 255).round(4)))


def test_an_old_pgd_run_resumes_in_its_own_layout_and_reads_like_a_new_one(tmp_path):
    new, old = tmp_path / "new", tmp_path / "old"
    _run(new)
    stored_new = json.loads((new / "run.json").read_text())
    assert stored_new["schema"] == SCHEMA_VERSION and stored_new["parameters"]["units"] == IMAGE_UNITS
    attacked = [c for c in stored_new["conditions"] if c["name"] == SETTING.name][0]
    assert (attacked["eps"], attacked["step"]) == pytest.approx((8 / 255, 4 / 255))
    fresh = load_records(new)
    assert fresh.loc[fresh["condition"] == SETTING.name, "linf"].max() == pytest.approx(8 / 255, abs=1e-6)

    _as_version_5(new, old, chunks=1)
    run_json = (old / "run.json").read_bytes()
    with pytest.raises(RunMismatchError, match="conditions"):
        _run(old, AttackSetting(4, 2, 2))   # another radius is another run, in either layout
    _run(old)   # resumes: the two chunks left of each condition
    assert (old / "run.json").read_bytes() == run_json
    stored = RunStore(old).stored_records()
    assert stored.loc[stored["condition"] == SETTING.name, "linf"].max() == pytest.approx(8, abs=1e-3)   # one layout
    resumed = load_records(old)
    pd.testing.assert_frame_equal(resumed.drop(columns="linf"), fresh.drop(columns="linf"))
    np.testing.assert_allclose(resumed["linf"], fresh["linf"], atol=1e-6)
    assert RunStore(old).description()["conditions"] == RunStore(new).description()["conditions"]

    packed = RunStore(old).pack(tmp_path / "packed")   # packed as stored, read as current
    assert (packed.root / "run.json").read_bytes() == run_json and packed.verify() == []
    pd.testing.assert_frame_equal(load_records(packed.root), resumed)
