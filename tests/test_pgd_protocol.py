"""Targeted PGD protocol (SAN section 5.4, Table 10): settings, targets, records, rates."""
from __future__ import annotations

import json
import sys

import pandas as pd

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from robust_attn.data import build_dataset
from robust_attn.protocols.pgd import (CLEAN, PAPER_SETTINGS, AttackSetting, pgd_settings, run_pgd,
                                       summarize_pgd)
from robust_attn.runs.store import load_records
from robust_attn.models.wrapper import NormalizedModel


def test_settings_default_to_the_papers_two():
    assert pgd_settings() == list(PAPER_SETTINGS) == [AttackSetting(8, 4, 2), AttackSetting(8, 2, 4)]
    sweep = pgd_settings(eps=[2, 4, 8], steps=[2, 4])
    assert len(sweep) == 6 and AttackSetting(2, 0.5, 4) in sweep
    assert pgd_settings(eps=[8], steps=[4], step=[1, 2]) == [AttackSetting(8, 1, 4), AttackSetting(8, 2, 4)]
    assert AttackSetting(8, 4, 2).name == "pgd_eps8_step4_n2"
    with pytest.raises(ValueError, match="steps"):
        pgd_settings(steps=[1.5])
    with pytest.raises(ValueError):
        AttackSetting(-1, 1, 1)


class FirstPixelReader(nn.Module):
    """Predicts class round(10 * x[:, 0, 0, 0]) with margin: a model whose output we control."""

    def forward(self, x):
        centres = torch.arange(10, dtype=x.dtype) / 10
        return -((x[:, :1, 0, 0] - centres) ** 2) * 100


def _scripted_attack(model, images, targets, config, backend="native"):
    """Writes the target into the first pixel of the first two images of every batch."""
    adv = images.clone()
    adv[:2, 0, 0, 0] = targets[:2].to(adv.dtype) / 10
    return adv


def test_rates_from_records_match_a_hand_count(tmp_path):
    labels = torch.arange(8) % 10
    images = torch.zeros(8, 3, 4, 4)
    images[:, 0, 0, 0] = labels / 10
    images[6:, 0, 0, 0] = ((labels[6:] + 1) % 10) / 10  # images 6 and 7 are misclassified
    dataset = TensorDataset(images, labels)  # no .targets: labels are read by one pass
    store = run_pgd(FirstPixelReader(), dataset, tmp_path / "run", num_classes=10,
                    settings=[AttackSetting(8, 4, 2)], seed=1, batch_size=4, progress=False,
                    attack=_scripted_attack, checks=False)
    records = load_records(store.root)
    summary = summarize_pgd(records).set_index("condition")
    targets = pd.read_csv(store.root / "targets.csv")["target"].to_numpy()
    assert summary.loc[CLEAN, "top1"] == 75.0
    clean_pred = (labels + torch.tensor([0] * 6 + [1, 1])) % 10
    clean_success = 100 * (clean_pred.numpy() == targets).mean()
    assert summary.loc[CLEAN, "success_rate"] == pytest.approx(clean_success)
    attacked = "pgd_eps8_step4_n2"
    # attacked: 0, 1, 4, 5 (success); untouched: 2, 3 (still correct), 6, 7 (still wrong)
    assert summary.loc[attacked, "success_rate"] == 50.0
    assert summary.loc[attacked, "top1"] == 25.0
    assert summary.loc[attacked, "n_clean_correct"] == 6
    assert summary.loc[attacked, "success_rate_clean_correct"] == pytest.approx(400 / 6)
    assert summary.loc[attacked, "top1_clean_correct"] == pytest.approx(200 / 6)
    rec = records[records["condition"] == attacked].sort_values("index")
    assert rec["success"].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]
    assert rec["target"].tolist() == targets.tolist()


def _tiny(seed):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(4, 10))
    return NormalizedModel(net, (0.5,) * 3, (0.25,) * 3).eval()


def test_targets_are_saved_and_shared_across_models(tmp_path):
    dataset = build_dataset("synthetic", split="test", limit=10)
    settings = [AttackSetting(8, 4, 2)]
    kw = dict(num_classes=10, settings=settings, batch_size=5, progress=False, checks=False)
    a = run_pgd(_tiny(0), dataset, tmp_path / "a", seed=7, **kw)
    b = run_pgd(_tiny(1), dataset, tmp_path / "b", seed=7, **kw)
    c = run_pgd(_tiny(2), dataset, tmp_path / "c", seed=99, targets_file=a.root / "targets.csv", **kw)
    ta = pd.read_csv(a.root / "targets.csv")
    assert ta["label"].tolist() == dataset.targets
    assert (ta["target"] != ta["label"]).all() and ta["target"].between(0, 9).all()
    assert ta.equals(pd.read_csv(b.root / "targets.csv")) and ta.equals(pd.read_csv(c.root / "targets.csv"))
    for store in (a, b, c):
        rec = load_records(store.root)
        for _, group in rec.groupby("condition"):
            assert group.sort_values("index")["target"].tolist() == ta["target"].tolist()
    assert json.loads((c.root / "run.json").read_text())["parameters"]["targets"]["file"].endswith("targets.csv")
    other = build_dataset("synthetic", split="test", limit=12)
    with pytest.raises(ValueError, match="other images"):
        run_pgd(_tiny(0), other, tmp_path / "d", targets_file=a.root / "targets.csv", **kw)
    with pytest.raises(ValueError, match="different run"):  # same directory, other seed
        run_pgd(_tiny(0), dataset, tmp_path / "a", seed=8, **kw)
    # where the targets come from may change on resumption (c was made with a's file, is resumed
    # with b's file of the same content): only their content must be the same
    run_pgd(_tiny(2), dataset, tmp_path / "c", seed=99, targets_file=b.root / "targets.csv", **kw)
    shifted = ta.assign(target=(ta["target"] + 1) % 10)
    shifted.loc[shifted["target"] == shifted["label"], "target"] = (shifted["label"] + 2) % 10
    shifted.to_csv(tmp_path / "shifted.csv", index=False)
    with pytest.raises(ValueError, match="other targets"):
        run_pgd(_tiny(2), dataset, tmp_path / "c", seed=99, targets_file=tmp_path / "shifted.csv", **kw)


def test_real_attack_records_are_consistent(tmp_path):
    dataset = build_dataset("synthetic", split="test", limit=6)
    settings = [AttackSetting(0, 4, 2), AttackSetting(8, 4, 2)]
    store = run_pgd(_tiny(0), dataset, tmp_path / "run", num_classes=10, settings=settings, seed=0,
                    batch_size=3, progress=False)
    records = load_records(store.root)
    assert (records["success"] == (records["pred"] == records["target"])).all()
    assert (records["top1"] == (records["pred"] == records["label"])).all()
    by = {c: g.sort_values("index") for c, g in records.groupby("condition")}
    assert by["pgd_eps0_step4_n2"]["pred"].tolist() == by[CLEAN]["pred"].tolist()  # eps 0 = clean
    assert by["pgd_eps8_step4_n2"]["linf"].max() <= 8 + 1e-3
    assert by["pgd_eps8_step4_n2"]["linf"].max() > 0
    checks = json.loads((store.root / "checks.json").read_text())
    assert checks and all({"name", "passed", "detail"} <= set(c) for c in checks)
    assert all(c["passed"] for c in checks), checks
    names = {c["name"] for c in checks}
    assert {"eps_zero", "perturbation_bound", "monotone_success"} <= names, names
    assert {c["setting"] for c in checks} == {"pgd_eps0_step4_n2", "pgd_eps8_step4_n2", "all"}


def test_protocol_spec_file_agrees_with_the_code():
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    from pathlib import Path

    spec = tomllib.loads((Path(__file__).resolve().parents[1] / "protocols" / "pgd.toml").read_text())
    # the file in image units (8/255), the conditions in Table 10's 1/255 units
    from robust_attn.utils.radius import parse_radius

    in_levels = [AttackSetting(round(parse_radius(s["eps"]) * 255, 6), round(parse_radius(s["step"]) * 255, 6),
                               s["steps"]) for s in spec["paper"]["settings"]]
    assert in_levels == list(PAPER_SETTINGS) == pgd_settings()
    assert spec["choices"]["random_start"] is False
