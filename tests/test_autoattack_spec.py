"""protocols/autoattack.toml, the AutoAttack specification, agrees with the code that runs it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from robust_attn.attacks import apgd, apgd_run, autoattack, fab, square
from robust_attn.attacks.base import AttackConfig, make_attack
from robust_attn.study import StudyConfig


@pytest.fixture(scope="module")
def spec():
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    return tomllib.loads((Path(__file__).resolve().parents[1] / "protocols" / "autoattack.toml").read_text())


def test_the_ensemble_and_its_members_are_the_specified_ones(spec):
    assert spec["protocol"]["name"] == autoattack.AutoAttack.name
    assert list(spec["ensemble"]["members"]) == list(autoattack.STANDARD)
    ensemble = make_attack(AttackConfig("autoattack", eps=8 / 255))
    assert ensemble.member_names == list(autoattack.STANDARD)
    targets = spec["ensemble"]["target_classes"]
    assert targets == autoattack.N_TARGET_CLASSES == apgd.N_TARGET_CLASSES == fab.N_TARGET_CLASSES
    members = spec["members"]
    # what the ensemble actually runs, member by member (10 classes: 9 targets)
    run = {m: make_attack(ensemble.member_config(m, i, num_classes=10)) for i, m in enumerate(ensemble.member_names)}
    for m in ("apgd-ce", "apgd-t", "fab-t"):
        assert run[m].steps == members[m]["iterations"], m
    assert run["square"].budget == members["square"]["queries"]
    for m in ("apgd-t", "fab-t"):
        assert run[m].config.options["n_target_classes"] == targets
    assert all(run[m].config.restarts == members[m]["restarts"] for m in members)
    assert members["apgd-ce"]["iterations"] == members["apgd-t"]["iterations"] == apgd.DEFAULT_STEPS
    assert members["apgd-ce"]["momentum"] == apgd_run.ALPHA and members["apgd-ce"]["rho"] == apgd_run.RHO
    assert members["apgd-ce"]["checkpoints"] == apgd_run.checkpoints(members["apgd-ce"]["iterations"])
    assert members["fab-t"]["iterations"] == fab.DEFAULT_STEPS
    assert (members["fab-t"]["alpha_max"], members["fab-t"]["eta"], members["fab-t"]["beta"]) == (
        fab.ALPHA_MAX, fab.ETA, fab.BETA)
    assert members["square"]["queries"] == square.DEFAULT_QUERIES and members["square"]["p_init"] == square.P_INIT


def test_the_study_runs_the_specified_radii_on_the_specified_subset(spec):
    study, default = spec["study"], StudyConfig()
    assert list(study["radii"]) == list(default.autoattack_eps)
    assert study["images"] == default.attack_limit
    assert (study["square_alone"]["eps"], study["square_alone"]["queries"]) == (default.square_eps,
                                                                                default.square_queries)
