"""The shift protocols (corruption, occlusion, shuffle): CE/mCE on hand-made records, resumption,
the corrupted-set cache, the published CIFAR-10-C / ImageNet-C layouts, the CLI and the study."""
from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch

from robust_attn.cli import main
from robust_attn.data import build_dataset
from robust_attn.data.base import TensorImageDataset
from robust_attn.protocols.corruption import corruption_conditions, run_corruption
from robust_attn.protocols.occlusion import occlusion_conditions, run_occlusion
from robust_attn.protocols.shuffle import run_shuffle, shuffle_conditions
from robust_attn.runs.store import load_records
from robust_attn.shifts.cache import CorruptionCache, OnTheFly, to_float, to_uint8
from robust_attn.shifts.corruptions import corrupt_batch
from robust_attn.shifts.metrics import corruption_errors, error_table, mce_summary
from robust_attn.shifts.published import CifarC, ImageNetC, PublishedCorruptions
from helpers import tiny_resnet

TINY = ["--model", "resnet26", "--model-args", "width=0.25", "--dataset", "synthetic", "--no-progress"]


# --- CE and mCE on hand-made records ------------------------------------------------------------
def _records(errors: dict, n: int = 10) -> tuple[pd.DataFrame, list[dict]]:
    """Records of ``n`` images per condition with ``errors[condition]`` of them wrong."""
    frames, conditions = [], []
    for name, wrong in errors.items():
        corruption, _, severity = name.rpartition("_s") if name != "clean" else ("clean", "", "0")
        conditions.append({"name": name, "corruption": corruption, "severity": int(severity)})
        top1 = np.r_[np.zeros(wrong, int), np.ones(n - wrong, int)]
        frames.append(pd.DataFrame({"condition": name, "index": range(n), "top1": top1, "top5": 1}))
    return pd.concat(frames, ignore_index=True), conditions


def test_ce_and_mce_by_hand():
    model, mc = _records({"clean": 1, "blur_s1": 2, "blur_s2": 4, "noise_s1": 1, "noise_s2": 3})
    base, bc = _records({"clean": 2, "blur_s1": 4, "blur_s2": 8, "noise_s1": 2, "noise_s2": 6})
    errors, baseline = error_table(model, mc), error_table(base, bc)
    assert errors.set_index("corruption").loc["clean", "error"] == pytest.approx(10.0)
    per = corruption_errors(errors, baseline).set_index("corruption")
    # CE_blur = (20 + 40) / (40 + 80); rCE_blur = ((20 - 10) + (40 - 10)) / ((40 - 20) + (80 - 20))
    assert per.loc["blur", "CE"] == pytest.approx(100 * 60 / 120)
    assert per.loc["blur", "relative_CE"] == pytest.approx(100 * 40 / 80)
    # CE_noise = (10 + 30) / (20 + 60); rCE_noise = (0 + 20) / (0 + 40)
    assert per.loc["noise", "CE"] == pytest.approx(100 * 40 / 80)
    assert per.loc["noise", "relative_CE"] == pytest.approx(100 * 20 / 40)
    summary = mce_summary(errors, baseline)
    assert summary["mCE"] == pytest.approx(50.0) and summary["relative_mCE"] == pytest.approx(50.0)
    assert summary["mean_error"] == pytest.approx((20 + 40 + 10 + 30) / 4) and summary["corruptions"] == 2
    # the baseline against itself: 100 everywhere
    assert mce_summary(baseline, baseline)["mCE"] == pytest.approx(100.0)


def test_mce_needs_the_baselines_conditions():
    model, mc = _records({"clean": 1, "blur_s1": 2, "fog_s1": 3})
    base, bc = _records({"clean": 2, "blur_s1": 4})
    with pytest.raises(ValueError, match="baseline has no records for"):
        mce_summary(error_table(model, mc), error_table(base, bc))
    same, _ = _records({"clean": 2, "blur_s1": 2})   # the baseline loses nothing: relative CE undefined
    assert np.isnan(corruption_errors(error_table(model, mc)[:2], error_table(same, bc))["relative_CE"].iloc[0])


# --- runs -----------------------------------------------------------------------------------------
def _synthetic(limit=10):
    return build_dataset("synthetic", split="test", limit=limit)


class Interrupting(torch.nn.Module):
    """A model that raises after ``calls`` forward passes (an interruption mid-run)."""

    def __init__(self, model, calls):
        super().__init__()
        self.model, self.calls = model, calls

    def forward(self, x):
        if self.calls == 0:
            raise KeyboardInterrupt("injected")
        self.calls -= 1
        return self.model(x)


@pytest.mark.parametrize("protocol", ["corruption", "occlusion", "shuffle"])
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, protocol):
    model = tiny_resnet()
    dataset = _synthetic()
    if protocol == "corruption":
        conditions = corruption_conditions("gaussian_noise,zoom_blur", [2, 5])
        run = lambda m, out: run_corruption(m, dataset, out, conditions=conditions, seed=4, batch_size=4,  # noqa: E731
                                            progress=False)
    elif protocol == "occlusion":
        conditions = occlusion_conditions([25], drop=[50], image_size=(32, 32))
        run = lambda m, out: run_occlusion(m, dataset, out, conditions=conditions, mean=(0.5, 0.5, 0.5),  # noqa: E731
                                           seed=4, batch_size=4, progress=False)
    else:
        conditions = shuffle_conditions([1, 2, 4], image_size=(32, 32))
        run = lambda m, out: run_shuffle(m, dataset, out, conditions=conditions, seed=4, batch_size=4,  # noqa: E731
                                         progress=False)
    run(model, tmp_path / "full")
    with pytest.raises(KeyboardInterrupt):
        run(Interrupting(model, 5), tmp_path / "resumed")
    with pytest.raises(ValueError, match="unfinished"):
        load_records(tmp_path / "resumed")
    run(model, tmp_path / "resumed")
    full = load_records(tmp_path / "full")
    pd.testing.assert_frame_equal(load_records(tmp_path / "resumed"), full)
    assert list(full["condition"].unique()) == [c["name"] for c in conditions]
    if protocol == "shuffle":   # g = 1 is the clean image
        by = full.pivot(index="index", columns="condition", values="pred")
        assert (by["shuffle1"] == by["clean"]).all()


def test_records_match_the_model_on_the_corrupted_images(tmp_path):
    model = tiny_resnet()
    dataset = _synthetic(6)
    conditions = corruption_conditions("contrast,shot_noise", [3])
    store = run_corruption(model, dataset, tmp_path / "run", conditions=conditions, seed=7, batch_size=4, progress=False)
    records = load_records(store.root)
    images = torch.stack([dataset[i][0] for i in range(6)])
    labels = torch.tensor([dataset[i][1] for i in range(6)])
    for name, severity in (("contrast", 3), ("shot_noise", 3)):
        corrupted = to_float(corrupt_batch(to_uint8(images), name, severity, indices=range(6), seed=7))
        with torch.no_grad():
            pred = model(corrupted).argmax(1)
        rec = records[records["condition"] == f"{name}_s{severity}"].sort_values("index")
        assert rec["pred"].tolist() == pred.tolist()
        assert rec["top1"].tolist() == (pred == labels).long().tolist()
    desc = json.loads((store.root / "run.json").read_text())
    assert desc["parameters"]["seed"] == 7 and desc["conditions"][1] == {"name": "contrast_s3", "corruption": "contrast",
                                                                         "severity": 3}


# --- the corrupted-set cache ----------------------------------------------------------------------
def test_cache_is_made_once_equals_on_the_fly_and_checks_its_files(tmp_path):
    dataset = _synthetic(7)
    key = {"name": "synthetic", "split": "test", "limit": 7}
    cache = CorruptionCache(tmp_path / "cache", dataset, key, seed=2, batch_size=3)
    pairs = [("gaussian_noise", 1), ("pixelate", 4)]
    cache.ensure(pairs)
    files = sorted(cache.root.glob("*.npy"))
    assert [f.name for f in files] == ["gaussian_noise-s1.npy", "pixelate-s4.npy"]
    stamps = [f.stat().st_mtime_ns for f in files]
    CorruptionCache(tmp_path / "cache", dataset, key, seed=2).ensure(pairs)   # a second model: nothing made
    assert [f.stat().st_mtime_ns for f in files] == stamps
    images = torch.stack([dataset[i][0] for i in range(7)])
    index = torch.tensor([4, 1, 6])
    for name, severity in pairs:
        assert np.array_equal(cache(name, severity, images[index], index),
                              OnTheFly(seed=2)(name, severity, images[index], index))
    # a run through the cache records what a run on the fly records
    model = tiny_resnet()
    conditions = corruption_conditions("gaussian_noise,pixelate", [1, 4])
    run_corruption(model, dataset, tmp_path / "fly", conditions=conditions, seed=2, batch_size=3, progress=False)
    run_corruption(model, dataset, tmp_path / "cached", conditions=conditions, seed=2, batch_size=3, progress=False,
                   source=CorruptionCache(tmp_path / "cache", dataset, key, seed=2, batch_size=3))
    pd.testing.assert_frame_equal(load_records(tmp_path / "fly"), load_records(tmp_path / "cached"))
    # a damaged file is an error naming it; repair makes it again
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0xFF
    files[0].write_bytes(bytes(data))
    with pytest.raises(ValueError, match="gaussian_noise-s1.npy is damaged"):
        CorruptionCache(tmp_path / "cache", dataset, key, seed=2).ensure(pairs)
    CorruptionCache(tmp_path / "cache", dataset, key, seed=2).ensure(pairs, repair=True)
    assert np.array_equal(np.load(files[0]), corrupt_batch(to_uint8(images), "gaussian_noise", 1, seed=2))
    # other images under the same key are refused
    with pytest.raises(ValueError, match="made from other images"):
        CorruptionCache(tmp_path / "cache", _synthetic(5), key, seed=2).ensure([("contrast", 1)])


# --- published layouts ------------------------------------------------------------------------------
def test_cifar10_c_layout(tmp_path):
    n = 4   # images per severity (10,000 in the real files)
    rng = np.random.default_rng(0)
    data = (rng.random((5 * n, 32, 32, 3)) * 255).astype(np.uint8)
    labels = np.tile(np.arange(n) % 10, 5)
    np.save(tmp_path / "fog.npy", data)
    np.save(tmp_path / "labels.npy", labels)
    reader = CifarC(tmp_path, per_severity=n)
    assert np.array_equal(reader.images("fog", 3, [0, 2]), data[[2 * n, 2 * n + 2]])
    assert reader.labels("fog", 5, [1]).tolist() == [labels[4 * n + 1]]
    with pytest.raises(FileNotFoundError, match="snow.npy not found"):
        reader.images("snow", 1, [0])
    np.save(tmp_path / "contrast.npy", data[:7])
    with pytest.raises(ValueError, match="5 severities"):
        reader.images("contrast", 1, [0])


def test_imagenet_c_layout(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(1)
    wnids = ["n01440764", "n01443537", "n01484850"]
    expected = []
    for label, wnid in enumerate(wnids):
        for k in range(2):
            image = (rng.random((8, 8, 3)) * 255).astype(np.uint8)
            folder = tmp_path / "glass_blur" / "2" / wnid
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / f"ILSVRC2012_val_{label}{k}.png")
            expected.append((image, label))
    reader = ImageNetC(tmp_path)
    got = reader.images("glass_blur", 2, [0, 3, 5])
    assert all(np.array_equal(g, expected[i][0]) for g, i in zip(got, [0, 3, 5]))
    assert reader.labels("glass_blur", 2, [0, 3, 5]).tolist() == [0, 1, 2]
    with pytest.raises(FileNotFoundError, match="<corruption>/<severity>/<wnid>"):
        reader.files("glass_blur", 3)


def test_published_images_are_evaluated_in_test_set_order(tmp_path):
    dataset = _synthetic(6)
    images = torch.stack([dataset[i][0] for i in range(6)])
    labels = np.array([dataset[i][1] for i in range(6)])
    published = np.concatenate([to_uint8(images.flip(-1)) for _ in range(5)])   # "corruption": a mirror image
    np.save(tmp_path / "contrast.npy", published)
    np.save(tmp_path / "labels.npy", np.tile(labels, 5))
    model = tiny_resnet()
    source = PublishedCorruptions(CifarC(tmp_path, per_severity=6))
    store = run_corruption(model, dataset, tmp_path / "run", conditions=corruption_conditions("contrast", [2]),
                           source=source, images="cifar10-c", batch_size=4, progress=False)
    with torch.no_grad():
        pred = model(images.flip(-1)).argmax(1)
    assert load_records(store.root).query("condition == 'contrast_s2'")["pred"].tolist() == pred.tolist()
    np.save(tmp_path / "labels.npy", np.tile(labels[::-1], 5))
    with pytest.raises(ValueError, match="not in the test set's order"):
        run_corruption(model, dataset, tmp_path / "run2", conditions=corruption_conditions("contrast", [2]),
                       source=PublishedCorruptions(CifarC(tmp_path, per_severity=6)), images="cifar10-c",
                       batch_size=4, progress=False)


# --- CLI -----------------------------------------------------------------------------------------------
def test_cli_runs_each_shift_and_the_report(tmp_path, capsys):
    runs = []
    for protocol, extra in (("corruption", ["--corruptions", "noise,contrast", "--severities", "1,5"]),
                            ("occlusion", ["--areas", "25", "--drop", "50", "--fill", "zeros"]),
                            ("shuffle", ["--grids", "1,4"])):
        out = tmp_path / protocol
        assert main(["eval", protocol, *TINY, "--limit", "4", "--batch-size", "2", *extra, "--out", str(out)]) == 0
        assert f"{protocol} resnet26 on synthetic/test (4 images" in capsys.readouterr().out
        runs.append(str(out))
    assert len(load_records(tmp_path / "corruption")["condition"].unique()) == 1 + 4 * 2
    assert main(["eval", "corruption", *TINY, "--limit", "4", "--batch-size", "2", "--corruptions", "noise,contrast",
                 "--severities", "1,5", "--out", str(tmp_path / "again"), "--baseline", runs[0],
                 "--cache", str(tmp_path / "cache")]) == 0
    assert "mCE 100.0, relative mCE" in capsys.readouterr().out   # the same model and images as its baseline
    pd.testing.assert_frame_equal(load_records(tmp_path / "again"), load_records(runs[0]))
    assert main(["report", *runs, "--out", str(tmp_path / "report"), "--bootstrap", "20"]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Common corruptions" in text and "## Occlusion" in text and "## Patch shuffle" in text
    for name in ("corruption_severity.png", "corruption_heatmap.png", "occlusion.png", "shuffle.png"):
        assert (tmp_path / "report" / name).is_file()
    table = pd.read_csv(tmp_path / "report" / "corruption_accuracy.csv")
    recs = load_records(runs[0])
    assert table.set_index("condition").loc["contrast_s5", "top1"] == pytest.approx(
        100 * recs.query("condition == 'contrast_s5'")["top1"].mean())


@pytest.mark.parametrize("argv,message", [
    (["corruption", "--corruptions", "gausian_noise"], "unknown corruption 'gausian_noise'. Did you mean 'gaussian_noise'"),
    (["corruption", "--severities", "1,6"], "severity must be an integer from 1 to 5"),
    (["corruption", "--severities", "x"], "--severities takes a comma-separated list of ints"),
    (["shuffle", "--grids", "3"], "a 3x3 grid does not divide the 32x32 image"),
    (["occlusion", "--drop-grid", "5"], "a 5x5 grid does not divide"),
    (["occlusion", "--areas", "0"], r"percentage in \(0, 100\]"),
    (["occlusion", "--areas", "150"], r"percentage in \(0, 100\]"),
    (["occlusion", "--fill", "grey"], "fill must be one of"),
])
def test_bad_input_is_a_clear_error(argv, message, capsys):
    assert main(["eval", *argv, *TINY, "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("robust-attn eval: error: ") and re.search(message, err), err


# --- the study ------------------------------------------------------------------------------------------
@pytest.fixture
def tiny_zoo(tmp_path):
    from robust_attn.models.checkpoint import save_checkpoint

    manifest_path = tmp_path / "zoo" / "manifest.json"
    for seed, name in enumerate(("resnet26", "sasa_resnet26")):
        model = tiny_resnet(seed=seed + 1) if name == "resnet26" else None
        if model is None:
            import robust_attn
            from robust_attn.models.wrapper import NormalizedModel

            torch.manual_seed(0)
            model = NormalizedModel(robust_attn.create_model(name, 10, "cifar", width=0.25, stem_downsample=4),
                                    (0.5,) * 3, (0.25,) * 3).eval()
        path = tmp_path / "ckpt" / f"{name}.safetensors"
        save_checkpoint(path, model)
        assert main(["zoo", "add", name, "--dataset", "synthetic", "--checkpoint", str(path),
                     "--manifest", str(manifest_path)]) == 0
    return manifest_path


def test_study_runs_the_shift_protocols_with_one_corrupted_set(tmp_path, tiny_zoo, monkeypatch):
    from robust_attn.shifts import cache as cache_module
    from robust_attn.study.config import StudyConfig
    from robust_attn.study.run import run_study

    made = []
    original = cache_module.CorruptionCache._make
    monkeypatch.setattr(cache_module.CorruptionCache, "_make", lambda self, pairs: (made.extend(pairs),
                                                                                    original(self, pairs)))
    config = StudyConfig(dataset="synthetic", limit=8, batch_size=4, bootstrap=20,
                         protocols=("corruption", "occlusion", "shuffle"), corruptions="gaussian_noise,contrast",
                         severities=(1, 3), occlusion_areas=(50.0,), shuffle_grids=(1, 4))
    runs, report = tmp_path / "runs", tmp_path / "report"
    files = run_study(config, runs, report, manifest=tiny_zoo, device="cpu", progress=False, log=lambda *_: None)
    assert sorted(made) == [("contrast", 1), ("contrast", 3), ("gaussian_noise", 1), ("gaussian_noise", 3)]  # once
    names = {f.name for f in files}
    assert {"corruption_summary.csv", "corruption_heatmap.png", "occlusion.png", "shuffle.png"} <= names
    summary = pd.read_csv(report / "corruption_summary.csv").set_index("model")
    assert summary.loc["resnet26", "mCE"] == pytest.approx(100.0)   # the baseline against itself
    errors = {m: error_table(load_records(runs / f"corruption-{m}"),
                             json.loads((runs / f"corruption-{m}" / "run.json").read_text())["conditions"])
              for m in ("resnet26", "sasa_resnet26")}
    expected = mce_summary(errors["sasa_resnet26"], errors["resnet26"])
    assert summary.loc["sasa_resnet26", "mCE"] == pytest.approx(expected["mCE"])
    assert summary.loc["sasa_resnet26", "relative_mCE"] == pytest.approx(expected["relative_mCE"], nan_ok=True)
    assert "## Common corruptions" in (report / "report.md").read_text()


def test_the_mce_baseline_is_the_model_the_study_labels_so(tmp_path, tiny_zoo):
    """A study names its models by label (``zoo:resnet26-efficient`` as ``resnet26``): the mCE's
    baseline is the run of that label, as the findings' baseline is, whatever its zoo entry."""
    from robust_attn.study.config import StudyConfig, StudyModel
    from robust_attn.study.run import run_study

    config = StudyConfig(dataset="synthetic", limit=8, batch_size=4, bootstrap=20, protocols=("corruption",),
                         corruptions="gaussian_noise,contrast", severities=(1, 3), baseline="conv",
                         models=(StudyModel("zoo:resnet26", label="conv"), StudyModel("zoo:sasa_resnet26",
                                                                                      label="attn")))
    runs, report = tmp_path / "runs", tmp_path / "report"
    run_study(config, runs, report, manifest=tiny_zoo, device="cpu", progress=False, log=lambda *_: None)
    summary = pd.read_csv(report / "corruption_summary.csv").set_index("model")
    errors = {m: error_table(load_records(runs / f"corruption-{m}"),
                             json.loads((runs / f"corruption-{m}" / "run.json").read_text())["conditions"])
              for m in ("conv", "attn")}
    assert summary.loc["conv", "mCE"] == pytest.approx(100.0)
    assert summary.loc["attn", "mCE"] == pytest.approx(mce_summary(errors["attn"], errors["conv"])["mCE"])


def test_two_weights_of_the_baseline_name_leave_the_mce_empty(tmp_path, tiny_zoo):
    """Two zoos in one report, each with its ``resnet26``: which one a third model's mCE is
    against is not said, so it is left empty (as the findings' paired differences are); each
    ``resnet26`` is its own baseline (100)."""
    from robust_attn.reports import make_report
    from robust_attn.study.config import StudyConfig, StudyModel
    from robust_attn.study.run import run_study

    common = dict(dataset="synthetic", limit=8, batch_size=4, bootstrap=20, protocols=("corruption",),
                  corruptions="gaussian_noise", severities=(1,))
    quiet = dict(manifest=tiny_zoo, device="cpu", progress=False, log=lambda *_: None)
    run_study(StudyConfig(**common, models=(StudyModel("zoo:resnet26"), StudyModel("zoo:sasa_resnet26"))),
              tmp_path / "a", tmp_path / "report_a", **quiet)
    swapped = (StudyModel("zoo:sasa_resnet26", label="resnet26"), StudyModel("zoo:resnet26", label="other"))
    run_study(StudyConfig(**common, baseline="resnet26", models=swapped), tmp_path / "b", tmp_path / "report_b",
              **quiet)
    make_report([tmp_path / "a" / "corruption-resnet26", tmp_path / "a" / "corruption-sasa_resnet26",
                 tmp_path / "b" / "corruption-resnet26"], tmp_path / "report", plots=False)
    summary = pd.read_csv(tmp_path / "report" / "corruption_summary.csv")
    assert summary.loc[summary["model"] == "resnet26", "mCE"].tolist() == pytest.approx([100.0, 100.0])
    assert summary.loc[summary["model"] == "sasa_resnet26", "mCE"].isna().all()


def test_study_makes_no_corrupted_images_for_finished_runs(tmp_path, tiny_zoo, monkeypatch):
    """A study resumed from finished (here: packed) corruption runs computes nothing, so it makes
    no corrupted copies and needs no frost photographs; a missing chunk makes only its own."""
    import shutil

    from robust_attn.shifts import cache as cache_module
    from robust_attn.shifts.corruptions import weather
    from robust_attn.study.config import StudyConfig
    from robust_attn.study.run import run_study

    config = StudyConfig(dataset="synthetic", limit=8, batch_size=4, bootstrap=20, protocols=("corruption",),
                         corruptions="gaussian_noise,contrast", severities=(1,))
    runs, report = tmp_path / "runs", tmp_path / "report"
    run_study(config, runs, report, manifest=tiny_zoo, device="cpu", progress=False, log=lambda *_: None)
    made, original = [], cache_module.CorruptionCache._make
    monkeypatch.setattr(cache_module.CorruptionCache, "_make", lambda self, pairs: made.extend(pairs))
    again = tmp_path / "again"
    again.mkdir()
    for packed in (report / "runs").iterdir():
        shutil.copytree(packed, again / packed.name)
    run_study(config, again, tmp_path / "report2", manifest=tiny_zoo, device="cpu", progress=False,
              log=lambda *_: None)
    assert made == [] and not (again / "corruptions").exists()
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "report2" / "corruption_summary.csv"),
                                  pd.read_csv(report / "corruption_summary.csv"))

    def no_frost():
        raise AssertionError("frost's photographs were looked for")

    monkeypatch.setattr(weather, "frost_dir", no_frost)
    with_frost = StudyConfig(**{**config.__dict__, "corruptions": "frost"})
    with pytest.raises(AssertionError, match="frost's photographs"):   # a run to compute needs them
        run_study(with_frost, tmp_path / "fresh", None, manifest=tiny_zoo, device="cpu", progress=False,
                  log=lambda *_: None)
    # one chunk deleted from an unpacked run: only its condition's images are made again
    monkeypatch.undo()
    made.clear()
    monkeypatch.setattr(cache_module.CorruptionCache, "_make", lambda self, pairs: (made.extend(pairs),
                                                                                    original(self, pairs)))
    chunk = sorted((runs / "corruption-resnet26" / "records" / "contrast_s1").iterdir())[0]
    chunk.unlink()
    shutil.rmtree(runs / "corruptions")
    run_study(config, runs, report, manifest=tiny_zoo, device="cpu", progress=False, log=lambda *_: None)
    assert made == [("contrast", 1)]


def test_study_refuses_bad_shift_settings(tiny_zoo, capsys):
    for option, value, message in (("--corruptions", "fgo", "Did you mean 'fog'"), ("--severities", "0", "from 1 to 5"),
                                   ("--shuffle-grids", "0", "positive whole number"),
                                   ("--shuffle-grids", "3", "does not divide the 32x32 image"),
                                   ("--occlusion-areas", "101", r"\(0, 100\]")):
        assert main(["study", "--dataset", "synthetic", "--manifest", str(tiny_zoo), option, value]) == 2
        err = capsys.readouterr().err
        assert err.startswith("robust-attn study: error: ") and re.search(message, err), err


@pytest.mark.slow   # ~40 s: two torchrun processes on a shared machine
def test_torchrun_two_ranks_share_the_cache_and_merge_to_the_single_process_run(tmp_path):
    import subprocess
    import sys

    from helpers import REPO, subprocess_env

    args = ["eval", "corruption", *TINY, "--limit", "6", "--batch-size", "2", "--device", "cpu",
            "--corruptions", "gaussian_noise,glass_blur", "--severities", "2,4"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "robust_attn.cli",
           *args, "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "ddp")]
    result = subprocess.run(cmd, env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("corruption resnet26 on synthetic/test (6 images") == 1   # rank 0 only
    assert len(list((tmp_path / "cache").rglob("*.npy"))) == 4
    assert main([*args, "--out", str(tmp_path / "single")]) == 0
    pd.testing.assert_frame_equal(load_records(tmp_path / "ddp"), load_records(tmp_path / "single"))


def test_cache_waits_for_a_file_another_process_holds_and_makes_it_if_that_process_dies(tmp_path):
    import fcntl
    import threading
    import time

    dataset = _synthetic(4)
    key = {"name": "synthetic", "split": "test", "limit": 4}
    cache = CorruptionCache(tmp_path, dataset, key, seed=0)
    held = cache.path("contrast", 2)
    held.parent.mkdir(parents=True)
    lock = open(held.with_name(f".{held.name}.lock"), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)   # "another process" is making contrast-s2
    worker = threading.Thread(target=cache.ensure, args=([("contrast", 2), ("fog", 1)],))
    worker.start()
    deadline = time.time() + 60
    while not cache.path("fog", 1).is_file() and time.time() < deadline:
        time.sleep(0.05)
    assert cache.path("fog", 1).is_file() and not held.is_file() and worker.is_alive()   # made its own, now waits
    lock.close()   # the other process dies without making its file
    worker.join(60)
    assert not worker.is_alive() and held.is_file()


def test_to_uint8_rounds_to_the_nearest_grey_level():

    levels = torch.arange(256, dtype=torch.float32)
    # just below and just above each level: both must map back to that level
    below = ((levels - 0.3).clamp(0, 255) / 255).view(1, 1, 16, 16).expand(1, 3, 16, 16)
    above = ((levels + 0.3).clamp(0, 255) / 255).view(1, 1, 16, 16).expand(1, 3, 16, 16)
    expected = np.arange(256, dtype=np.uint8).reshape(16, 16)
    for images in (below, above):
        out = to_uint8(images)
        assert out.shape == (1, 16, 16, 3) and out.dtype == np.uint8
        assert (out[0, ..., 0] == expected).all()
    # and a uint8 image survives the round trip through float exactly
    pixels = np.arange(256 * 3, dtype=np.int64).reshape(1, 16, 16, 3).astype(np.uint8)
    assert np.array_equal(to_uint8(to_float(pixels)), pixels)


def test_cache_made_from_other_images_is_refused(tmp_path):

    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=gen)
    b = a.clone()
    b[0, 0, 0, 0] ^= 1     # one grey level of one pixel differs: other images, same count and shape
    labels = torch.arange(4)
    key = {"name": "tiny", "split": "test", "limit": None}
    CorruptionCache(tmp_path, TensorImageDataset(a, labels), key).ensure([("contrast", 1)])
    other = CorruptionCache(tmp_path, TensorImageDataset(b, labels), key)
    with pytest.raises(ValueError, match="made from other images.*clean_sha256"):
        other.ensure([("contrast", 2)])


def test_shift_records_count_a_label_in_the_five_best_as_a_top5_hit():
    from robust_attn.protocols.shift_runner import prediction_records

    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 2.0, 1.0, -1.0],     # label 2: second best
                           [0.0, 5.0, 4.0, 3.0, 2.0, 1.0, -1.0],     # label 6: last, outside the five
                           [9.0, 5.0, 4.0, 3.0, 2.0, 1.0, -1.0]])    # label 0: best
    records = prediction_records(logits, torch.tensor([2, 6, 0]), torch.tensor([10, 11, 12]))
    assert records["top1"].tolist() == [0, 0, 1]
    assert records["top5"].tolist() == [1, 0, 1]
    assert records["pred"].tolist() == [1, 1, 0] and records["index"].tolist() == [10, 11, 12]


def test_imagenet_c_files_are_sorted_within_each_class(tmp_path, monkeypatch):
    from pathlib import Path

    for wnid in ("n01440764", "n01443537"):
        folder = tmp_path / "fog" / "1" / wnid
        folder.mkdir(parents=True)
        for k in range(5):
            (folder / f"ILSVRC2012_val_{wnid[-2:]}{k}.JPEG").write_bytes(b"")
    real = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(sorted(real(self), reverse=True)))   # any listing order
    files = ImageNetC(tmp_path).files("fog", 1)
    names = [f.name for f, _ in files]
    assert [label for _, label in files] == [0] * 5 + [1] * 5
    assert names[:5] == sorted(names[:5]) and names[5:] == sorted(names[5:])


def test_published_images_of_another_size_are_refused(tmp_path):

    n = 3
    np.save(tmp_path / "fog.npy", np.zeros((5 * n, 16, 16, 3), dtype=np.uint8))
    np.save(tmp_path / "labels.npy", np.zeros(5 * n, dtype=np.int64))
    source = PublishedCorruptions(CifarC(tmp_path, per_severity=n))
    images = torch.zeros(2, 3, 32, 32)
    with pytest.raises(ValueError, match="16x16, the test images 32x32"):
        source("fog", 1, images, torch.tensor([0, 1]), labels=torch.tensor([0, 0]))


def test_published_subset_reads_the_positions_of_the_limited_set(tmp_path):

    n = 4
    data = np.arange(5 * n, dtype=np.uint8).repeat(8 * 8 * 3).reshape(5 * n, 8, 8, 3)   # item k is all k
    np.save(tmp_path / "fog.npy", data)
    np.save(tmp_path / "labels.npy", np.zeros(5 * n, dtype=np.int64))    # one class: the label check cannot help
    source = PublishedCorruptions(CifarC(tmp_path, per_severity=n), positions=[1, 3])
    out = source("fog", 2, torch.zeros(2, 3, 8, 8), torch.tensor([0, 1]), labels=torch.tensor([0, 0]))
    assert out[:, 0, 0, 0].tolist() == [n + 1, n + 3]


def test_cache_file_damaged_after_it_was_made_is_refused_when_read(tmp_path):

    gen = torch.Generator().manual_seed(0)
    dataset = TensorImageDataset(torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=gen),
                                 torch.arange(4))
    key = {"name": "tiny", "split": "test", "limit": None}
    maker = CorruptionCache(tmp_path, dataset, key)
    maker.ensure([("contrast", 3)])
    path = maker.path("contrast", 3)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF                                  # one pixel of the last image changed on disk
    path.write_bytes(bytes(raw))
    reader = CorruptionCache(tmp_path, dataset, key)   # another process (a study worker) reads it
    images = torch.stack([dataset[i][0] for i in range(4)])
    with pytest.raises(ValueError, match="is damaged"):
        reader("contrast", 3, images, torch.arange(4))
