"""Adopting the records of the same computation from another study's runs
(robust_attn/runs/adopt.py): a study that shares conditions with an earlier one gets exactly the
records it would have computed, computes only the rest, and never takes a chunk of another
computation or a damaged one."""
import json

import pandas as pd
import pytest
import torch

import robust_attn
from robust_attn.cli import main
from robust_attn.models.checkpoint import save_checkpoint
from robust_attn.models.wrapper import NormalizedModel
from robust_attn.runs.adopt import adopt_records, adopted_chunks, write_reuse_sources
from robust_attn.runs.store import RunStore, load_records
from robust_attn.study.config import StudyConfig
from robust_attn.study.run import TIMINGS_FILE, run_study


@pytest.fixture
def tiny_zoo(tmp_path):
    manifest_path = tmp_path / "zoo" / "manifest.json"
    torch.manual_seed(0)
    model = robust_attn.create_model("resnet26", 10, "cifar", width=0.25, stem_downsample=4)
    path = tmp_path / "ckpt" / "resnet26.safetensors"
    save_checkpoint(path, NormalizedModel(model, (0.5,) * 3, (0.25,) * 3).eval())
    assert main(["zoo", "add", "resnet26", "--dataset", "synthetic", "--checkpoint", str(path),
                 "--manifest", str(manifest_path)]) == 0
    return manifest_path


def _config(apgd_eps, limit=8, protocols=("apgd", "square")):
    return StudyConfig(dataset="synthetic", limit=limit, attack_limit=8, apgd_eps=apgd_eps, square_eps=8 / 255,
                       square_queries=10, attack_steps=2, batch_size=4, attack_batch_size=4, bootstrap=10,
                       protocols=protocols)


def test_a_study_adopts_the_shared_conditions_and_equals_one_computed_from_scratch(tmp_path, tiny_zoo):
    quiet = dict(manifest=tiny_zoo, device="cpu", progress=False, log=lambda *_: None)
    first, second, scratch = tmp_path / "first", tmp_path / "second", tmp_path / "scratch"
    run_study(_config((1 / 255, 4 / 255)), first, tmp_path / "r1", **quiet)
    write_reuse_sources(second, [first])
    run_study(_config((1 / 255, 4 / 255, 8 / 255)), second, tmp_path / "r2", **quiet)
    run_study(_config((1 / 255, 4 / 255, 8 / 255)), scratch, tmp_path / "r3", **quiet)
    for run in ("apgd-resnet26", "square-resnet26"):   # the records of a study that adopted nothing
        pd.testing.assert_frame_equal(load_records(second / run), load_records(scratch / run))
    # apgd: clean, 1/255 and 4/255 adopted (two chunks each), 8/255 computed; square: all adopted
    timings = pd.read_csv(second / TIMINGS_FILE).set_index("protocol")
    assert timings.loc["apgd", "chunks_adopted"] == 6 and timings.loc["apgd", "chunks_written"] == 2
    assert timings.loc["square", "chunks_adopted"] == 4 and timings.loc["square", "chunks_written"] == 0
    apgd = RunStore(second / "apgd-resnet26")
    entries = {c: json.loads(apgd.checksum_path(apgd.chunk_path(c, a, b)).read_text()) for c, a, b in apgd.chunks()}
    assert {c for c, e in entries.items() if "adopted_from" in e} == {"clean", "apgd-ce_linf_eps1_n2",
                                                                       "apgd-ce_linf_eps4_n2"}
    assert entries["clean"]["adopted_from"] == str((first / "apgd-resnet26").resolve())
    assert "hardware" in entries["clean"]     # where it was computed stays recorded
    assert adopted_chunks(RunStore(scratch / "apgd-resnet26")) == 0


def _store(path, *, eps=8 / 255, model="m", conditions=("clean", "attack"), sha256="a" * 64):
    store = RunStore(path)
    definitions = [{"name": "clean", "attack": "none", "eps": 0.0},
                   {"name": "attack", "attack": "apgd-ce", "eps": eps}]
    store.open({"protocol": "attack", "model": model, "num_images": 4, "chunk_size": 2, "command": [str(path)],
                "checkpoint": {"path": "m.safetensors", "sha256": sha256},
                "conditions": [d for d in definitions if d["name"] in conditions]})
    return store


def _fill(store, conditions=("clean", "attack")):
    for condition in conditions:
        for start in (0, 2):
            store.write_chunk(condition, start, start + 2,
                              pd.DataFrame({"index": [start, start + 1], "success": [1, 0]}))


def test_only_identical_conditions_of_the_same_run_are_adopted(tmp_path):
    source = _store(tmp_path / "a" / "run")
    _fill(source)
    lines = []
    other_model = _store(tmp_path / "b" / "run", model="other")
    assert adopt_records(other_model, source.root, log=lines.append) == [] and other_model.chunks() == []
    assert "nothing adopted" in lines[-1] and "model" in lines[-1]
    other_weights = _store(tmp_path / "w" / "run", sha256="b" * 64)   # the same label, other weights
    assert adopt_records(other_weights, source.root, log=lines.append) == [] and other_weights.chunks() == []
    assert "nothing adopted" in lines[-1] and "checkpoint" in lines[-1]
    other_eps = _store(tmp_path / "c" / "run", eps=4 / 255)   # same name, another radius: only clean is the same
    assert {c for c, _, _ in adopt_records(other_eps, source.root)} == {"clean"}
    same = _store(tmp_path / "d" / "run")
    same.write_chunk("attack", 0, 2, pd.DataFrame({"index": [0, 1], "success": [0, 0]}))   # computed there already
    assert sorted(adopt_records(same, source.root)) == [("attack", 2, 4), ("clean", 0, 2), ("clean", 2, 4)]
    assert load_records(same.root)["success"].tolist() == [1, 0, 1, 0, 0, 0, 1, 0]   # its own chunk kept


def test_a_damaged_source_chunk_is_not_adopted(tmp_path):
    source = _store(tmp_path / "a" / "run")
    _fill(source)
    chunk = source.chunk_path("attack", 2, 4)
    chunk.write_text(chunk.read_text().replace("0\n", "1\n"))
    target = _store(tmp_path / "b" / "run")
    assert ("attack", 2, 4) not in adopt_records(target, source.root)
    assert target.missing() == [("attack", 2, 4)]
    assert not target.verify()


def test_a_source_with_a_damaged_description_is_passed_over(tmp_path):
    source = _store(tmp_path / "a" / "run")
    _fill(source)
    (source.root / "run.json").write_text("{not json")
    target, lines = _store(tmp_path / "b" / "run"), []
    assert adopt_records(target, source.root, log=lines.append) == [] and target.chunks() == []
    assert "nothing adopted" in lines[-1] and "damaged" in lines[-1]


def test_reuse_runs_refuses_a_folder_that_is_not_there_or_its_own(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no such folder of runs"):
        write_reuse_sources(tmp_path / "runs", [tmp_path / "typo"])
    with pytest.raises(ValueError, match="own folder of runs"):
        write_reuse_sources(tmp_path / "runs", [tmp_path / "runs"])
    assert main(["study", "--dataset", "synthetic", "--runs", str(tmp_path / "r"), "--reuse-runs",
                 str(tmp_path / "typo"), "--no-progress"]) == 2
    assert "no such folder of runs" in capsys.readouterr().err


def test_attack_runs_record_their_subset_so_studies_of_other_limits_share_them(tmp_path, tiny_zoo):
    """A study of 16 images attacks a seeded 8 of them: the same 8 as a study of 8 images, and its
    attack runs say so (limit 8), so the one adopts the other's records; a run recorded the old way
    (the study's limit) resumes, one on other images does not."""
    from robust_attn.runs.store import RunMismatchError

    quiet = dict(manifest=tiny_zoo, device="cpu", progress=False, log=lambda *_: None)
    small, large = tmp_path / "small", tmp_path / "large"
    run_study(_config((2 / 255,), protocols=("rotation", "apgd")), small, tmp_path / "r1", **quiet)
    write_reuse_sources(large, [small])
    run_study(_config((2 / 255,), limit=16, protocols=("rotation", "apgd")), large, tmp_path / "r2", **quiet)
    dataset = {run: json.loads((large / run / "run.json").read_text())["dataset"]["limit"]
               for run in ("rotation-resnet26", "apgd-resnet26")}
    assert dataset == {"rotation-resnet26": 16, "apgd-resnet26": 8}
    assert adopted_chunks(RunStore(large / "apgd-resnet26")) == 4
    assert adopted_chunks(RunStore(large / "rotation-resnet26")) == 0
    pd.testing.assert_frame_equal(load_records(large / "apgd-resnet26"), load_records(small / "apgd-resnet26"))
    description = large / "apgd-resnet26" / "run.json"
    stored = json.loads(description.read_text())
    for old_limit, resumes in ((16, True), (None, True), (4, False)):
        description.write_text(json.dumps({**stored, "dataset": {**stored["dataset"], "limit": old_limit}}))
        config = _config((2 / 255,), limit=16, protocols=("apgd",))
        if resumes:
            run_study(config, large, tmp_path / "r3", **quiet)
        else:
            with pytest.raises(RunMismatchError, match="dataset"):
                run_study(config, large, tmp_path / "r3", **quiet)


def test_the_plan_names_the_runs_that_may_adopt_and_writes_nothing(tmp_path, tiny_zoo, capsys):
    """--plan with --reuse-runs (nothing written yet) and a study whose reuse.json names the folder
    say which of its runs have a run of their name there; a folder without them, and no reuse at
    all, say so or nothing."""
    first, second, other = tmp_path / "first", tmp_path / "second", tmp_path / "other"
    run_study(_config((1 / 255,)), first, tmp_path / "r1", manifest=tiny_zoo, device="cpu", progress=False,
              log=lambda *_: None)
    other.mkdir()
    plan = ["study", "--dataset", "synthetic", "--manifest", str(tiny_zoo), "--models", "resnet26", "--limit", "8",
            "--attack-limit", "8", "--protocols", "rotation,apgd,square", "--device", "cpu", "--plan",
            "--no-progress", "--runs", str(second), "--out", str(tmp_path / "out")]
    assert main(plan + ["--reuse-runs", str(first)]) == 0
    line = [s for s in capsys.readouterr().out.splitlines() if "reusing" in s]
    assert line == [f"  (reusing {first.resolve()}: 2 of these runs have a run of their name there (apgd-resnet26, "
                    f"square-resnet26); each adopts its records of the same computation when it opens, so those runs "
                    f"may take less than planned)"]
    assert not second.exists() and not (tmp_path / "out").exists()
    assert main(plan) == 0
    assert "reusing" not in capsys.readouterr().out
    write_reuse_sources(second, [other])   # as a study started with --reuse-runs leaves it
    assert main(plan) == 0
    assert f"  (reusing {other.resolve()}: no run of this study has a run of its name there)" in capsys.readouterr().out
    assert main(plan + ["--reuse-runs", str(first), "--reuse-runs", str(first)]) == 0
    assert f"(reusing {other.resolve()}, {first.resolve()}: 2 of these runs" in capsys.readouterr().out
    assert main(plan + ["--reuse-runs", str(tmp_path / "typo")]) == 2   # as the study itself would refuse it
    assert "no such folder of runs" in capsys.readouterr().err
