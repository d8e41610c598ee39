"""APGD, FAB, Square and the AutoAttack ensemble on the attack-time copy
(:func:`robust_attn.attacks.fast_model.attack_copy`: batch norm folded, channels-last input), the
computation native PGD uses: the same function as the model, so the same images fooled, on a tiny
model of every zoo family; which model the attacks queried is recorded in run.json."""
import json

import pytest
import torch
import torch.nn as nn

import robust_attn
from robust_attn.attacks.base import Attack, AttackConfig, make_attack
from robust_attn.attacks.fast_model import ChannelsLastInput, attack_copy, resolve_attack_copy
from robust_attn.data import build_dataset
from robust_attn.models.wrapper import NormalizedModel
from robust_attn.protocols.attack import run_attack
from robust_attn.runs.store import VOLATILE_KEYS, RunStore, load_records
from test_attack_step_paths import FAMILIES

#: the members of AutoAttack, at budgets a tiny model attacks in a second and radii at which they
#: fool some of the images below and not others
MEMBERS = (AttackConfig("apgd-ce", eps=0.25 / 255, steps=5),
           AttackConfig("apgd-t", eps=0.25 / 255, steps=3, options={"n_target_classes": 2}),
           AttackConfig("fab-t", eps=1 / 255, steps=5, options={"n_target_classes": 2}),
           AttackConfig("square", eps=2 / 255, queries=30))


def _images(n: int, seed: int = 4) -> torch.Tensor:
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


class _Standardized(nn.Module):
    """Logits standardized per class over reference images: an untrained network's logits are
    nearly the same for every image; standardized, its prediction depends on the image."""

    def __init__(self, model: nn.Module, reference: torch.Tensor):
        super().__init__()
        self.model = model
        with torch.no_grad():
            logits = model(reference)
        self.register_buffer("mean", logits.mean(0))
        self.register_buffer("std", logits.std(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.model(x) - self.mean) / self.std


def _model(name: str) -> nn.Module:
    """A tiny float32 model of ``name`` in eval mode, batch norms with non-trivial statistics and
    affines (so folding changes the convolutions), its predictions varying between images."""
    torch.manual_seed(0)
    net = robust_attn.create_model(name, 10, "cifar", width=0.25, stem_downsample=2)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 1.0)
                m.weight.copy_(torch.rand(m.num_features, generator=gen) * 0.3 + 0.6)
                m.bias.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
    model = NormalizedModel(net, [0.49, 0.48, 0.45], [0.25, 0.24, 0.26]).eval()
    return _Standardized(model, _images(32, seed=5)).eval()


@pytest.mark.parametrize("name", FAMILIES)
def test_the_attack_copy_gives_the_models_logits(name):
    model = _model(name)
    x = _images(8)
    copy = attack_copy(model, x[:4])
    assert isinstance(copy, ChannelsLastInput) and copy is not model   # batch norm folded in every family
    with torch.no_grad():
        want, got = model(x), copy(x)
    assert len(set(want.argmax(1).tolist())) > 2   # predictions vary between images
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_member_fools_the_same_images_on_the_copy(name):
    """Each member run on the copy and on the model as given, from the same seed, in float32:
    the same images fooled (judged on the model) and nearly all pixels of the adversarial images
    the same; over the members, some images fooled and some not. An image may differ only as a
    float tie: where the model's top-2 margin at one of its two adversarial images is below 2e-4,
    the bound on the copy's logit error above (FAB returns points just past the nearest boundary,
    so on an image that starts near one its result can be such a tie); at most one per member."""
    model = _model(name)
    x = _images(6)
    with torch.no_grad():
        labels = model(x).argmax(1)
    outcomes = set()
    for config in MEMBERS:
        runs = {}
        for mode in ("on", "off"):
            attack = make_attack(config)
            attack.attack_copy = mode
            runs[mode] = attack.run(model, x, labels).adv
        with torch.no_grad():
            logits = {mode: model(adv) for mode, adv in runs.items()}
        fooled = {mode: out.argmax(1) != labels for mode, out in logits.items()}
        tie = torch.zeros(len(x), dtype=torch.bool)
        for out in logits.values():
            top2 = out.topk(2, 1).values
            tie |= top2[:, 0] - top2[:, 1] < 2e-4
        assert torch.equal(fooled["on"][~tie], fooled["off"][~tie]) and tie.sum() <= 1, config.attack
        assert ((runs["on"] - runs["off"]).abs() <= 1e-5).double().mean() >= 0.99, config.attack
        outcomes |= set(fooled["on"][~tie].tolist())
    assert outcomes == {True, False}


def test_the_setting_picks_the_model_the_attack_queries():
    model = _model("resnet26")
    x = _images(4)
    attack = make_attack(MEMBERS[0])
    assert attack.attack_copy == "auto" and resolve_attack_copy("auto", "cpu")
    assert not resolve_attack_copy("auto", "cuda") and resolve_attack_copy("on", "cuda")
    assert isinstance(attack.attacked_model(model, x), ChannelsLastInput)
    attack.attack_copy = "off"
    assert attack.attacked_model(model, x) is model
    plain = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10)).eval()
    attack.attack_copy = "on"
    assert attack.attacked_model(plain, x) is plain   # nothing folds: the model itself
    untraceable = torch.nn.Module()
    untraceable.forward = model   # a forward fx cannot see (set on the instance)
    assert attack.attacked_model(untraceable.eval(), x) is untraceable
    with pytest.raises(ValueError, match="auto, on, off"):
        resolve_attack_copy("yes", "cpu")


def test_autoattack_judges_on_the_model_and_its_members_query_the_copy(monkeypatch):
    seen = []
    original = Attack.attacked_model

    def spy(self, model, images):
        out = original(self, model, images)
        seen.append((self.name, type(out).__name__))
        return out

    monkeypatch.setattr(Attack, "attacked_model", spy)
    model = _model("resnet26")
    x = _images(4)
    with torch.no_grad():
        labels = model(x).argmax(1)
    ensemble = make_attack(AttackConfig("autoattack", eps=1 / 255, steps=2, queries=5,
                                        options={"attacks": ["apgd-ce", "square"]}))
    assert ensemble.attacked_model(model, x) is model   # the ensemble's own forwards: the model as given
    ensemble.run(model, x, labels)
    assert set(seen) == {("apgd-ce", "ChannelsLastInput"), ("square", "ChannelsLastInput")}
    seen.clear()
    ensemble.attack_copy = "off"
    ensemble.run(model, x, labels)
    assert {kind for _, kind in seen} == {"_Standardized"}   # the model as given


def test_run_json_records_the_attacked_model_and_a_run_resumes_on_the_other(tmp_path):
    data = build_dataset("synthetic", split="test", limit=4)
    model = _model("resnet26")
    configs = [AttackConfig("apgd-ce", eps=2 / 255, steps=2)]
    run = tmp_path / "run"
    run_attack(model, data, run, configs=configs, num_classes=10, batch_size=2, checks=False, progress=False,
               attack_copy="off")
    assert json.loads((run / "run.json").read_text())["attack_copy"] == "off: the model as given"
    assert "attack_copy" in VOLATILE_KEYS
    RunStore(run).chunk_path(configs[0].name, 2, 4).unlink()
    run_attack(model, data, run, configs=configs, num_classes=10, batch_size=2, checks=False, progress=False)
    assert len(load_records(run)) == 8   # resumed on the copy (the default on a CPU): no mismatch
    other = tmp_path / "other"
    run_attack(model, data, other, configs=configs, num_classes=10, batch_size=2, checks=False, progress=False)
    assert json.loads((other / "run.json").read_text())["attack_copy"].startswith("auto: the attack copy")
