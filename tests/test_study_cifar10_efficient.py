"""The study of the efficient-recipe CIFAR-10 zoo (zoo/studies/cifar10_efficient.toml): what it
runs, AutoAttack on its own seeded part of the attack subset (``autoattack_limit``), and the plan
it prints while the zoo lacks its models."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from robust_attn.cli import main
from robust_attn.data import build_dataset
from robust_attn.protocols.attack_steps import autoattack_images
from robust_attn.study.config import StudyConfig, StudyConfigError, load_study_config, study_config_from_dict
from robust_attn.study.estimate import plan_rows
from robust_attn.study.run import run_study
from test_study import tiny_zoo  # noqa: F401  (the fixture: a zoo of two tiny synthetic-data models)

ROOT = Path(__file__).resolve().parents[1]
TOML = ROOT / "zoo" / "studies" / "cifar10_efficient.toml"
FAMILIES = ("resnet26", "san10_pairwise", "san10_patchwise", "sasa_resnet26", "gsa_resnet26", "aa_resnet26",
            "ea_resnet26")


def test_the_study_config_says_what_the_zoo_is_studied_with():
    config = load_study_config(TOML)
    assert config.dataset == "cifar10" and config.split == "test" and config.limit is None   # all 10,000 images
    assert config.protocols == ("rotation", "pgd", "corruption", "apgd", "autoattack", "square", "transfer",
                                "masking")
    assert config.corruptions == "common" and config.severities == (1, 2, 3, 4, 5)
    assert config.attack_limit == 1000 and config.autoattack_limit == 500
    # APGD-CE at Square's radius too: the white-box attack the masking checks compare Square with
    assert config.apgd_eps == pytest.approx((1 / 255, 2 / 255, 4 / 255, 8 / 255))
    assert max(config.autoattack_eps) < config.square_eps
    assert config.autoattack_eps == pytest.approx((2 / 255,)) and config.square_eps == pytest.approx(8 / 255)
    # the new zoo's entries, labelled by family so its rows read as the width-0.25 zoo's
    assert [(m.spec, m.name) for m in config.models] == [(f"zoo:{f}-efficient", f) for f in FAMILIES]
    assert config.baseline == "resnet26"


def test_autoattack_limit_is_checked():
    with pytest.raises(StudyConfigError, match="autoattack_limit must be positive"):
        study_config_from_dict({"dataset": "synthetic", "models": ["resnet26"], "autoattack_limit": 0,
                                "baseline": "resnet26"})
    # the plan counts AutoAttack's images apart from the other attacks'
    config = StudyConfig(protocols=("apgd", "autoattack"), attack_limit=100, autoattack_limit=40)
    rows = {r.protocol: r.images for r in plan_rows(config, ["a"], {}, 1000, 100)}
    assert rows == {"apgd": 100, "autoattack": 40}
    assert plan_rows(StudyConfig(protocols=("autoattack",), autoattack_limit=400), ["a"], {}, 1000, 100)[0].images \
        == 100   # never more than the attack subset


def test_autoattack_images_are_a_seeded_part_of_the_attack_subset():
    attack = build_dataset("synthetic", split="test", limit=12)
    part = autoattack_images(attack, 5)
    assert len(part) == 5
    images = [attack[i][0] for i in range(len(attack))]
    found = [next(i for i, image in enumerate(images) if torch.equal(image, part[j][0])) for j in range(5)]
    assert len(set(found)) == 5 and [part[j][1] for j in range(5)] == [attack[i][1] for i in found]
    again = autoattack_images(attack, 5)   # the same images every time
    assert all(torch.equal(part[j][0], again[j][0]) for j in range(5))
    assert autoattack_images(attack, None) is attack and autoattack_images(attack, 12) is attack


def test_study_runs_autoattack_on_its_own_limit(tmp_path, tiny_zoo):
    config = StudyConfig(dataset="synthetic", limit=8, attack_limit=6, autoattack_limit=3, models=("resnet26",),
                         baseline="resnet26", protocols=("apgd", "autoattack"), apgd_eps=(8 / 255,),
                         autoattack_eps=(8 / 255,), attack_steps=2, square_queries=5, batch_size=8,
                         attack_batch_size=3, bootstrap=20)
    runs, report = tmp_path / "runs", tmp_path / "report"
    run_study(config, runs, report, manifest=tiny_zoo, device="cpu", progress=False, log=lambda *_: None)
    described = {p: json.loads((runs / f"{p}-resnet26" / "run.json").read_text()) for p in ("apgd", "autoattack")}
    assert (described["apgd"]["num_images"], described["autoattack"]["num_images"]) == (6, 3)
    assert "on a seeded 3 of them" in (report / "report.md").read_text()


def test_plan_of_a_study_whose_models_are_not_trained_yet(tmp_path, capsys):
    manifest = tmp_path / "manifest.json"
    manifest.write_text('{"models": []}')
    code = main(["study", str(TOML), "--plan", "--device", "cpu", "--manifest", str(manifest),
                 "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    said = capsys.readouterr()
    assert code == 2 and "Traceback" not in said.err
    # what would run, on how many images, without times
    for protocol, images in (("rotation", 10000), ("corruption", 10000), ("apgd", 1000), ("autoattack", 500),
                             ("square", 1000), ("masking", 100)):
        assert f"{protocol} ({images} img)" in said.out
    assert all(f"  {family} " in said.out for family in FAMILIES) and "no time is estimated" in said.out
    # then why it stops: every missing entry named, with what to do
    assert "has no cifar10 entry for 7 of the study's 7 models" in said.err
    assert all(f"{family}-efficient" in said.err for family in FAMILIES)
    assert "robust-attn zoo add NAME --dataset cifar10" in said.err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()
