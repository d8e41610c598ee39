"""Shipped recipes (zoo/recipes) against the papers' settings, and recipe validation."""
from __future__ import annotations

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser from PyPI (a dependency there)
    import tomli as tomllib
from pathlib import Path

import pytest

from robust_attn.models.registry import list_models
from robust_attn.train.recipe import RecipeError, load_recipe, parse_overrides, recipe_from_dict

RECIPES = Path(__file__).resolve().parents[1] / "zoo" / "recipes"
ALL = sorted(p.name for p in RECIPES.glob("*.toml"))


def load(name: str, *overrides: str):
    return load_recipe(RECIPES / name, overrides, check_data=False)


@pytest.mark.parametrize("name", ALL)
def test_every_recipe_loads_and_names_a_registered_model(name):
    recipe = load(name)
    assert recipe.model in list_models() and recipe.epochs >= 1
    assert recipe.description


@pytest.mark.parametrize("name", [n for n in ALL if "inherit" in tomllib.loads((RECIPES / n).read_text())])
def test_inheriting_recipes_repeat_nothing_of_their_base(name):
    raw = tomllib.loads((RECIPES / name).read_text())
    base = load(raw.pop("inherit")).to_dict()
    for key, value in raw.items():
        if isinstance(value, dict) and key != "model_args":
            same = [f"{key}.{k}" for k, v in value.items() if base.get(key, {}).get(k) == v]
        else:
            same = [key] if base.get(key) == value else []
        assert not same, f"{name} repeats {same} of its base; delete them"


def test_san_imagenet_recipe_is_section_5_1():
    r = load("imagenet_san.toml")
    assert (r.dataset, r.epochs, r.data.batch_size, r.lr_at()) == ("imagenet", 100, 256, pytest.approx(0.1))
    assert (r.optim.momentum, r.optim.weight_decay, r.optim.label_smoothing, r.optim.schedule) == \
        (0.9, 1e-4, 0.1, "cosine")
    for model in list_models("resnet*") + list_models("san*"):
        assert load("imagenet_san.toml", f"model={model}").model == model


def test_other_imagenet_recipes_follow_their_papers():
    gsa = load("imagenet_gsa.toml")
    assert (gsa.epochs, gsa.data.batch_size, gsa.optim.label_smoothing) == (90, 2048, 0.1)
    sasa = load("imagenet_sasa.toml")
    assert (sasa.epochs, sasa.optim.nesterov, sasa.optim.warmup_epochs) == (130, True, 10)
    assert sasa.lr_at() == pytest.approx(1.6)  # 1.6 at batch 4096
    aa = load("imagenet_aa.toml")
    assert aa.lr_at(1024) == pytest.approx(0.512) and aa.optim.milestones == (30, 60, 80, 90)
    assert (aa.optim.schedule, aa.optim.warmup_epochs, aa.optim.label_smoothing) == ("step", 5, 0.0)
    assert load("imagenet_ea.toml").model.startswith("ea_")


def test_cifar_and_fashion_recipes():
    wrn = load("cifar100_aa_wrn28_10.toml")
    assert (wrn.model, wrn.epochs, wrn.data.batch_size, wrn.optim.warmup_epochs) == ("aa_wrn28_10", 500, 256, 25)
    assert wrn.lr_at() == pytest.approx(0.2) and wrn.optim.weight_decay == 5e-4
    cpu = load("fashion_mnist_cpu.toml")
    assert cpu.dataset == "fashion_mnist" and cpu.model_args == {"width": 0.25, "stem_downsample": 2}
    assert cpu.runtime.device == "cpu"
    for model in [m for m in list_models() if "26" in m or m.startswith("san10")]:
        assert load("fashion_mnist_cpu.toml", f"model={model}").model_args["width"] == 0.25


# --- validation --------------------------------------------------------------------------------

def good() -> dict:
    return {"model": "resnet26", "dataset": "synthetic", "epochs": 1}


@pytest.mark.parametrize("change,message", [
    ({"epoch": 3}, "Did you mean 'epochs'"),
    ({"optim": {"weight_decy": 1e-4}}, "Did you mean 'weight_decay'"),
    ({"model": "resnet27"}, "not in the registry. Did you mean resnet26"),
    ({"dataset": "cifar"}, "Did you mean 'cifar10'"),
    ({"epochs": "ten"}, "epochs must be int"),
    ({"optim": {"schedule": "linearly"}}, "choose one of"),
    ({"optim": {"ema_decay": 1.0}}, "optim.ema_decay must be in"),
    ({"optim": {"ema_every": 0}}, "optim.ema_every at least 1"),
    ({"optim": {"bias_lr_scale": 0}}, "bias_lr_scale must be positive"),
    ({"data": {"flip": "sometimes"}}, "choose one of"),
    ({"data": {"translate": -1}}, "data.translate must be 0 or more"),
    ({"data": {"translate": 2, "augment": False}}, "need data.augment = true"),
    ({"optim": {"schedule": "step"}}, "needs optim.milestones"),
    ({"data": {"eval_split": "val"}}, "set data.holdout = true"),
    ({"runtime": {"amp": "fp8"}}, "choose one of"),
    ({"optim": "fast"}, "must be a table"),
])
def test_bad_recipes_say_what_to_fix(change, message):
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict({**good(), **change})
    with pytest.raises(RecipeError, match="lacks required key"):
        recipe_from_dict({"model": "resnet26", "dataset": "synthetic"})


def test_missing_dataset_root_is_a_recipe_error(tmp_path):
    raw = {**good(), "dataset": "cifar100", "data": {"root": str(tmp_path)}}
    with pytest.raises(RecipeError, match=str(tmp_path)):
        recipe_from_dict(raw)
    assert recipe_from_dict(raw, check_data=False).data.root == str(tmp_path)


def test_inherit_overrides_and_cycles(tmp_path):
    (tmp_path / "base.toml").write_text('model = "resnet26"\ndataset = "synthetic"\nepochs = 5\n'
                                        'model_args = { width = 0.5, stem_downsample = 2 }\n'
                                        '[optim]\nlr = 0.2\nmomentum = 0.8\n')
    (tmp_path / "child.toml").write_text('inherit = "base.toml"\nepochs = 7\n[optim]\nlr = 0.3\n')
    r = load_recipe(tmp_path / "child.toml", ["optim.nesterov=true", "model_args.width=0.25", "model=resnet38"])
    assert (r.epochs, r.optim.lr, r.optim.momentum, r.optim.nesterov, r.model) == (7, 0.3, 0.8, True, "resnet38")
    assert r.model_args == {"width": 0.25, "stem_downsample": 2}
    assert r.sha256() != load_recipe(tmp_path / "child.toml").sha256()
    (tmp_path / "a.toml").write_text('inherit = "b.toml"\n')
    (tmp_path / "b.toml").write_text('inherit = "a.toml"\n')
    with pytest.raises(RecipeError, match="inherits itself"):
        load_recipe(tmp_path / "a.toml")
    with pytest.raises(RecipeError, match="not KEY=VALUE"):
        parse_overrides(["epochs"])
    assert parse_overrides(["optim.milestones=[1, 2]", "a.b.c='x'"]) == {"optim": {"milestones": [1, 2]},
                                                                        "a": {"b": {"c": "x"}}}


@pytest.mark.parametrize("change,message", [
    ({"optim": {"nesterov": True, "momentum": 0.0}}, "optim.nesterov needs optim.momentum > 0"),
    ({"optim": {"label_smoothing": 1.0}}, "0 <= label_smoothing 1.0 < 1"),
    ({"optim": {"min_lr": -0.1}}, "must not be negative"),
    ({"epochs": True}, "epochs must be int, got bool True"),
    ({"epochs": 0}, "epochs must be at least 1, got 0"),
], ids=["nesterov without momentum", "label smoothing 1", "negative min_lr", "boolean epochs", "zero epochs"])
def test_out_of_range_settings_are_refused_naming_the_key(change, message):
    """Settings that would train nonsense (no epochs, all-uniform targets, a negative floor,
    nesterov without momentum, true as a count) are refused on load, naming the key."""
    with pytest.raises(RecipeError) as err:
        recipe_from_dict({**good(), **change})
    assert message in str(err.value)


def test_recipe_hash_does_not_depend_on_where_the_file_lies(tmp_path):
    """The resolved recipe's sha256 (checked by --resume and zoo verify) is the settings' alone: the
    same recipe read from another folder hashes the same; a changed setting does not."""
    text = 'model = "resnet26"\ndataset = "synthetic"\nepochs = 2\n[optim]\nlr = 0.2\n'
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "r.toml").write_text(text)
    here, there = (load_recipe(tmp_path / f / "r.toml", check_data=False) for f in ("a", "b"))
    assert here.source != there.source and here.sha256() == there.sha256()
    assert load_recipe(tmp_path / "a" / "r.toml", ["epochs=3"], check_data=False).sha256() != here.sha256()
