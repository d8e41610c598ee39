"""protocols/autoattack.toml, the AutoAttack specification, agrees with the code that runs it; the
ensemble runs its members as specified (each on the images the earlier ones left robust)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from robust_attn.attacks import apgd, apgd_run, autoattack, fab, square
from robust_attn.attacks.base import AttackConfig, make_attack
from robust_attn.study.config import StudyConfig
from robust_attn.utils.radius import parse_radius
from helpers import LeadingLinear


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
    assert [parse_radius(r) for r in study["radii"]] == list(default.autoattack_eps)
    assert study["images"] == default.attack_limit
    assert (parse_radius(study["square_alone"]["eps"]), study["square_alone"]["queries"]) == (default.square_eps,
                                                                                              default.square_queries)


@pytest.mark.parametrize("num_classes,expected", [(4, 3), (5, 4), (9, 8), (10, 9), (100, 9)])
def test_targeted_members_take_every_wrong_class_when_there_are_fewer_than_ten(num_classes, expected):
    """Section 5 / the standard version: APGD-T and FAB-T target the 9 most likely wrong classes;
    with fewer than 10 classes every wrong class, min(9, C - 1) (module docstring of autoattack.py)."""
    ensemble = make_attack(AttackConfig("autoattack", eps=8 / 255))
    for position, member in enumerate(ensemble.member_names):
        config = ensemble.member_config(member, position, num_classes=num_classes)
        if member in ("apgd-t", "fab-t"):
            assert config.options["n_target_classes"] == expected, member
            assert make_attack(config).target_classes(num_classes) == expected, member
        else:
            assert "n_target_classes" not in config.options, member


def test_a_short_autoattack_run_on_a_five_class_model_completes(monkeypatch):
    """The whole standard ensemble (APGD-CE, APGD-T, FAB-T, Square; 2 iterations, 3 queries) on
    a 5-class model: the targeted members run with the 4 wrong classes as targets and it finishes."""
    ensemble = make_attack(AttackConfig("autoattack", eps=1 / 255, steps=2, queries=3))
    made = []   # the configs the ensemble builds its members from while it runs
    real = autoattack.make_attack

    def recording(config):
        made.append(config)
        return real(config)
    monkeypatch.setattr(autoattack, "make_attack", recording)
    images = 0.25 + 0.5 * torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    labels = torch.zeros(3, dtype=torch.long)
    out = ensemble.run(LeadingLinear(seed=0, lead=40.0).eval(), images, labels)   # no member fools it at 1/255
    assert [c.attack for c in made] == list(autoattack.STANDARD)   # every member ran
    assert {c.attack: c.options.get("n_target_classes") for c in made} == {
        "apgd-ce": None, "apgd-t": 4, "fab-t": 4, "square": None}
    assert out.by == ["", "", ""] and out.adv.shape == images.shape
    assert (out.queries == 1 + 3).all()   # Square's: its clean check and 3 queries per image


def test_each_member_attacks_only_the_images_still_robust_and_is_credited_with_its_own(monkeypatch):
    """Scripted members on a nearest-grey-level model: each fools a fixed set of images (by moving
    them one level up); a member sees only the images every earlier member left robust (an image
    misclassified clean is seen by none), and each fooled image is credited to the first member
    that fooled it."""
    from robust_attn.attacks.base import AttackOutput

    class Grey(torch.nn.Module):   # class k: mean pixel nearest to k / 10 + 0.05
        def forward(self, x):
            return -(x.mean((1, 2, 3))[:, None] - (torch.arange(10) / 10 + 0.05)) ** 2

    fools = {"apgd-ce": {0, 1}, "apgd-t": {1, 2}, "fab-t": {3}, "square": set()}
    seen = {}

    class Scripted:
        attack_copy = progress = None
        portable_progress = False

        def __init__(self, config):
            self.name = config.attack

        def run(self, model, images, labels):
            ids = [round(float(x.mean()) * 10 - 0.5) for x in images]   # the image's own grey level
            seen[self.name] = ids
            shift = torch.tensor([0.1 if i in fools[self.name] else 0.0 for i in ids]).view(-1, 1, 1, 1)
            return AttackOutput(images + shift)

    monkeypatch.setattr(autoattack, "make_attack", Scripted)
    images = (torch.arange(7) / 10 + 0.05).view(-1, 1, 1, 1).expand(7, 3, 4, 4).clone()
    labels = torch.tensor([0, 1, 2, 3, 4, 5, 0])   # image 6 is misclassified clean
    out = make_attack(AttackConfig("autoattack", eps=0.15)).run(Grey().eval(), images, labels)   # > one level
    assert seen == {"apgd-ce": [0, 1, 2, 3, 4, 5], "apgd-t": [2, 3, 4, 5], "fab-t": [3, 4, 5], "square": [4, 5]}
    assert out.by == ["apgd-ce", "apgd-ce", "apgd-t", "fab-t", "", "", "clean"]
    with torch.no_grad():
        assert (Grey()(out.adv).argmax(1) != labels).tolist() == [True] * 4 + [False, False, True]
