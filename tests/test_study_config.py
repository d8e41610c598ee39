"""``robust-attn study CONFIG.toml``: models from any source, validated on load, each
evaluated through its own preprocessing on the same images; the report says where each came from."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from robust_attn.cli import main
from robust_attn.study.config import StudyConfigError, StudyModel, load_study_config
from helpers import IMAGENET_CLASSES, tiny_imagenet

REPO = Path(__file__).resolve().parents[1]

NETS = '''
import torch.nn as nn


def net(num_classes=1000, stride=8):
    return nn.Sequential(nn.Conv2d(3, 4, stride, stride=stride), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, num_classes))


def bicubic_240(num_classes=1000):
    model = net(num_classes)
    model.preprocessing = {"mean": [0.5] * 3, "std": [0.5] * 3, "input_size": 224, "resize_size": 240,
                           "crop_size": 224, "interpolation": "bicubic"}
    return model
'''


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "study.toml"
    path.write_text(text)
    return path


# --- loading and validation ------------------------------------------------------------------------
def test_a_study_config_holds_specs_and_model_tables(tmp_path):
    config = load_study_config(_write(tmp_path, '''
dataset = "imagenet"
limit = 100
protocols = ["rotation", "pgd"]
sweep_eps = ["2/255", 0.03137254901960784]
baseline = "r18"
models = ["timm:resnet26t", "zoo:resnet26",
          { spec = "torchvision:resnet18:none", label = "r18", checkpoint = "r18.pth", model_args = { a = 1 } }]
'''))
    assert (config.dataset, config.limit, config.protocols, config.sweep_eps) == ("imagenet", 100, ("rotation", "pgd"),
                                                                                 (2 / 255, 8 / 255))
    assert config.models == (StudyModel("timm:resnet26t"), StudyModel("zoo:resnet26"),
                             StudyModel("torchvision:resnet18:none", checkpoint="r18.pth", model_args={"a": 1},
                                        label="r18"))
    assert [m.name for m in config.models] == ["timm-resnet26t", "resnet26", "r18"]
    tables = load_study_config(_write(tmp_path, 'dataset = "imagenet"\nbaseline = "x"\n[[models]]\nspec = "resnet26"\n'
                                                'label = "x"\n[[models]]\nspec = "timm:resnet26t"\n'))
    assert [m.name for m in tables.models] == ["x", "timm-resnet26t"]


@pytest.mark.parametrize("text, message", [
    ('dataset = "imagenet"\nlimt = 5\nmodels = ["resnet26"]', "unknown key 'limt'. Did you mean 'limit'?"),
    ('dataset = "imagenet"\nlimit = "ten"\nmodels = ["resnet26"]', "limit must be an integer, got str 'ten'"),
    ('dataset = "imagenet"\nsweep_eps = 8\nmodels = ["resnet26"]', "sweep_eps must be a list of radii"),
    ('dataset = "imagenet"\nmodels = ["tim:resnet26t"]', "models[0]: 'tim:resnet26t': no model source 'tim:' and no "
                                                          "importable module 'tim'. Did you mean 'timm:'?"),
    ('dataset = "imagenet"\nmodels = ["missing.py:net"]', "models[0]: model file missing.py does not exist"),
    ('dataset = "imagenet"\nmodels = ["net.py"]', "models[0]: 'net.py' is a Python file: name the function"),
    ('dataset = "imagenet"\nmodels = [{ label = "a" }]', "models[0] has no spec"),
    ('dataset = "imagenet"\nmodels = [{ spec = "resnet26", labl = "a" }]', "unknown key 'labl'. Did you mean 'label'?"),
    ('dataset = "imagenet"\nmodels = [{ spec = "resnet26", label = "my net" }]', "label 'my net' may hold only"),
    ('dataset = "imagenet"\nmodels = ["timm:resnet26t", "timm:resnet26t"]',
     "two models are named timm-resnet26t: give each a distinct label"),
    ('dataset = "imagenet"\nmodels = ["timm:resnet26t"]', "baseline = 'resnet26' names none of the models; set it "
                                                          "to one of their labels: timm-resnet26t"),
    ('dataset = "imagenet"\nprotocols = ["rotaton"]\nmodels = ["resnet26"]', "protocols must be a non-empty subset"),
    ('models = ["resnet26"]', "lacks 'dataset'"),
    ('dataset = "imagenet"\nmodels = []', "models must be a non-empty list"),
    ('dataset = "imagenet"\nmodels = [', "is not valid TOML"),
    ('dataset = "imagenet"\nsweep_eps = [1000.0]\nmodels = ["resnet26"]', "sweep_eps 1000.0 is more than the whole [0, 1] pixel range"),
        ('dataset = "imagenet"\napgd_eps = [8]\nmodels = ["resnet26"]', "apgd_eps 8 is more than the whole [0, 1] pixel "
                                                                       "range: every command and config reads a radius "
                                                                       "in image units (8/255 or 0.031); for 8 of 255 "
                                                                       "grey levels write 8/255"),
        ('dataset = "imagenet"\nsquare_eps = "8/256x"\nmodels = ["resnet26"]', "square_eps '8/256x' is not a number"),
    ('dataset = "imagenet"\nattack_steps = -5\nmodels = ["resnet26"]', "attack_steps must be at least 1"),
    ('dataset = "imagenet"\nmasking_images = -1\nmodels = ["resnet26"]', "masking_images must be at least 1"),
    ('dataset = "imagenet"\nattack_limit = 0\nmodels = ["resnet26"]', "attack_limit must be positive"),
    ('dataset = "imagenet"\nsplit = "tset"\nmodels = ["resnet26"]', "split must be train, val or test, got 'tset'"),
    ('dataset = "fashoin_mnist"\nmodels = ["resnet26"]', "unknown dataset 'fashoin_mnist'. Did you mean 'fashion_mnist'?"),
])
def test_bad_study_configs_name_the_key_and_the_fix(tmp_path, text, message):
    with pytest.raises(StudyConfigError, match=None) as caught:
        load_study_config(_write(tmp_path, text))
    assert message in str(caught.value) and str(tmp_path / "study.toml") in str(caught.value)


def test_the_imagenet_study_of_the_readme_names_the_issue_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # the SAN authors' files, where the config expects them (existence is checked)
    for arch in ("san10_pairwise", "san10_patchwise", "san15_pairwise", "san15_patchwise", "san19_pairwise",
                 "san19_patchwise"):
        (tmp_path / "exp" / "imagenet" / arch / "model").mkdir(parents=True)
        (tmp_path / "exp" / "imagenet" / arch / "model" / "model_best.pth").touch()
    config = load_study_config(REPO / "zoo" / "studies" / "imagenet.toml")
    specs = {m.spec.rsplit(":", 1)[-1] if m.spec.startswith("san-official:") else m.spec for m in config.models}
    assert specs == {"san10_pairwise", "san10_patchwise", "san15_pairwise", "san15_patchwise", "san19_pairwise",
                     "san19_patchwise", "timm:halonet26t", "timm:botnet26t_256", "timm:lambda_resnet26t",
                     "timm:resnet26t", "torchvision:resnet50:IMAGENET1K_V1", "torchvision:swin_t:IMAGENET1K_V1"}
    assert config.dataset == "imagenet" and config.split == "test" and "san10_pairwise" in [m.name for m in config.models]
    assert not {"transfer", "masking"} & set(config.protocols)   # their models' preprocessing differ
    (tmp_path / "exp" / "imagenet" / "san19_patchwise" / "model" / "model_best.pth").unlink()
    with pytest.raises(StudyConfigError, match="models\\[5\\]: SAN authors' checkpoint .*san19_patchwise.* does not exist"):
        load_study_config(REPO / "zoo" / "studies" / "imagenet.toml")


# --- the command end to end --------------------------------------------------------------------------
@pytest.fixture
def imagenet_study(tmp_path):
    tiny_imagenet(tmp_path / "data", "flat")
    (tmp_path / "nets.py").write_text(NETS)
    nets = tmp_path / "nets.py"
    text = f'''
dataset = "imagenet"
root = "{tmp_path / 'data'}"
limit = 2
protocols = ["rotation", "pgd"]
angle_step = 0
sweep_eps = []
batch_size = 2
bootstrap = 10
baseline = "plain"
models = [{{ spec = "{nets}:net", label = "plain" }}, "{nets}:bicubic_240"]
'''
    return _write(tmp_path, text)


def test_study_config_runs_every_model_through_its_own_preprocessing(tmp_path, imagenet_study):
    runs, report = tmp_path / "runs", tmp_path / "report"
    assert main(["study", str(imagenet_study), "--runs", str(runs), "--out", str(report), "--workers", "1",
                 "--device", "cpu", "--no-progress"]) == 0
    plain = json.loads((runs / "rotation-plain" / "run.json").read_text())
    own = json.loads((runs / "rotation-nets-bicubic_240" / "run.json").read_text())
    assert plain["preprocessing"] is None and plain["source"] == "callable" and plain["model"] == "plain"
    assert own["preprocessing"]["resize_size"] == 240 and own["preprocessing"]["interpolation"] == "bicubic"
    assert own["spec"] == f"{tmp_path / 'nets.py'}:bicubic_240" and own["weights_origin"] == "user"
    assert plain["dataset"] == own["dataset"] == {"name": "imagenet", "split": "test", "limit": 2}
    # the same images and targets for both models
    pgd = [pd.read_csv(runs / f"pgd-{m}" / "targets.csv") for m in ("plain", "nets-bicubic_240")]
    pd.testing.assert_frame_equal(pgd[0], pgd[1])
    assert set(pgd[0]["label"]) <= set(IMAGENET_CLASSES.values())
    models = pd.read_csv(report / "models.csv").set_index("label")
    assert models.loc["plain", "preprocessing"] == "the dataset's images"
    assert models.loc["nets-bicubic_240", "preprocessing"].startswith("resize 240 (bicubic), crop 224")
    assert models.loc["plain", "params"] == 3 * 4 * 64 + 4 + 4 * 1000 + 1000 == plain["params"]
    assert models.loc["plain", "weights_sha256"] == plain["weights_sha256"]
    text = (report / "report.md").read_text()
    assert "## Models" in text and "random weights" not in text and "2 models on `imagenet`" in text


def test_study_command_options_with_a_config(tmp_path, imagenet_study, capsys):
    common = ["--runs", str(tmp_path / "r"), "--out", str(tmp_path / "o"), "--workers", "1", "--device", "cpu",
              "--no-progress"]
    # comparing the models on the same tensors is refused when their preprocessing differ, before any run
    assert main(["study", str(imagenet_study), "--protocols", "rotation,transfer", *common]) == 2
    assert "transfer compare the models on the same images" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    assert main(["study", str(imagenet_study), "--models", "nosuch", *common]) == 2
    assert "no model labelled so; its models: plain, nets-bicubic_240" in capsys.readouterr().err
    assert main(["study", str(imagenet_study), "--dataset", "cifar10", *common]) == 2
    assert "names its dataset" in capsys.readouterr().err
    assert main(["study", str(tmp_path / "missing.toml"), *common]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["study", str(imagenet_study), "--models", "plain", "--protocols", "rotation", *common]) == 0
    assert sorted(p.name for p in (tmp_path / "r").iterdir() if p.is_dir()) == ["rotation-plain"]


def test_python_m_cli_prints_user_errors_without_a_traceback(tmp_path):
    """``python -m robust_attn.cli`` (as under torchrun) catches the commands' UserError like the
    console script: this file run as __main__ must not define a second UserError class."""
    import subprocess
    import sys

    from helpers import subprocess_env

    result = subprocess.run([sys.executable, "-m", "robust_attn.cli", "study", str(tmp_path / "missing.toml")],
                            env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("robust-attn study: error: study config") and "does not exist" in result.stderr


def test_a_missing_key_inside_the_code_is_a_traceback_not_an_input_error(monkeypatch, capsys):
    """A KeyError naming what the user asked for (an unknown zoo entry) is printed as the input's
    error; a bare missing key (a column the code expected) is a bug and keeps its traceback."""
    import argparse

    from robust_attn import cli

    parser = argparse.ArgumentParser()

    def fails_with(err):
        def func(args):
            raise err
        return argparse.Namespace(command="report", func=func)

    message = "the zoo has no 'x' trained on 'cifar10'; it has: resnet26"
    assert cli._run(parser, fails_with(KeyError(message)), []) == 2
    assert capsys.readouterr().err == f"robust-attn report: error: {message}\n"
    with pytest.raises(KeyError, match="top1"):
        cli._run(parser, fails_with(KeyError("top1")), [])


@pytest.mark.parametrize("text, message", [
    ('dataset = "imagenet"\nlimit = true\nmodels = ["resnet26"]', "limit must be an integer, got bool True"),
    ('dataset = "imagenet"\ncorruptions = 5\nmodels = ["resnet26"]', "corruptions must be a string, got int 5"),
    ('dataset = "imagenet"\nmodels = [{ spec = "resnet26", checkpoint = 5 }]',
     "models[0]: model 'resnet26': checkpoint must be a path string, got 5"),
], ids=["boolean limit", "number for a string", "number for a checkpoint path"])
def test_wrongly_typed_values_are_refused_naming_the_key(tmp_path, text, message):
    """A value of the wrong type (true as a count, a number where a name or path goes) is a
    StudyConfigError naming the file and the key, not accepted or a traceback later."""
    with pytest.raises(StudyConfigError) as caught:
        load_study_config(_write(tmp_path, text))
    assert message in str(caught.value) and str(tmp_path / "study.toml") in str(caught.value)


def test_a_study_without_models_takes_one_zoo_entry_per_architecture(tmp_path):
    """The zoo's other versions of a family (``-efficient``, ``-adv``) stay out of the default study,
    so the presets run the seven models their docs name and the committed reports' commands run
    the models those reports hold; an architecture registered only under other names keeps them all."""
    from robust_attn.models.manifest import Manifest, ZooEntry
    from robust_attn.study.config import StudyConfig
    from robust_attn.study.models import default_zoo_models, study_models

    for dataset in ("cifar10", "fashion_mnist"):
        logged = []
        chosen = study_models(StudyConfig(dataset=dataset), Manifest(), log=logged.append)
        assert sorted(m.name for m in chosen) == sorted(["resnet26", "san10_pairwise", "san10_patchwise",
                                                         "sasa_resnet26", "gsa_resnet26", "aa_resnet26",
                                                         "ea_resnet26"])
        assert all(m.spec == f"zoo:{m.name}" for m in chosen)
        entries = [name for name, d in Manifest().entries if d == dataset]
        if len(entries) > 7:   # CIFAR-10 holds the efficient and adversarial versions too: said, not run
            assert "left out: " in logged[0] and "resnet26-adv" in logged[0]
    sha = "0" * 64
    entries = [ZooEntry("resnet26", "d", weights="a", sha256=sha, arch={"name": "resnet26"}),
               ZooEntry("resnet26-v2", "d", weights="b", sha256=sha, arch={"name": "resnet26"}),
               ZooEntry("my_sasa", "d", weights="c", sha256=sha, arch={"name": "sasa_resnet26"}),
               ZooEntry("my_sasa_long", "d", weights="e", sha256=sha, arch={"name": "sasa_resnet26"})]
    assert default_zoo_models(entries) == (["resnet26", "my_sasa", "my_sasa_long"], ["resnet26-v2"])
    # named models are the study's whatever their names
    chosen = study_models(StudyConfig(dataset="cifar10", models=("resnet26-adv",)), Manifest())
    assert [m.spec for m in chosen] == ["zoo:resnet26-adv"]
