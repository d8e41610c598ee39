"""The attack and transfer protocols: records, resumption, sharding, the AutoAttack
ensemble's worst case, transfer matrices, and the CLI's errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn as nn

from robust_attn.attacks.base import ATTACKS, Attack, AttackConfig, AttackOutput, list_attacks, make_attack
from robust_attn.cli import main
from robust_attn.data import build_dataset
import robust_attn.protocols.attack as attack_protocol
from robust_attn.protocols.attack import (CLEAN, computation_order, logit_margin, resume_order, run_attack,
                                          summarize_attack)
from robust_attn.protocols.transfer import EnsembleModel, run_transfer, summarize_transfer
from robust_attn.models.registry import create_model
from robust_attn.runs.store import RunStore, load_records
from robust_attn.models.wrapper import NormalizedModel
from helpers import subprocess_env

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "resnet26", "--model-args", "width=0.25", "stem_downsample=4", "--dataset", "synthetic",
        "--no-progress"]


class SignNoise(Attack):
    """A seeded random corner of the L-inf ball: deterministic per seed, no gradients."""

    name = "test-sign-noise"
    norms = ("linf",)

    def _run(self, model, images, labels, targets):
        g = torch.Generator().manual_seed(self.config.seed)
        sign = torch.randint(0, 2, images.shape, generator=g).float() * 2 - 1
        return AttackOutput((images + self.config.eps * sign).clamp(0, 1))


def _fooling_attack(name: str, fools, calls: list):
    """An attack that 'fools' exactly the images whose value at pixel 0 satisfies ``fools``, by
    setting that image to a fixed pattern the test model maps to class 0 (see _PixelModel)."""

    class Fool(Attack):
        gradient_free = True

        def _run(self, model, images, labels, targets):
            calls.append((self.name, images[:, 0, 0, 0].clone()))
            adv = images.clone()
            hit = fools(images[:, 0, 0, 0])
            adv[hit, 1] = (adv[hit, 1] - self.config.eps).clamp(0, 1)   # channel 1 down: class 0 wins
            return AttackOutput(adv, queries=torch.full((len(images),), 7))

    Fool.name = name
    return Fool


class _PixelModel(nn.Module):
    """Two classes from the mean of channels 0 and 1: logits (c1 - c0 - t, c0 - c1 + t)... kept
    simple: class 1 when channel 1's mean exceeds channel 0's by more than 0."""

    def forward(self, x):
        d = x[:, 1].mean((1, 2)) - x[:, 0].mean((1, 2))
        return torch.stack([-d, d], 1) * 100


@pytest.fixture
def registered():
    added = []

    def add(cls):
        added.append(ATTACKS.register(cls.name, cls))
        return cls
    yield add
    for cls in added:
        ATTACKS.remove(cls.name)


class BudgetBreaker(Attack):
    """Returns what ``options["mode"]`` says, to trip the output check of Attack.run: "linf-2eps"
    (every pixel moved by 2 eps), "l2-2eps" (a perturbation of L2 norm 2 eps), "just-over" (1.01 eps,
    beyond the check's float slack of 1e-5 / 1e-4), "at-eps" (exactly eps: allowed), "nan", or
    "below-0" (within eps but under 0)."""

    name = "test-budget-breaker"

    def _run(self, model, images, labels, targets):
        mode, eps = self.config.options["mode"], self.config.eps
        if mode in ("linf-2eps", "l2-2eps", "just-over", "at-eps"):
            scale = {"linf-2eps": 2.0, "l2-2eps": 2.0, "just-over": 1.01, "at-eps": 1.0}[mode]
            if self.config.norm == "linf":
                return AttackOutput(images + scale * eps)
            delta = torch.ones_like(images)
            return AttackOutput(images + scale * eps * delta / delta.flatten(1).norm(dim=1).view(-1, 1, 1, 1))
        if mode == "nan":
            adv = images.clone()
            adv[0, 0, 0, 0] = float("nan")
            return AttackOutput(adv)
        return AttackOutput(images - eps / 2)   # mode "below-0": inside the ball, outside [0, 1]


@pytest.mark.parametrize("norm,mode,message", [
    ("linf", "linf-2eps", r"exceeded its linf budget 0\.0313725: largest perturbation 0\.0627"),
    ("linf", "just-over", "exceeded its linf budget"),
    ("l2", "l2-2eps", r"exceeded its l2 budget 0\.1: largest perturbation 0\.2"),
    ("l2", "just-over", "exceeded its l2 budget"),
])
def test_an_attack_leaving_its_eps_ball_is_an_error(registered, norm, mode, message):
    """Attack.run checks every attack's output (base.Attack._check_output): a perturbation larger
    than eps in the attack's norm is a bug in the attack, raised, never recorded as a robust
    accuracy at that eps."""
    registered(BudgetBreaker)
    images = torch.full((3, 3, 4, 4), 0.5)
    images[:, 0, 0, 0] = torch.tensor([0.3, 0.4, 0.6])
    labels = _PixelModel()(images).argmax(1)
    eps = 8 / 255 if norm == "linf" else 0.1
    attack = make_attack(AttackConfig("test-budget-breaker", norm=norm, eps=eps, options={"mode": mode}))
    with pytest.raises(RuntimeError, match=message):
        attack.run(_PixelModel().eval(), images, labels)
    ok = make_attack(AttackConfig("test-budget-breaker", norm=norm, eps=eps, options={"mode": "at-eps"}))
    assert ok.run(_PixelModel().eval(), images, labels).adv.shape == images.shape   # exactly eps is allowed


@pytest.mark.parametrize("mode,message", [
    ("nan", "non-finite values"),
    ("below-0", r"test-budget-breaker left \[0, 1\]: values in \[-0\.01569"),
])
def test_an_attack_returning_nan_or_leaving_the_unit_box_is_an_error(registered, mode, message):
    """The other half of the output check: the images returned are finite and in [0, 1] (a
    perturbation inside the eps-ball that leaves the pixel range is no valid image)."""
    registered(BudgetBreaker)
    images = torch.zeros(2, 3, 4, 4)   # on the box's lower face: minus eps/2 leaves it
    images[:, 1] = 0.1
    labels = _PixelModel()(images).argmax(1)
    attack = make_attack(AttackConfig("test-budget-breaker", eps=8 / 255, options={"mode": mode}))
    with pytest.raises(RuntimeError, match=message):
        attack.run(_PixelModel().eval(), images, labels)


def test_the_budget_breaker_is_not_left_registered():
    """The test attacks are registered per test (monkeypatch): none stays in the registry."""
    assert "test-budget-breaker" not in list_attacks() and "test-sign-noise" not in list_attacks()


def test_margin_is_label_logit_minus_best_other():
    logits = torch.tensor([[1.0, 3.0, 2.0], [5.0, -1.0, 4.5]])
    labels = torch.tensor([2, 0])
    assert torch.allclose(logit_margin(logits, labels), torch.tensor([2.0 - 3.0, 5.0 - 4.5]))


def test_autoattack_keeps_the_first_success_and_attacks_only_robust_images(registered):
    calls = []
    # images: channel 1 = 0.6 > channel 0 = 0.5 -> class 1 (correct for label 1); pixel 0 of channel 0 tags them
    images = torch.full((6, 3, 4, 4), 0.5)
    images[:, 1] = 0.6
    tags = torch.tensor([0.10, 0.20, 0.30, 0.40, 0.45, 0.35])
    images[:, 0, 0, 0] = tags
    labels = torch.tensor([1, 1, 1, 1, 0, 1])   # image 4 is misclassified without attack
    registered(_fooling_attack("test-a", lambda t: t < 0.25, calls))   # fools images 0, 1
    registered(_fooling_attack("test-b", lambda t: t > 0.0, calls))    # would fool all it sees
    aa = make_attack(AttackConfig("autoattack", eps=0.3, options={"attacks": ["test-a", "test-b"]}))
    model = _PixelModel().eval()
    out = aa.run(model, images, labels)
    assert out.by == ["test-a", "test-a", "test-b", "test-b", "clean", "test-b"]
    seen_a, seen_b = calls[0][1], calls[1][1]
    assert torch.equal(seen_a, tags[[0, 1, 2, 3, 5]])            # the misclassified image is not attacked
    assert torch.equal(seen_b, tags[[2, 3, 5]])                  # B only sees what A left robust
    assert (model(out.adv).argmax(1) != labels).all()
    assert out.queries.tolist() == [7, 7, 14, 14, 0, 14]


def test_a_killed_autoattack_chunk_resumes_after_its_last_finished_member(registered, tmp_path):
    """The ensemble saves its state after each member; killed in the second member, it resumes
    there (the first member is not run again) and returns what an uninterrupted run returns."""
    images = torch.full((6, 3, 4, 4), 0.5)
    images[:, 1] = 0.6
    images[:, 0, 0, 0] = torch.tensor([0.10, 0.20, 0.30, 0.40, 0.45, 0.35])
    labels = torch.tensor([1, 1, 1, 1, 0, 1])
    calls = []
    registered(_fooling_attack("test-a", lambda t: t < 0.25, calls))
    registered(_fooling_attack("test-b", lambda t: t > 0.32, calls))
    registered(_fooling_attack("test-c", lambda t: t > 0.0, calls))
    config = AttackConfig("autoattack", eps=0.3, options={"attacks": ["test-a", "test-b", "test-c"]})
    model = _PixelModel().eval()
    whole = make_attack(config).run(model, images, labels)

    class Killed(Exception):
        pass

    def killed(*_):
        raise Killed
    state = tmp_path / "state.pt"
    aa = make_attack(config)
    aa.state_path = state
    original = ATTACKS["test-b"]._run
    ATTACKS["test-b"]._run = killed
    try:
        with pytest.raises(Killed):
            aa.run(model, images, labels)
    finally:
        ATTACKS["test-b"]._run = original
    saved = torch.load(state, weights_only=True)   # saved after test-a: its two images, not the chunk
    assert saved["done"] == 1 and saved["fooled"].tolist() == [0, 1] and saved["fooled_adv"].shape == (2, 3, 4, 4)
    calls.clear()
    other = images.clone()
    other[0, 2] = 0.9   # another chunk's images: the state is not theirs
    fresh = make_attack(config)
    fresh.state_path = tmp_path / "copy.pt"
    fresh.state_path.write_bytes(state.read_bytes())
    fresh.run(model, other, labels)
    assert [name for name, _ in calls][0] == "test-a"
    calls.clear()
    again = make_attack(config)
    again.state_path = state
    resumed = again.run(model, images, labels)
    assert [name for name, _ in calls] == ["test-b", "test-c"]   # test-a's work was kept
    assert resumed.by == whole.by == ["test-a", "test-a", "test-c", "test-b", "clean", "test-b"]
    assert torch.equal(resumed.adv, whole.adv) and torch.equal(resumed.queries, whole.queries)
    old = tmp_path / "old.pt"   # this chunk's state in another format: ignored, the chunk runs afresh
    torch.save({"key": saved["key"], "done": 1, "adv": images.clone(), "by": saved["by"]}, old)
    legacy = make_attack(config)
    legacy.state_path = old
    calls.clear()
    with pytest.warns(UserWarning, match="another format"):
        rerun = legacy.run(model, images, labels)
    assert [name for name, _ in calls][0] == "test-a" and rerun.by == whole.by


def _tiny_autoattack_run(out, progress=False):
    data = build_dataset("synthetic", split="test", limit=4)
    model = NormalizedModel(create_model("resnet26", num_classes=10, resolution="cifar", width=0.25,
                                         stem_downsample=4), (0.5,) * 3, (0.5,) * 3).eval()
    config = AttackConfig("autoattack", eps=8 / 255, steps=2, queries=5)
    run_attack(model, data, out, configs=[config], num_classes=10, batch_size=4, checks=False, progress=progress)


def test_the_attack_protocol_deletes_autoattack_state_once_the_chunk_is_written(tmp_path):
    _tiny_autoattack_run(tmp_path / "run")
    assert not list((tmp_path / "run").rglob("*.pt"))   # nothing left of the per-member state
    assert len(load_records(tmp_path / "run")) == 8


def test_the_attack_protocol_prints_autoattacks_progress_with_its_bar(tmp_path, capsys):
    _tiny_autoattack_run(tmp_path / "run", progress=True)
    err = capsys.readouterr().err
    assert "chunk 0: autoattack linf eps=8/255: finished, " in err, err
    _tiny_autoattack_run(tmp_path / "quiet")
    assert "autoattack" not in capsys.readouterr().err


def test_autoattack_rejects_targeted_and_unknown_members():
    with pytest.raises(ValueError, match="no targeted mode"):
        make_attack(AttackConfig("autoattack", targeted=True))
    with pytest.raises(ValueError, match="unknown attack 'apgd-xx'"):
        make_attack(AttackConfig("autoattack", options={"attacks": ["apgd-xx"]}))


def _tiny_model(num_classes=10, seed=0):
    torch.manual_seed(seed)
    net = create_model("resnet26", num_classes=num_classes, resolution="cifar", width=0.25, stem_downsample=4)
    return NormalizedModel(net, [0.5] * 3, [0.25] * 3).eval()


def test_attack_records_resume_and_summaries(tmp_path, registered):
    registered(SignNoise)
    dataset = build_dataset("synthetic", split="test", limit=10)
    model = _tiny_model()
    configs = [AttackConfig("test-sign-noise", eps=e) for e in (2 / 255, 16 / 255)]
    run_attack(model, dataset, tmp_path / "full", configs=configs, num_classes=10, batch_size=4, progress=False,
               checks=False)
    full = load_records(tmp_path / "full")
    assert set(full["condition"]) == {CLEAN, *(c.name for c in configs)}
    # every record agrees with a direct recomputation
    with torch.no_grad():
        images = torch.stack([dataset[i][0] for i in range(10)])
        clean_pred = model(images).argmax(1).numpy()
    for name, group in full.groupby("condition"):
        group = group.sort_values("index")
        assert (group["clean_pred"].to_numpy() == clean_pred).all()
        assert ((group["pred"] == group["label"]).astype(int) == group["top1"]).all()
        assert ((group["pred"] != group["label"]).astype(int) == group["success"]).all()
        assert (group["margin"] > 0).eq(group["top1"].astype(bool)).all()
        eps = 0 if name == CLEAN else next(c.eps for c in configs if c.name == name)
        assert group["linf"].max() <= eps + 1e-6 and (group["queries"] == -1).all()
    # a run that lost a chunk and resumed equals the uninterrupted one
    run_attack(model, dataset, tmp_path / "part", configs=configs, num_classes=10, batch_size=4, progress=False,
               checks=False)
    RunStore(tmp_path / "part").chunk_path(configs[1].name, 4, 8).unlink()
    run_attack(model, dataset, tmp_path / "part", configs=configs, num_classes=10, batch_size=4, progress=False,
               checks=False)
    pd.testing.assert_frame_equal(load_records(tmp_path / "part"), full)
    summary = summarize_attack(full).set_index("condition")
    assert summary.loc[CLEAN, "robust_top1"] == pytest.approx(full[full.condition == CLEAN]["top1"].mean() * 100)
    assert summary.loc[CLEAN, "n_clean_correct"] == full[full.condition == CLEAN]["top1"].sum()


def test_each_attack_runs_its_largest_radius_first(tmp_path, registered, monkeypatch):
    """Cheap radii first (the module's Choices): groups keep their order, radii go down in each,
    and the records equal those of a run in the given order."""
    c = lambda attack, e, norm="linf": AttackConfig(attack, eps=e / 255, norm=norm)
    configs = [c("apgd-ce", 1), c("square", 8), c("apgd-ce", 4), c("apgd-ce", 64, "l2"), c("apgd-ce", 2),
               c("apgd-ce", 128, "l2")]
    names = [x.name for x in configs]
    assert computation_order(configs) == [CLEAN, names[2], names[4], names[0], names[1], names[5], names[3]]

    registered(SignNoise)
    dataset = build_dataset("synthetic", split="test", limit=6)
    configs = [AttackConfig("test-sign-noise", eps=e / 255) for e in (1, 2, 4)]
    written, write = [], RunStore.write_chunk

    def noted(self, cond, a, b, rec, **kw):
        written.append((cond, a))
        return write(self, cond, a, b, rec, **kw)

    monkeypatch.setattr(RunStore, "write_chunk", noted)
    run_attack(_tiny_model(), dataset, tmp_path / "run", configs=configs, num_classes=10, batch_size=3,
               progress=False, checks=False)
    order = [CLEAN] + [x.name for x in configs[::-1]]
    assert written == [(name, a) for a in (0, 3) for name in order]
    monkeypatch.setattr(RunStore, "write_chunk", write)
    monkeypatch.setattr(attack_protocol, "computation_order", lambda configs: [CLEAN] + [x.name for x in configs])
    run_attack(_tiny_model(), dataset, tmp_path / "given", configs=configs, num_classes=10, batch_size=3,
               progress=False, checks=False)
    pd.testing.assert_frame_equal(load_records(tmp_path / "run"), load_records(tmp_path / "given"))


def test_a_resumed_run_first_finishes_the_radius_a_killed_run_left_under_way(tmp_path, registered, monkeypatch):
    """A saved state within a chunk (AutoAttack's, after each member) puts its condition first,
    after clean, the most members done first: a killed run's nearly finished radius is not delayed
    behind a fresh one; the records are those of an uninterrupted run."""
    registered(SignNoise)
    dataset = build_dataset("synthetic", split="test", limit=6)
    configs = [AttackConfig("test-sign-noise", eps=e / 255) for e in (1, 2, 4)]
    names = [x.name for x in configs]
    state_dir = tmp_path / "run" / attack_protocol.STATE_DIR
    state_dir.mkdir(parents=True)
    torch.save({"done": 0}, state_dir / f"{names[2]}-000000000.pt")   # 4/255 begun
    assert resume_order(computation_order(configs), state_dir) == [CLEAN, names[2], names[1], names[0]]
    torch.save({"done": 1}, state_dir / f"{names[0]}-000000000.pt")   # 1/255 one member further
    torch.save({"done": 3}, state_dir / f"{names[0]}-000000003.pt")   # (three in its second chunk)
    torch.save({"done": 2}, state_dir / f"{names[1]}-000000003.pt")
    assert resume_order(computation_order(configs), state_dir) == [CLEAN, names[0], names[1], names[2]]
    (state_dir / f"{names[1]}-000000003.pt").write_bytes(b"half-written")   # unreadable: none done
    assert resume_order(computation_order(configs), state_dir) == [CLEAN, names[0], names[2], names[1]]
    assert resume_order(computation_order(configs), tmp_path / "none") == computation_order(configs)
    written, write = [], RunStore.write_chunk

    def noted(self, cond, a, b, rec, **kw):
        written.append((cond, a))
        return write(self, cond, a, b, rec, **kw)

    monkeypatch.setattr(RunStore, "write_chunk", noted)
    run_attack(_tiny_model(), dataset, tmp_path / "run", configs=configs, num_classes=10, batch_size=3,
               progress=False, checks=False)
    assert written == [(name, a) for a in (0, 3) for name in (CLEAN, names[0], names[2], names[1])]
    # (the test attack keeps no state: the files stay, as a killed AutoAttack's would until its chunk is written)
    monkeypatch.setattr(RunStore, "write_chunk", write)
    run_attack(_tiny_model(), dataset, tmp_path / "fresh", configs=configs, num_classes=10, batch_size=3,
               progress=False, checks=False)
    pd.testing.assert_frame_equal(load_records(tmp_path / "run"), load_records(tmp_path / "fresh"))


def test_targeted_attack_records_use_saved_targets(tmp_path, registered):
    registered(SignNoise)
    dataset = build_dataset("synthetic", split="test", limit=6)
    config = AttackConfig("test-sign-noise", eps=4 / 255, targeted=True)
    run_attack(_tiny_model(), dataset, tmp_path, configs=[config], num_classes=10, batch_size=3, progress=False,
               checks=False, seed=3)
    records = load_records(tmp_path)
    saved = pd.read_csv(tmp_path / "targets.csv")
    attacked = records[records.condition == config.name].sort_values("index")
    assert (attacked["target"].to_numpy() == saved["target"].to_numpy()).all()
    assert ((attacked["pred"] == attacked["target"]).astype(int) == attacked["success"]).all()
    assert (records[records.condition == CLEAN]["target"] == -1).all()


def test_transfer_from_the_model_itself_equals_the_white_box_attack(tmp_path, registered):
    registered(SignNoise)
    dataset = build_dataset("synthetic", split="test", limit=8)
    a, b = _tiny_model(seed=0), _tiny_model(seed=1)
    config = AttackConfig("test-sign-noise", eps=16 / 255)
    run_transfer("a", a, {"a": a, "b": b}, dataset, tmp_path / "t", configs=[config], batch_size=4, progress=False)
    run_attack(a, dataset, tmp_path / "w", configs=[config], num_classes=10, batch_size=4, progress=False,
               checks=False)
    transfer = load_records(tmp_path / "t")
    white = load_records(tmp_path / "w")
    self_transfer = transfer[transfer.condition == f"{config.name}.a"].sort_values("index")
    white_box = white[white.condition == config.name].sort_values("index")
    assert (self_transfer["pred"].to_numpy() == white_box["pred"].to_numpy()).all()
    assert (self_transfer["success"].to_numpy() == self_transfer["source_success"].to_numpy()).all()
    on_b = transfer[transfer.condition == f"{config.name}.b"].sort_values("index")
    with torch.no_grad():
        images = torch.stack([dataset[i][0] for i in range(8)])
    assert (on_b["clean_pred"].to_numpy() == b(images).argmax(1).numpy()).all()
    summary = summarize_transfer(transfer)
    assert set(summary["target_model"]) == {"a", "b"} and set(summary["source"]) == {"a"}


class Brighten(Attack):
    """Every pixel raised by eps (clipped): the same images whatever the model, seed or batch."""

    name = "test-brighten"
    norms = ("linf",)

    def _run(self, model, images, labels, targets):
        return AttackOutput((images + self.config.eps).clamp(0, 1))


def test_transfer_evaluates_each_target_on_the_images_crafted_on_the_source(tmp_path, registered):
    """A target's record holds that target's prediction on the source's adversarial images (and the
    source's own in ``source_success``): here the attack's images are known in advance."""
    registered(Brighten)
    dataset = build_dataset("synthetic", split="test", limit=8)
    a, b = _tiny_model(seed=0), _tiny_model(seed=1)
    config = AttackConfig("test-brighten", eps=32 / 255)
    run_transfer("a", a, {"a": a, "b": b}, dataset, tmp_path / "t", configs=[config], batch_size=4, progress=False)
    transfer = load_records(tmp_path / "t")
    images = torch.stack([dataset[i][0] for i in range(8)])
    labels = torch.tensor([int(dataset[i][1]) for i in range(8)])
    with torch.no_grad():
        adv = (images + 32 / 255).clamp(0, 1)
        on = {"a": a(adv).argmax(1), "b": b(adv).argmax(1)}
    assert not torch.equal(on["a"], on["b"])   # the two targets tell the source's predictions apart
    for target in ("a", "b"):
        records = transfer[transfer.condition == f"{config.name}.{target}"].sort_values("index")
        assert records["pred"].tolist() == on[target].tolist()
        assert records["source_success"].tolist() == (on["a"] != labels).long().tolist()


def test_transfer_resumes_with_its_targets_in_another_order(tmp_path, registered):
    """A study resumed with --models in another order asks for the same targets in another order:
    the run resumes as it is (nothing recomputed, same records); other targets are still refused."""
    from robust_attn.runs.store import RunMismatchError, RunStore

    registered(SignNoise)
    dataset = build_dataset("synthetic", split="test", limit=8)
    a, b, c = _tiny_model(seed=0), _tiny_model(seed=1), _tiny_model(seed=2)
    config = AttackConfig("test-sign-noise", eps=16 / 255)
    out = tmp_path / "t"
    info = {"model": "a", "target_models": ["a", "b"]}
    run_transfer("a", a, {"a": a, "b": b}, dataset, out, configs=[config], batch_size=4, progress=False,
                 run_info=info)
    before = load_records(out)
    written = {p: p.stat().st_mtime_ns for p in (out / "records").rglob("*.csv")}
    run_transfer("a", a, {"b": b, "a": a}, dataset, out, configs=[config], batch_size=4, progress=False,
                 run_info={**info, "target_models": ["b", "a"]})
    assert {p: p.stat().st_mtime_ns for p in (out / "records").rglob("*.csv")} == written
    pd.testing.assert_frame_equal(load_records(out), before)
    assert RunStore(out).description()["parameters"]["target_models"] == ["a", "b"]
    with pytest.raises(RunMismatchError, match="target_models"):
        run_transfer("a", a, {"a": a, "c": c}, dataset, out, configs=[config], batch_size=4, progress=False,
                     run_info={**info, "target_models": ["a", "c"]})


def test_transfer_refuses_a_target_with_other_classes(tmp_path, registered):
    registered(SignNoise)
    dataset = build_dataset("synthetic", split="test", limit=2)
    with pytest.raises(ValueError, match="source a has 10 classes but target.*b has 7"):
        run_transfer("a", _tiny_model(), {"b": _tiny_model(num_classes=7)}, dataset, tmp_path,
                     configs=[AttackConfig("test-sign-noise")], progress=False)


def test_ensemble_is_the_mean_of_logits():
    a, b = _tiny_model(seed=0), _tiny_model(seed=1)
    x = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(EnsembleModel([a, b])(x), (a(x) + b(x)) / 2)


@pytest.mark.parametrize("argv,message", [
    (["--attack", "apgd-xx"], "unknown attack 'apgd-xx'"),
    (["--attack", "autoattack", "--targeted"], "no targeted mode"),
    (["--attack", "pgd", "--eps", "8"], "write 8/255"),
    (["--attack", "pgd", "--eps=-1/255"], "eps must be >= 0"),
    (["--attack", "pgd", "--eps", "x"], "not a number"),
])
def test_attack_cli_bad_input_is_a_clear_error(argv, message, capsys, tmp_path):
    assert main(["eval", "attack", *TINY, "--limit", "2", *argv, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_l2_eps_in_255_units_warns():
    with pytest.warns(UserWarning, match="did you divide by 255"):
        AttackConfig("pgd", norm="l2", eps=0.5 / 255)


def test_transfer_cli_names_the_class_mismatch(tmp_path, capsys):
    from robust_attn.models.checkpoint import save_checkpoint

    for name, classes in (("ten", 10), ("seven", 7)):
        net = create_model("resnet26", num_classes=classes, resolution="cifar", width=0.25, stem_downsample=4)
        save_checkpoint(tmp_path / f"{name}.safetensors", NormalizedModel(net, [0.5] * 3, [0.25] * 3))
    assert main(["eval", "transfer", "--dataset", "synthetic", "--limit", "2", "--no-progress",
                 "--source", str(tmp_path / "ten.safetensors"), "--target", str(tmp_path / "seven.safetensors"),
                 "--out", str(tmp_path / "o")]) == 2
    assert "7 classes" in capsys.readouterr().err


needs_pgd = pytest.mark.skipif("pgd" not in list_attacks(), reason="the 'pgd' attack is not registered")


@needs_pgd
def test_attack_cli_runs_pgd_and_writes_records(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["eval", "attack", *TINY, "--limit", "4", "--batch-size", "2", "--attack", "pgd",
                 "--eps", "1/255,8/255", "--steps", "3", "--no-checks", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "pgd_linf_eps1_n3: robust top-1" in printed and "pgd_linf_eps8_n3" in printed
    records = load_records(out)
    assert set(records["condition"]) == {CLEAN, "pgd_linf_eps1_n3", "pgd_linf_eps8_n3"}
    run = json.loads((out / "run.json").read_text())
    assert run["protocol"] == "attack" and run["conditions"][1]["eps"] == pytest.approx(1 / 255)




@pytest.mark.slow
@needs_pgd
def test_attack_two_gloo_ranks_equal_one_process(tmp_path):
    args = ["eval", "attack", *TINY, "--limit", "6", "--batch-size", "2", "--device", "cpu", "--attack", "pgd",
            "--eps", "4/255", "--steps", "2", "--restarts", "2", "--no-checks"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "robust_attn.cli", *args, "--out", str(tmp_path / "ddp")]
    result = subprocess.run(cmd, env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert main([*args, "--out", str(tmp_path / "single")]) == 0
    pd.testing.assert_frame_equal(load_records(tmp_path / "ddp"), load_records(tmp_path / "single"))


def test_a_model_with_nan_logits_is_refused():
    class Broken(nn.Module):
        def forward(self, x):
            return torch.full((x.shape[0], 10), float("nan"))

    with pytest.raises(ValueError, match="NaN or inf logits"):
        make_attack(AttackConfig("pgd", steps=2)).run(
            Broken().eval(), torch.rand(2, 3, 8, 8), torch.tensor([0, 1]))


class BatchDependent(nn.Module):
    """A linear model whose logits move by 1e-3 with the batch size, as float rounding does on a
    borderline image: at batch 1 image 0 is misclassified, in a batch of two it is not."""

    def forward(self, x):
        z = torch.stack([x.flatten(1).mean(1), torch.full((len(x),), 0.5)], 1)
        return z + torch.tensor([0.0, 1e-3]) * (len(x) == 1)


def test_autoattack_judges_each_member_in_the_whole_batch_as_the_records_are():
    """A member that fools an image only in a sub-batch has not fooled it in the chunk's records:
    the ensemble checks in the whole batch, so ``by`` and the final prediction agree, and the
    image stays in play for the next member."""
    images = torch.full((2, 1, 2, 2), 0.5005)   # class 0 by a margin of 5e-4: flipped at batch 1 only
    images[1] = 0.1                             # misclassified anyway (class 1): not attacked
    labels = torch.tensor([0, 0])
    model = BatchDependent().eval()
    out = make_attack(AttackConfig("autoattack", eps=1e-6, steps=1, queries=2,
                                   options={"attacks": ["apgd-ce"]})).run(model, images, labels)
    with torch.no_grad():
        final = model(out.adv).argmax(1)
    assert out.by == ["", "clean"] and final.tolist() == [0, 1]


def test_a_state_saved_with_a_member_judged_in_a_sub_batch_is_judged_again_on_resume(tmp_path):
    """States written before members were judged in the whole batch may mark an image fooled that
    the chunk's batch classifies correctly; resuming one puts such an image back in play."""
    images = torch.full((2, 1, 2, 2), 0.5005)
    images[1] = 0.1
    labels = torch.tensor([0, 0])
    model = BatchDependent().eval()
    config = AttackConfig("autoattack", eps=1e-6, steps=1, queries=2, options={"attacks": ["apgd-ce", "square"]})
    aa = make_attack(config)
    aa.state_path = tmp_path / "state.pt"
    # what the old check saved after APGD-CE: image 0 "fooled" (it is, at batch 1), with progress of
    # Square over the images then in play (none): it no longer fits and must not be used
    aa._save_state(aa._state_key(images, labels), 1, images.clone(), torch.tensor([False, False]),
                   ["apgd-ce", "clean"], torch.zeros(2, dtype=torch.long),
                   member={"attack": "square", "device": "cpu", "note": "stale"})
    out = aa.run(model, images, labels)
    with torch.no_grad():
        final = model(out.adv).argmax(1)
    assert out.by == ["", "clean"] and final.tolist() == [0, 1]


class _Linear(nn.Module):
    """Class 0 by the image's mean, class 1 by 0.5: an image of 0.5005 is class 0 by 5e-4."""

    def forward(self, x):
        return torch.stack([x.flatten(1).mean(1), torch.full((len(x),), 0.5)], 1)


def test_an_image_put_back_in_play_on_resume_faces_the_finished_members_again(tmp_path):
    """A state written elsewhere (another device's rounding) marks image 0 fooled by APGD-CE, but
    its saved adversarial image is classified correctly here: on resume the image is back in play
    and APGD-CE runs again on it (it fools it: eps 0.01 moves the mean by far more than 5e-4),
    before the members after it. Without that it would face Square alone, whose single query
    here does not fool it."""
    images = torch.full((2, 1, 2, 2), 0.5005)
    images[1] = 0.1
    labels = torch.tensor([0, 0])
    config = AttackConfig("autoattack", eps=0.01, steps=5, queries=1, options={"attacks": ["apgd-ce", "square"]})
    aa = make_attack(config)
    aa.state_path = tmp_path / "state.pt"
    lines = []
    aa.log = lines.append
    aa._save_state(aa._state_key(images, labels), 1, images.clone(), torch.tensor([False, False]),
                   ["apgd-ce", "clean"], torch.zeros(2, dtype=torch.long))
    out = aa.run(_Linear().eval(), images, labels)
    assert out.by == ["apgd-ce", "clean"]
    assert (_Linear()(out.adv).argmax(1) == 1).all()
    assert any("apgd-ce again on the 1 images put back in play: fooled 1" in line for line in lines)
    # the same state without APGD-CE's second chance: Square alone (one query) leaves image 0 robust
    sq = make_attack(AttackConfig("autoattack", eps=0.01, queries=1, options={"attacks": ["square"]}))
    assert sq.run(_Linear().eval(), images, labels).by == ["", "clean"]


@pytest.mark.parametrize("eps,kept", [(0.01, True), (1e-6, False)])
def test_a_members_progress_survives_images_put_back_in_play_when_they_are_fooled_again(tmp_path, monkeypatch,
                                                                                         eps, kept):
    """Image 0 comes back in play on resume (as in the test above). When APGD-CE fools it again
    (eps 0.01), Square faces the very images its saved progress was made on and goes on from it;
    when it does not (eps 1e-6), the progress was made on other images and Square starts again."""
    import robust_attn.attacks.autoattack as autoattack

    given = []

    class Recording(autoattack.Progress):
        def __init__(self, state, *args, **kwargs):
            given.append(state)
            super().__init__(None, *args, **kwargs)   # Square itself starts afresh: only the hand-over is tested
    monkeypatch.setattr(autoattack, "Progress", Recording)
    images = torch.full((3, 1, 2, 2), 0.5005)
    images[1], images[2] = 0.1, 0.9   # misclassified; robust at either eps (class 0 by 0.4)
    labels = torch.tensor([0, 0, 0])
    config = AttackConfig("autoattack", eps=eps, steps=5, queries=1, options={"attacks": ["apgd-ce", "square"]})
    aa = make_attack(config)
    aa.state_path = tmp_path / "state.pt"
    lines = []
    aa.log = lines.append
    member = {"attack": "square", "device": "cpu", "note": "query 3 of 5"}
    aa._save_state(aa._state_key(images, labels), 1, images.clone(), torch.tensor([False, False, True]),
                   ["apgd-ce", "clean", ""], torch.zeros(3, dtype=torch.long), member=member)
    out = aa.run(_Linear().eval(), images, labels)
    assert given == [member if kept else None]
    assert out.by == (["apgd-ce", "clean", ""] if kept else ["", "clean", ""])
    assert any("still robust; its saved progress was on other images" in line for line in lines) != kept



def test_transfer_matrix_keeps_two_checkpoints_of_one_source_apart(tmp_path, registered):
    """Two transfer runs from sources of one name with different weights are two rows of the
    matrix, each its own records' mean, not one row averaging both."""
    from robust_attn.reports.attacks import transfer_matrix
    from robust_attn.reports.runs import load_runs

    registered(SignNoise)
    dataset = build_dataset("synthetic", split="test", limit=8)
    target = _tiny_model(seed=5)
    dirs = []
    for seed, sha in ((0, "a" * 64), (1, "b" * 64)):
        info = {"model": "a", "dataset": {"name": "synthetic", "split": "test", "limit": 8},
                "checkpoint": {"path": f"{seed}.safetensors", "sha256": sha}, "target_models": ["t"]}
        dirs.append(run_transfer("a", _tiny_model(seed=seed), {"t": target}, dataset, tmp_path / str(seed),
                                 configs=[AttackConfig("test-sign-noise", eps=64 / 255)], batch_size=4,
                                 progress=False, run_info=info).root)
    matrix = transfer_matrix(load_runs(dirs))
    assert sorted(matrix.index) == ["a (ckpt aaaaaaaa)", "a (ckpt bbbbbbbb)"]
    for label, path in zip(("a (ckpt aaaaaaaa)", "a (ckpt bbbbbbbb)"), dirs):
        records = load_records(path)
        crafted = records[records["condition"].str.startswith("test-sign-noise")]
        assert matrix.loc[label, "t"] == pytest.approx(crafted["top1"].mean() * 100)
