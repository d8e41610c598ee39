"""Adversarial training (robust_attn.train.adversarial): each method's examples against a reference
written here, the mode of the model while they are made, the eps warm-up, the overfitting guard
on a constructed collapse, resume, metadata, and the validation of the [adversarial] table."""
from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

from robust_attn.data import build_dataset
from robust_attn.models.checkpoint import read_sidecar
from robust_attn.train import RecipeError, build_model, recipe_from_dict, train
from robust_attn.train import adversarial as adv
from robust_attn.train.recipe import AdversarialConfig

from test_train import quiet, tiny_recipe

EPS = 8 / 255
NULL = contextlib.nullcontext


def _tiny_batch(seed=0, n=6):
    torch.manual_seed(seed)
    recipe = recipe_from_dict(tiny_recipe(), check_data=False)
    net = build_model(recipe)
    images = torch.rand(n, 3, 32, 32)
    labels = torch.randint(0, 10, (n,))
    return net, images, labels


def _modes_seen(net):
    """Record net.training at every forward call of its first batch-norm layer."""
    seen = []
    bn = next(m for m in net.modules() if isinstance(m, nn.BatchNorm2d))
    bn.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    return seen


def _linf(a, b):
    return (a - b).abs().amax().item()


def test_fgsm_is_one_step_from_a_uniform_start_in_train_mode():
    """Wong et al. 2020, Algorithm 3: delta ~ U(-eps, eps); delta += 1.25 eps sign(grad); project."""
    net, images, labels = _tiny_batch()
    cfg = AdversarialConfig(method="fgsm", eps=EPS)
    reference_net = copy.deepcopy(net).train()
    seen = _modes_seen(net)
    out = adv.adversarial_examples(cfg, net, images, labels, EPS, seed=11, autocast=NULL)
    assert seen == [True] and net.training  # one forward, in train mode
    # the reference, by hand: the same generator draws the same start
    gen = torch.Generator().manual_seed(11)
    start = (images + (torch.rand(images.shape, generator=gen) * 2 - 1) * EPS).clamp(0, 1).requires_grad_(True)
    loss = F.cross_entropy(reference_net(start), labels, reduction="sum")
    (grad,) = torch.autograd.grad(loss, start)
    expected = (images + (start.detach() + 1.25 * EPS * grad.sign() - images).clamp(-EPS, EPS)).clamp(0, 1)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert _linf(out, images) <= EPS + 1e-6 and out.min() >= 0 and out.max() <= 1
    assert _linf(out, images) > 0.9 * EPS  # it used its budget


def test_pgd_makes_steps_in_train_mode_within_the_ball_and_raises_the_loss():
    net, images, labels = _tiny_batch(1)
    cfg = AdversarialConfig(method="pgd", eps=EPS, steps=5)
    seen = _modes_seen(net)
    out = adv.adversarial_examples(cfg, net, images, labels, EPS, seed=3, autocast=NULL)
    assert seen == [True] * 5  # one forward per step, train mode, no extra evaluation
    assert _linf(out, images) <= EPS + 1e-6 and _linf(out, images) > 0.9 * EPS
    net.eval()
    with torch.no_grad():
        assert F.cross_entropy(net(out), labels) > F.cross_entropy(net(images), labels)
    # the loss of a step is the cross-entropy at those examples (train mode: batch statistics)
    criterion = nn.CrossEntropyLoss()
    twin = copy.deepcopy(net)
    loss = adv.adversarial_loss(cfg, net, net, criterion, images, labels, EPS, 3, NULL)
    again = adv.adversarial_examples(cfg, twin, images, labels, EPS, 3, NULL)
    assert torch.allclose(loss, criterion(twin.train()(again), labels), atol=1e-6)


def test_trades_attacks_the_kl_in_eval_mode_and_adds_it_to_the_clean_loss():
    net, images, labels = _tiny_batch(2)
    cfg = AdversarialConfig(method="trades", eps=EPS, steps=4, trades_beta=6.0)
    twin = copy.deepcopy(net)
    seen = _modes_seen(net)
    out = adv.adversarial_examples(cfg, net, images, labels, EPS, seed=5, autocast=NULL)
    assert seen == [False] * 5 and net.training  # the clean reference and 4 steps in eval mode
    assert _linf(out, images) <= EPS + 1e-6
    twin.eval()
    with torch.no_grad():
        p = F.softmax(twin(images), 1)
        kl = F.kl_div(F.log_softmax(twin(out), 1), p, reduction="batchmean")
        start = F.kl_div(F.log_softmax(twin((images + 0.001 * torch.randn(images.shape)).clamp(0, 1)), 1), p,
                         reduction="batchmean")
    assert kl > 10 * start  # the inner maximization moved far from TRADES's tiny start
    # the loss: CE(f(x), y) + beta KL(f(x) || f(x')), both in train mode
    criterion = nn.CrossEntropyLoss()
    fresh = copy.deepcopy(twin).train()
    loss = adv.adversarial_loss(cfg, fresh, fresh, criterion, images, labels, EPS, 5, NULL)
    ref_net = copy.deepcopy(twin).train()
    x_adv = adv.adversarial_examples(cfg, ref_net, images, labels, EPS, 5, NULL)
    logits = ref_net(images)
    expected = criterion(logits, labels) + 6.0 * F.kl_div(F.log_softmax(ref_net(x_adv), 1), F.softmax(logits, 1),
                                                          reduction="batchmean")
    assert torch.allclose(loss, expected, atol=1e-5)


def test_trades_starts_from_the_image_plus_a_thousandth_of_gaussian_noise():
    """TRADES's inner maximization starts at ``x + 0.001 N(0, 1)`` (Zhang et al. 2019, their code): at
    ``x`` itself the KL and its gradient are zero, and the steps would move on float rounding alone."""
    from robust_attn.attacks.base import AttackConfig

    attack = adv._TradesPGD(AttackConfig("pgd", norm="linf", eps=EPS, steps=1, step=EPS / 4, seed=0,
                                         options={"random_start": True, "keep": "last"}))
    images = torch.full((4, 3, 16, 16), 0.5)
    offset = attack._random_start(images, torch.Generator().manual_seed(3)) - images
    assert offset.std().item() == pytest.approx(0.001, rel=0.05) and abs(offset.mean().item()) < 1e-4


def test_eps_warm_up_and_step_sizes():
    cfg = AdversarialConfig(method="pgd", eps=EPS, eps_warmup_epochs=2)
    assert [adv.eps_at(cfg, s, 5) for s in (0, 4, 9, 10, 50)] == pytest.approx([EPS / 10, EPS / 2, EPS, EPS, EPS])
    assert adv.attack_step_size(cfg, EPS) == pytest.approx(2 / 255) and adv.attack_steps(cfg) == 10
    fgsm = AdversarialConfig(method="fgsm", eps=EPS)
    assert adv.attack_step_size(fgsm, EPS) == pytest.approx(10 / 255) and adv.attack_steps(fgsm) == 1
    fixed = AdversarialConfig(method="pgd", eps=EPS, step=1 / 255)
    assert adv.attack_step_size(fixed, EPS / 2) == pytest.approx(0.5 / 255)  # scales with the ramp


def test_guard_state_keeps_the_best_and_detects_a_collapse():
    guard = adv.GuardState(collapse=0.5, floor=10.0)
    assert guard.record(5.0) == (True, False)
    assert guard.record(2.0) == (False, False)  # below chance: nothing to collapse from
    assert guard.record(40.0) == (True, False)
    assert guard.record(30.0) == (False, False)
    assert guard.record(12.0) == (False, True) and guard.best_epoch == 3


def _adv_recipe(**adversarial):
    cfg = {"method": "pgd", "eps": "8/255", "steps": 2, "guard_images": 8, "guard_steps": 2,
           "eps_warmup_epochs": 1, **adversarial}
    return recipe_from_dict(tiny_recipe(epochs=3, data={"limit_train": 24}, adversarial=cfg))


def test_guard_stops_at_a_constructed_collapse_and_keeps_the_best_epoch(tmp_path, monkeypatch):
    """The guard's accuracies are forced to 30, 50, 5 (%): training stops after epoch 3 and the
    final model is epoch 2's, which is what an uninterrupted run has after 2 epochs."""
    recipe = _adv_recipe()
    forced = iter([30.0, 50.0, 5.0])

    def fake_counts(model, loader, eps, steps, seed, device, autocast):
        n = sum(len(y) for _, y in loader)
        return torch.tensor([next(forced) * n / 100, n], dtype=torch.float64)

    monkeypatch.setattr(adv, "guard_counts", fake_counts)
    result = train(recipe, tmp_path / "run", progress=False, log=quiet)
    assert [r["guard_pgd_top1"] for r in result["history"]] == pytest.approx([30, 50, 5])
    meta = read_sidecar(result["weights"])
    assert meta["epoch"] == 2 and meta["stopped_early"] is True and "guard" in meta["selected_by"]
    final = load_file(result["weights"])
    best = load_file(tmp_path / "run" / "checkpoints" / "best" / "model.safetensors")
    assert all(torch.equal(final[k], best[k]) for k in final)
    forced = iter([30.0, 50.0])
    two = train(recipe, tmp_path / "two", progress=False, log=quiet, stop_after=2)
    assert two["weights"] is None
    epoch2 = load_file(tmp_path / "two" / "checkpoints" / "epoch_0002" / "model.safetensors")
    assert all(torch.equal(final[k], epoch2[k]) for k in final)
    # a resume of the stopped run stays stopped
    again = train(recipe, tmp_path / "run", resume=True, progress=False, log=quiet)
    assert len(again["history"]) == 3 and read_sidecar(again["weights"])["epoch"] == 2


def test_the_guard_images_are_held_out_of_training(tmp_path, monkeypatch):
    """The guard's slice (Rice et al. 2020's held-out images) is never trained on: the images the
    training steps see and those the guard attacks are disjoint and together are the training set."""
    recipe = recipe_from_dict(tiny_recipe(epochs=1, data={"limit_train": 24, "augment": False}, adversarial={
        "method": "fgsm", "eps": "8/255", "guard_images": 8, "guard_steps": 1}))
    trained, guarded = set(), set()
    real_loss = adv.adversarial_loss

    def key(image):
        return image.float().contiguous().numpy().tobytes()

    def spy_loss(cfg, model, net, criterion, images, labels, *args, **kwargs):
        trained.update(key(x) for x in images)
        return real_loss(cfg, model, net, criterion, images, labels, *args, **kwargs)

    def spy_counts(model, loader, eps, steps, seed, device, autocast):
        n = 0
        for images, labels in loader:
            guarded.update(key(x) for x in images)
            n += len(labels)
        return torch.tensor([n / 2, n], dtype=torch.float64)

    monkeypatch.setattr(adv, "adversarial_loss", spy_loss)
    monkeypatch.setattr(adv, "guard_counts", spy_counts)
    train(recipe, tmp_path / "run", progress=False, log=quiet)
    everything = {key(x) for x, _ in build_dataset("synthetic", None, "train", augment=False, limit=24)}
    assert len(everything) == 24
    assert len(guarded) == 8 and len(trained) == 16
    assert not trained & guarded
    assert trained | guarded == everything


@pytest.mark.parametrize("method", ["fgsm", "trades"])
def test_resumed_adversarial_training_equals_an_uninterrupted_one(tmp_path, method):
    recipe = _adv_recipe(method=method, steps=1 if method == "fgsm" else 2)
    full = train(recipe, tmp_path / "full", progress=False, log=quiet)
    train(recipe, tmp_path / "split", progress=False, log=quiet, stop_after=1)
    second = train(recipe, tmp_path / "split", resume=True, progress=False, log=quiet)
    a, b = load_file(full["weights"]), load_file(second["weights"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    keep = ("train_loss", "eval_top1", "guard_pgd_top1", "eps")
    assert [{k: r[k] for k in keep} for r in full["history"]] == [{k: r[k] for k in keep} for r in second["history"]]
    assert all(math.isfinite(r["guard_pgd_top1"]) for r in full["history"])
    meta = read_sidecar(second["weights"])
    assert meta["adversarial"]["method"] == method and meta["adversarial"]["eps_255"] == pytest.approx(8.0)
    assert meta["adversarial"]["steps"] == (1 if method == "fgsm" else 2)
    assert "adversarial" in meta["recipe"]


def test_standard_training_records_no_adversarial_section(tmp_path):
    recipe = recipe_from_dict(tiny_recipe(epochs=1, data={"limit_train": 8}))
    assert "adversarial" not in recipe.to_dict()
    meta = read_sidecar(train(recipe, tmp_path, progress=False, log=quiet)["weights"])
    assert "adversarial" not in meta and "selected_by" not in meta


@pytest.mark.parametrize("section,message", [
    ({"method": "mart"}, "choose one of"),
    ({"eps": 8}, "eps must be in \\(0, 1\\] image units.*\"8/255\""),
    ({"eps": "8/0"}, "a fraction such as"),
    ({"method": "fgsm", "steps": 3}, "takes one step"),
    ({"steps": 0}, "steps must be at least 1"),
    ({"step": 0.5}, "step must be in \\(0, 2 eps\\]"),
    ({"eps": "8/255", "step": "17/255"}, "step must be in \\(0, 2 eps\\]"),   # just past 2 eps
    ({"eps_warmup_epochs": 9}, "eps_warmup_epochs must be in"),
    ({"trades_beta": -1}, "trades_beta must be positive"),
    ({"guard_collapse": 1.5}, "guard_collapse"),
    ({"guard_collapse": 1}, "guard_collapse"),   # 1 would stop at the first epoch below the best
    ({"epsilon": 0.03}, "Did you mean 'eps'"),
    ({"method": "none", "eps": 0.1}, "method = \"none\""),
])
def test_a_bad_adversarial_section_is_a_clear_error(section, message):
    raw = tiny_recipe(epochs=3, adversarial={"method": "pgd", **section})
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(raw, check_data=False)


def test_an_adversarial_section_at_its_limits_loads():
    raw = tiny_recipe(epochs=3, adversarial={"method": "pgd", "eps": "8/255", "step": "16/255",
                                             "eps_warmup_epochs": 3, "guard_collapse": 0.99})
    a = recipe_from_dict(raw, check_data=False).adversarial
    assert (a.step, a.eps_warmup_epochs, a.guard_collapse) == (pytest.approx(16 / 255), 3, 0.99)


def test_adversarial_recipe_loads():
    from pathlib import Path

    from robust_attn.train import load_recipe

    path = Path(__file__).resolve().parents[1] / "zoo" / "recipes" / "cifar10_adversarial.toml"
    recipe = load_recipe(path, check_data=False)
    a = recipe.adversarial
    assert a.method in ("fgsm", "pgd", "trades") and a.eps == pytest.approx(8 / 255)


def test_trades_under_torchrun_and_fgsm_under_bf16(tmp_path):
    """DDP (two processes, gloo): TRADES's two forward passes per step and the guard's all-reduce;
    bf16 autocast: FGSM training runs and stays finite."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_train import _write_recipe

    repo = Path(__file__).resolve().parents[1]
    raw = tiny_recipe(epochs=1, data={"limit_train": 24, "limit_eval": 10},
                      adversarial={"method": "trades", "eps": "8/255", "steps": 2, "guard_images": 8,
                                   "guard_steps": 2})
    path = _write_recipe(tmp_path / "r.toml", raw)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "robust_attn.cli", "train", str(path), "--out", str(tmp_path / "ddp"),
                           "--no-progress"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    meta = read_sidecar(tmp_path / "ddp" / "model.safetensors")
    assert meta["world_size"] == 2 and meta["adversarial"]["method"] == "trades"
    assert math.isfinite(meta["metrics"]["train_loss"]) and math.isfinite(meta["metrics"]["guard_pgd_top1"])

    bf16 = recipe_from_dict(tiny_recipe(epochs=1, data={"limit_train": 16}, runtime={"amp": "bf16"},
                                        adversarial={"method": "fgsm", "guard_images": 4, "guard_steps": 1}))
    (row,) = train(bf16, tmp_path / "bf16", progress=False, log=quiet)["history"]
    assert math.isfinite(row["train_loss"]) and 0 <= row["guard_pgd_top1"] <= 100
