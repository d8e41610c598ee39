"""The sample-efficiency settings of the recipe: the linear schedule, the bias learning-rate scale,
the weight average (evaluated, saved and resumed) and the translation / alternating-flip
augmentation."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from robust_attn.models.checkpoint import read_sidecar
from robust_attn.data import SeededAugment
from robust_attn.data.base import TensorImageDataset
from robust_attn.data.transforms import RandomCropFlip
from robust_attn.train import RecipeError, recipe_from_dict, train
from robust_attn.train.ema import WeightAverage
from robust_attn.train.optim import build_optimizer, build_scheduler, lr_factor
from robust_attn.train.trainer import _set_translate_flip

from test_train import quiet, tiny_recipe


def test_linear_schedule_warms_up_then_falls_on_a_straight_line_to_the_floor():
    total, warm = 20, 4
    got = [lr_factor(s, total, warm, "linear") for s in range(total + 1)]
    assert got[:4] == [0.25, 0.5, 0.75, 1.0]
    for s in range(warm, total + 1):
        assert got[s] == pytest.approx(1.0 - (s - warm) / (total - warm), abs=1e-12)
    assert lr_factor(12, total, warm, "linear", min_factor=0.2) == pytest.approx(0.2 + 0.8 * 0.5)
    assert lr_factor(total, total, warm, "linear", min_factor=0.2) == pytest.approx(0.2)


def test_bias_lr_scale_gives_biases_a_scaled_rate_that_the_schedule_keeps():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    model(torch.rand(1, 3, 5, 5))
    opt = build_optimizer(model, lr=0.2, momentum=0.9, nesterov=True, weight_decay=1e-4, no_decay_norm_bias=True,
                          bias_lr_scale=8.0)
    weights, norm_weights, biases = opt.param_groups
    assert {id(p) for p in biases["params"]} == {id(model[0].bias), id(model[1].bias), id(model[3].bias)}
    assert [id(p) for p in norm_weights["params"]] == [id(model[1].weight)]
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.2, 0.2, 1.6])
    assert biases["weight_decay"] == 0.0 and weights["weight_decay"] == 1e-4
    sched = build_scheduler(opt, steps_per_epoch=4, epochs=2, warmup_epochs=0, schedule="linear")
    for _ in range(3):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.2 * 5 / 8, 0.2 * 5 / 8, 1.6 * 5 / 8])
    plain = build_optimizer(model, lr=0.2, momentum=0.9, nesterov=True, weight_decay=1e-4, no_decay_norm_bias=True)
    assert len(plain.param_groups) == 2  # without a scale, the groups are as before


def test_weight_average_follows_the_formula_with_its_warm_up():
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    # every 2 steps with decay 0.5: 0.5 ** 2 = 0.25 per update once the warm-up (1 + n) / (10 + n)
    # passes it: the last nine of the twelve updates
    average = WeightAverage(model, decay=0.5, every=2)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    expected = {k: v.clone().double() for k, v in start.items()}
    for step in range(24):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
            model(torch.randn(4, 3))  # moves the running statistics (train mode)
        average.maybe_update(model, step)
        if (step + 1) % 2 == 0:
            n = (step + 1) // 2 - 1
            d = min(0.5 ** 2, (1 + n) / (10 + n))
            for k, v in model.state_dict().items():
                if v.is_floating_point():
                    expected[k] = d * expected[k] + (1 - d) * v.double()
                else:
                    expected[k] = v.clone()
    assert average.updates == 12 and average.current_decay() == 0.25
    for k, v in average.module.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(v.double(), expected[k], msg=k)
        else:
            assert torch.equal(v, expected[k]), k
    assert not any(p.requires_grad for p in average.module.parameters()) and not average.module.training
    with pytest.raises(ValueError, match="decay must be in"):
        WeightAverage(model, decay=1.0)


def _ema_recipe(**optim):
    return recipe_from_dict(tiny_recipe(epochs=3, data={"limit_train": 16},
                                        optim={"ema_decay": 0.8, "ema_every": 2, "schedule": "linear", **optim}))


def test_the_weight_average_is_evaluated_and_saved_and_resume_restores_it(tmp_path):
    recipe = _ema_recipe()
    full = train(recipe, tmp_path / "full", progress=False, log=quiet)
    first = train(recipe, tmp_path / "split", progress=False, log=quiet, stop_after=1)
    assert first["weights"] is None
    state = torch.load(tmp_path / "split" / "checkpoints" / "epoch_0001" / "state.pt", weights_only=True)
    saved = load_file(tmp_path / "split" / "checkpoints" / "epoch_0001" / "model.safetensors")
    # the checkpoint holds the average; the live weights (which differ from it) are in state.pt
    assert state["ema_updates"] == 2  # 4 steps of batch 4, every 2
    assert any(not torch.equal(saved[k], state["live_weights"][k]) for k in saved if saved[k].is_floating_point())
    second = train(recipe, tmp_path / "split", resume=True, progress=False, log=quiet)
    a, b = load_file(full["weights"]), load_file(second["weights"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["eval_top1"] for r in full["history"]] == [r["eval_top1"] for r in second["history"]]
    assert read_sidecar(second["weights"])["recipe"]["optim"]["ema_decay"] == 0.8

    # averaging does not change the training: the live weights equal those of the same recipe
    # without an average, whose saved model they are; the saved average differs from them
    live_run = train(recipe_from_dict(tiny_recipe(epochs=3, data={"limit_train": 16},
                                                  optim={"schedule": "linear"})),
                     tmp_path / "live", progress=False, log=quiet)
    live = load_file(live_run["weights"])
    last = torch.load(tmp_path / "split" / "checkpoints" / "epoch_0003" / "state.pt", weights_only=True)
    assert all(torch.equal(last["live_weights"][k], live[k]) for k in live)
    differs = [k for k in a if a[k].is_floating_point() and not torch.equal(a[k], live[k])]
    assert len(differs) > len(a) // 2


def test_recipe_hash_is_unchanged_by_the_new_keys_at_their_defaults():
    """Runs started before the keys existed must still resume: the hash leaves them out at their
    defaults, and includes them otherwise."""
    plain = recipe_from_dict(tiny_recipe(), check_data=False)
    explicit = recipe_from_dict(tiny_recipe(optim={"ema_decay": 0.0, "bias_lr_scale": 1.0, "ema_every": 1},
                                            data={"flip": "random"}), check_data=False)
    assert "ema_decay" not in plain.to_dict()["optim"] and "flip" not in plain.to_dict()["data"]
    assert plain.sha256() == explicit.sha256()
    assert recipe_from_dict(tiny_recipe(optim={"ema_decay": 0.9}), check_data=False).sha256() != plain.sha256()


def test_alternating_flip_shows_each_image_both_ways_every_two_epochs():
    images = torch.arange(6 * 3 * 4 * 4, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(6, 3, 4, 4)
    base = TensorImageDataset(images, torch.zeros(6, dtype=torch.long), RandomCropFlip(0, flip=False))
    data = SeededAugment(base, seed=3, alternate_flip=True)
    seen = []
    for epoch in range(4):
        data.set_epoch(epoch)
        seen.append([data[i][0] for i in range(6)])
    plain = [base[i][0] for i in range(6)]
    flips = [[torch.equal(seen[e][i], plain[i].flip(-1)) for i in range(6)] for e in range(4)]
    for i in range(6):
        assert flips[0][i] != flips[1][i] and flips[0][i] == flips[2][i] and flips[1][i] == flips[3][i]
        assert torch.equal(seen[0][i], seen[2][i])
    again = SeededAugment(base, seed=3, alternate_flip=True)
    assert all(torch.equal(again[i][0], seen[0][i]) for i in range(6))


def test_translate_and_flip_replace_the_datasets_augmentation(tmp_path):
    images = torch.zeros(2, 3, 8, 8, dtype=torch.uint8)
    data = TensorImageDataset(images, torch.zeros(2, dtype=torch.long), RandomCropFlip(4))
    _set_translate_flip(torch.utils.data.Subset(data, [0, 1]), 2, "alternating")
    assert data.transform.padding == 2 and data.transform.flip is False
    _set_translate_flip(data, None, "random")  # the defaults: untouched
    assert data.transform.padding == 2
    plain = TensorImageDataset(images, torch.zeros(2, dtype=torch.long), None)
    with pytest.raises(RecipeError, match="crop-and-flip augmentation"):
        _set_translate_flip(plain, 2, "random")
    # end to end: a recipe with them trains and records them
    raw = tiny_recipe(epochs=1, data={"limit_train": 8, "translate": 2, "flip": "alternating"})
    result = train(recipe_from_dict(raw), tmp_path, progress=False, log=quiet)
    meta = read_sidecar(result["weights"])
    assert meta["recipe"]["data"]["translate"] == 2 and meta["recipe"]["data"]["flip"] == "alternating"
