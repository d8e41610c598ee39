"""Every ``eval`` subcommand's options come from its protocol's settings, the dataclass its study
step takes: one default per setting; and one radius syntax in every command and config file."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from robust_attn.cli import build_parser, main
from robust_attn.commands.eval import eval_settings
from robust_attn.protocols.eval_step import EVAL_PROTOCOLS
from robust_attn.protocols.settings import eval_fields, field_default, field_option, study_fields
from robust_attn.protocols.study_step import STUDY_PROTOCOLS
from robust_attn.runs.study_file import STUDY_SCHEMA_VERSION, load_study_file, write_study_file
from robust_attn.study.config import StudyConfig, StudyConfigError, load_study_config

BUILT_IN = ("rotation", "pgd", "attack", "transfer", "corruption", "occlusion", "shuffle")


def _eval_parser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    evals = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["eval"]
    return next(a for a in evals._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


@pytest.mark.parametrize("name", BUILT_IN)
def test_each_built_in_eval_subcommand_is_its_protocols_settings(name, monkeypatch):
    import robust_attn.protocols.corruption as corruption

    monkeypatch.setattr(corruption, "check_frost", lambda conditions: None)   # the photographs are not shipped
    protocol = EVAL_PROTOCOLS.get(name)
    options = {o: a.dest for a in _eval_parser(name)._actions for o in a.option_strings}
    for f in eval_fields(protocol.settings):
        assert options[field_option(f, "eval")] == f.name
    # nothing given: every setting at the field's default
    args = build_parser().parse_args(["eval", name, "--dataset", "synthetic"]
                                     + {"attack": ["--attack", "pgd"],
                                        "transfer": ["--source", "a", "--target", "b"]}.get(name, []))
    settings = eval_settings(protocol, args)
    for f in dataclasses.fields(protocol.settings):
        if f.name not in ("attack", "source", "target"):
            assert getattr(settings, f.name) == field_default(f), f.name


def test_eval_and_study_share_their_defaults():
    study = StudyConfig()
    shared = [n for n in EVAL_PROTOCOLS.names() if n in STUDY_PROTOCOLS.names()]
    assert set(shared) == set(BUILT_IN) - {"attack"}   # eval attack: any attack; the study: apgd, autoattack, square
    for name in shared:
        settings = EVAL_PROTOCOLS.get(name).settings
        assert STUDY_PROTOCOLS[name].settings is settings, name
        for f in study_fields(settings):
            assert getattr(study, f.name) == field_default(f), (name, f.name)
        if name in ("corruption", "occlusion", "shuffle"):   # eval's --shift-seed is the study's shift_seed
            assert field_default(next(f for f in dataclasses.fields(settings) if f.name == "shift_seed")) == \
                study.shift_seed
    # SAN Table 9's angles are multiples of the rotation sweep's one default
    assert all(angle % study.angle_step == 0 for angle in (90, 180, 270))


def test_eval_options_keep_their_names_and_parse_as_before():
    args = build_parser().parse_args(["eval", "occlusion", "--areas", "10,50", "--fill", "zeros", "--drop", "none",
                                      "--drop-grid", "2", "--shift-seed", "3", "--dataset", "synthetic"])
    settings = eval_settings(EVAL_PROTOCOLS.get("occlusion"), args)
    assert (settings.occlusion_areas, settings.fill, settings.drop_percents(), settings.drop_grid,
            settings.shift_seed) == ((10.0, 50.0), ("zeros",), [], 2, 3)
    args = build_parser().parse_args(["eval", "pgd", "--eps", "4/255,0.5", "--steps", "1,3", "--step", "1/255",
                                      "--no-checks", "--dataset", "synthetic"])
    settings = eval_settings(EVAL_PROTOCOLS.get("pgd"), args)
    assert settings.eps == (4 / 255, 0.5) and settings.steps == (1, 3) and settings.no_checks
    # Table 10's names in 1/255 units: 0.5 is 127.5/255
    assert [s.name for s in settings.eval_settings()] == ["pgd_eps4_step1_n1", "pgd_eps4_step1_n3",
                                                          "pgd_eps127.5_step1_n1", "pgd_eps127.5_step1_n3"]
    args = build_parser().parse_args(["eval", "attack", "--attack", "pgd", "--norm", "l2", "--eps", "0.5,2",
                                      "--dataset", "synthetic"])
    assert eval_settings(EVAL_PROTOCOLS.get("attack"), args).eps == (0.5, 2.0)   # L2: above 1 is a radius


@pytest.mark.parametrize("argv, message", [
    (["eval", "attack", "--attack", "pgd", "--eps", "8"], "for 8 of 255 grey levels write 8/255"),
    (["eval", "pgd", "--eps", "8"], "for 8 of 255 grey levels write 8/255"),
    (["eval", "pgd", "--step", "2"], "--step 2 is more than the whole [0, 1] pixel range"),
    (["eval", "attack"], "give --attack NAME"),
    (["eval", "transfer", "--source", "a"], "needs --source MODEL and --target MODEL"),
    (["eval", "occlusion", "--drop", "half"], "--drop takes percents"),
])
def test_eval_settings_are_refused_before_any_model_loads(argv, message, capsys):
    assert main([*argv, "--dataset", "synthetic", "--model", "no-such-model"]) == 2
    assert message in capsys.readouterr().err


def _toml(tmp_path, body: str):
    path = tmp_path / "study.toml"
    path.write_text(f'dataset = "synthetic"\nmodels = ["resnet26"]\n{body}\n')
    return path


def test_study_toml_radii_are_in_image_units(tmp_path):
    config = load_study_config(_toml(tmp_path, 'apgd_eps = ["1/255", 0.5, 1]\nsquare_eps = "4/255"\n'
                                              'sweep_eps = [0.0078431]'))
    assert config.apgd_eps == (1 / 255, 0.5, 1.0) and config.square_eps == 4 / 255
    assert config.sweep_eps == (0.0078431,)
    for body, message in [("autoattack_eps = [8]", "autoattack_eps 8 is more than the whole [0, 1] pixel range"),
                          ("autoattack_eps = [8]", "for 8 of 255 grey levels write 8/255"),
                          ('square_eps = "8 / 255"', None), ('square_eps = "eight"', "square_eps 'eight' is not a"),
                          ("square_eps = [0.1]", "square_eps must be a radius"),
                          ("apgd_eps = 0.1", "apgd_eps must be a list of radii")]:
        if message is None:
            assert load_study_config(_toml(tmp_path, body)).square_eps == 8 / 255
            continue
        with pytest.raises(StudyConfigError, match=None) as caught:
            load_study_config(_toml(tmp_path, body))
        assert message in str(caught.value), body


def test_study_flags_read_radii_as_every_command_does():
    from robust_attn.commands.study import _given

    args = build_parser().parse_args(["study", "--apgd-eps", "1/255,0.01", "--square-eps", "0.5/255",
                                      "--sweep-eps", "2/255"])
    assert _given(args) == {"apgd_eps": (1 / 255, 0.01), "square_eps": 0.5 / 255, "sweep_eps": (2 / 255,)}


def test_an_old_study_file_is_read_in_image_units(tmp_path):
    old = {"config": {"dataset": "cifar10", "sweep_eps": [2.0, 16.0], "autoattack_eps": [8.0], "apgd_eps": [1.0],
                      "square_eps": 8.0, "angle_step": 30.0, "severities": [1, 2]},
           "runs": ["r"], "versions": {}}
    (tmp_path / "study.json").write_text(json.dumps(old))
    migrated = load_study_file(tmp_path / "study.json")
    assert migrated["schema"] == STUDY_SCHEMA_VERSION
    assert migrated["config"] == {"dataset": "cifar10", "sweep_eps": [2 / 255, 16 / 255], "autoattack_eps": [8 / 255],
                                  "apgd_eps": [1 / 255], "square_eps": 8 / 255, "angle_step": 30.0,
                                  "severities": [1, 2]}
    # what this code writes reads back unchanged
    config = StudyConfig(apgd_eps=(2 / 255,)).describe()
    write_study_file(tmp_path / "new.json", config, ["r"], {})
    assert load_study_file(tmp_path / "new.json")["config"]["apgd_eps"] == [2 / 255]
    (tmp_path / "future.json").write_text(json.dumps({"schema": STUDY_SCHEMA_VERSION + 1, "config": {}}))
    with pytest.raises(ValueError, match="not a version this code reads"):
        load_study_file(tmp_path / "future.json")
