"""Nothing silently wrong: bad checkpoints, sidecars and manifests are clear errors
that name the fix (exit code 2 through the CLI, no traceback); reports tell apart runs of one
model and show top-5 only where it means something; long silent phases say what they do; a
model whose output does not fit the dataset is refused whatever its source."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import torch.nn as nn

from robust_attn.models.checkpoint import (CheckpointError, check_num_classes, check_safetensors_file, load_checkpoint,
                                    save_checkpoint, sidecar_path)
from robust_attn.cli import main
from robust_attn.data import build_dataset
from robust_attn.data.base import TensorImageDataset
from robust_attn.protocols.pgd import AttackSetting, run_pgd
from robust_attn.protocols.rotation import run_rotation
from robust_attn.shifts.rotation import rotation_conditions
from robust_attn.models.registry import create_model
from robust_attn.reports import make_report
from robust_attn.reports.runs import distinct_labels, load_runs
from robust_attn.sources.contract import clearly_higher
from robust_attn.reports.tables import TOP5_NA, format_pgd, format_rotation, pgd_table, rotation_table
from robust_attn.runs.store import load_records
from robust_attn.utils.io import sha256_file
from test_study import tiny_zoo  # noqa: F401  (the fixture: a zoo of two tiny synthetic-data models)
from robust_attn.models.wrapper import NormalizedModel

EVAL = ["eval", "rotation", "--dataset", "synthetic", "--limit", "2", "--batch-size", "2", "--angle-step", "0",
        "--no-progress"]


def _tiny_resnet(num_classes=10):
    return NormalizedModel(create_model("resnet26", num_classes, "cifar", width=0.25, stem_downsample=4),
                           (0.5,) * 3, (0.25,) * 3).eval()


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid checkpoint: its weights' bytes and its sidecar's text."""
    path = tmp_path_factory.mktemp("good") / "m.safetensors"
    torch.manual_seed(0)
    model = _tiny_resnet()
    save_checkpoint(path, model)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    legacy = io.BytesIO()
    torch.save(model.state_dict(), legacy, _use_new_zipfile_serialization=False)
    return {"weights": path.read_bytes(), "sidecar": sidecar_path(path).read_text(), "zip": buf.getvalue(),
            "pickle": legacy.getvalue()}


def _sidecar_with(good, **changes):
    meta = json.loads(good["sidecar"])
    for key, value in changes.items():
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    return json.dumps(meta)


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


# (case, weights bytes, sidecar text, words the message must hold: the cause and the fix)
CASES = [
    ("html page", lambda g: b"<!DOCTYPE html>\n<html><head><title>Sign in</title></head></html>", None,
     ["not a safetensors file", "HTML", "download it again"]),
    ("html page, no doctype", lambda g: b"  \n<html lang='en'><body>quota exceeded</body></html>", None,
     ["HTML", "download it again"]),
    ("torch zip (.pth)", lambda g: g["zip"], None, ["torch.save", "convert it", "save_checkpoint"]),
    ("legacy torch pickle", lambda g: g["pickle"], None, ["pickle", "convert it"]),
    ("git lfs pointer", lambda g: b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 1\n", None,
     ["Git LFS", "git lfs pull"]),
    ("truncated in the data", lambda g: _half(g["weights"]), None, ["truncated", "download or train it again"]),
    ("truncated in the header", lambda g: g["weights"][:100], None, ["truncated", "download or train it again"]),
    ("empty file", lambda g: b"", None, ["empty", "download or train it again"]),
    ("sidecar not json", lambda g: g["weights"], lambda g: g["sidecar"][:-20], ["not valid JSON", "train it again"]),
    ("sidecar lacks keys", lambda g: g["weights"], lambda g: _sidecar_with(g, std=None),
     ["lacks std", "train it again"]),
    ("sidecar arch lacks keys", lambda g: g["weights"], lambda g: _sidecar_with(g, arch={"name": "resnet26"}),
     ["arch.num_classes", "arch.resolution"]),
    ("sidecar records another sha256", lambda g: g["weights"], lambda g: _sidecar_with(g, sha256="0" * 64),
     ["records", "pair written together"]),
]


@pytest.mark.parametrize("case,weights,sidecar,words", CASES, ids=[c[0] for c in CASES])
def test_bad_checkpoint_is_a_clear_cli_error(case, weights, sidecar, words, good, tmp_path, capsys):
    path = tmp_path / "model.safetensors"
    path.write_bytes(weights(good))
    sidecar_path(path).write_text(sidecar(good) if sidecar else good["sidecar"])
    assert main([*EVAL, "--checkpoint", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("robust-attn eval: error:") and "Traceback" not in err
    assert str(path) in err or str(sidecar_path(path)) in err   # names the faulty file
    for word in words:
        assert word in err, (word, err)
    assert not (tmp_path / "run").exists()   # refused before anything was written


def test_the_good_checkpoint_still_loads(good, tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(good["weights"])
    sidecar_path(path).write_text(good["sidecar"])
    check_safetensors_file(path)
    reference = _tiny_resnet()   # the same weights through torch's own (zip) loader
    reference.load_state_dict(torch.load(io.BytesIO(good["zip"]), weights_only=True))
    x = torch.rand(2, 3, 32, 32)
    torch.testing.assert_close(load_checkpoint(path)(x), reference(x), rtol=0, atol=0)


def test_trailing_bytes_are_refused(good, tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(good["weights"] + b"\0" * 16)
    sidecar_path(path).write_text(good["sidecar"])
    with pytest.raises(CheckpointError, match="16 bytes after"):
        load_checkpoint(path)


def test_manifest_with_a_wrong_sha256_names_the_fix(good, tmp_path, monkeypatch, capsys):
    path = tmp_path / "zoo" / "resnet26.safetensors"
    path.parent.mkdir()
    path.write_bytes(good["weights"])
    sidecar_path(path).write_text(good["sidecar"])
    arch = json.loads(good["sidecar"])["arch"]
    manifest = tmp_path / "zoo" / "manifest.json"
    entry = {"name": "resnet26", "dataset": "synthetic", "weights": "resnet26.safetensors", "sha256": "f" * 64,
             "arch": arch}
    manifest.write_text(json.dumps({"models": [entry]}))
    monkeypatch.setenv("ROBUST_ATTN_ZOO_MANIFEST", str(manifest))
    assert main([*EVAL, "--zoo", "--model", "resnet26", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "sha256" in err and "the manifest" in err and "robust-attn zoo add" in err
    # with the right hash the same entry evaluates
    manifest.write_text(json.dumps({"models": [dict(entry, sha256=sha256_file(path))]}))
    assert main([*EVAL, "--zoo", "--model", "resnet26", "--out", str(tmp_path / "run")]) == 0


@pytest.mark.parametrize("text,words", [("<!DOCTYPE html><html></html>", "not valid JSON"),
                                        ('[{"name": "resnet26"}]', 'must be an object {"models": [...]}')],
                         ids=["html", "a list"])
def test_a_manifest_that_is_not_one_is_a_clear_error(text, words, tmp_path, monkeypatch, capsys):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(text)
    monkeypatch.setenv("ROBUST_ATTN_ZOO_MANIFEST", str(manifest))
    assert main([*EVAL, "--zoo", "--model", "resnet26", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert str(manifest) in err and words in err and "robust-attn zoo add" in err


# --- model / dataset consistency ---------------------------------------------------------------
def _head(num_classes):
    net = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(4, num_classes))
    return NormalizedModel(net, (0.5,) * 3, (0.25,) * 3)


def test_check_num_classes_forward_and_mode():
    model = _head(7).train()
    check_num_classes(model, 7, "model m")
    assert model.training   # the caller's mode is restored
    with pytest.raises(CheckpointError, match=r"model m outputs 7 classes but the dataset has 10"):
        check_num_classes(model, 10, "model m")
    flat = NormalizedModel(nn.Sequential(nn.Conv2d(3, 2, 3)), (0.5,) * 3, (0.25,) * 3)
    with pytest.raises(CheckpointError, match="not \\(1, classes\\) logits"):
        check_num_classes(flat, 10, "model f")


def test_eval_refuses_a_model_that_does_not_fit_the_dataset_whatever_its_source(tmp_path, monkeypatch, capsys):
    """Whatever a source returns (a zoo entry, a torchvision model, a future source registered
    later: here a stand-in) goes through the check of load_model_spec before any image is read."""
    import robust_attn.sources as sources

    sources.list_sources()   # the real sources first, so the stand-in is one more
    sources.SOURCES.register("other", sources.Source(lambda request: sources.LoadedModel(
        _head(5).eval(), None, {"model": "other", "arch": {}, "checkpoint": None, "weights_origin": "user",
                                  "weights_sha256": "0" * 64})))
    try:
        assert main([*EVAL, "--model", "other:m", "--out", str(tmp_path / "run")]) == 2
    finally:
        sources.SOURCES.remove("other")
    err = capsys.readouterr().err
    assert "model other:m outputs 5 classes but the dataset has 10" in err and "trained on" in err
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_of_another_dataset_is_refused(tmp_path, capsys):
    path = tmp_path / "m5.safetensors"
    save_checkpoint(path, _tiny_resnet(num_classes=5))
    assert main([*EVAL, "--checkpoint", str(path), "--out", str(tmp_path / "run")]) == 2
    assert "5 classes but dataset synthetic has 10" in capsys.readouterr().err


def test_a_checkpoint_trained_on_another_dataset_is_refused_unless_asked(tmp_path, capsys):
    """Same class count, other dataset (e.g. a Fashion-MNIST model on CIFAR-10): silently wrong
    before; now an error naming both fixes, and --other-dataset measures it on purpose."""
    path = tmp_path / "fm.safetensors"
    save_checkpoint(path, _tiny_resnet(), meta={"dataset": "fashion_mnist"})
    assert main([*EVAL, "--checkpoint", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "trained on fashion_mnist" in err and "--dataset fashion_mnist" in err and "--other-dataset" in err
    assert not (tmp_path / "run").exists()
    assert main([*EVAL, "--checkpoint", str(path), "--other-dataset", "--out", str(tmp_path / "run")]) == 0
    assert main(["eval", "transfer", "--dataset", "synthetic", "--limit", "2", "--no-progress", "--source", str(path),
                 "--target", str(path), "--out", str(tmp_path / "transfer")]) == 2
    assert "trained on fashion_mnist" in capsys.readouterr().err


def test_a_checkpoint_alone_names_its_architecture(tmp_path, capsys):
    """``eval --checkpoint PATH`` without --model (the README's step by step) loads the sidecar's
    architecture."""
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, _tiny_resnet(), meta={"dataset": "synthetic"})
    assert main([*EVAL, "--checkpoint", str(path), "--out", str(tmp_path / "run")]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "run.json").read_text())["model"] == "resnet26"


@pytest.mark.parametrize("argv, words", [
    (["eval", "pgd", "--eps", "300/255"], "more than the whole [0, 1] pixel range"),
    (["eval", "pgd", "--eps", "8/255", "--step", "400/255", "--steps", "1"], "more than the whole [0, 1] pixel range"),
    (["eval", "pgd", "--eps", "8"], "of 255 grey levels write 8/255"),
    (["eval", "attack", "--attack", "pgd", "--eps", "8"], "of 255 grey levels write 8/255"),
])
def test_pgd_eps_beyond_the_pixel_range_is_refused(argv, words, tmp_path, capsys):
    base = ["--model", "resnet26", "--model-args", "width=0.25", "stem_downsample=4", "--dataset", "synthetic",
            "--limit", "2", "--no-progress", "--out", str(tmp_path / "o")]
    assert main([*argv, *base]) == 2
    assert words in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_a_warning_is_one_line_naming_the_command(tmp_path, capsys):
    argv = ["eval", "attack", "--model", "resnet26", "--model-args", "width=0.25", "stem_downsample=4", "--dataset",
            "synthetic", "--limit", "2", "--no-progress", "--no-checks", "--attack", "pgd", "--norm", "l2", "--eps",
            "0.5/255", "--steps", "1", "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("robust-attn eval: warning: L2 eps") == 1 and "Warning:" not in err


# --- long phases say what they do ------------------------------------------------------------
def test_pgd_start_up_announces_its_sanity_checks(tmp_path, capsys):
    argv = ["eval", "pgd", "--model", "resnet26", "--model-args", "width=0.25", "stem_downsample=4",
            "--dataset", "synthetic", "--limit", "2", "--batch-size", "2", "--eps", "8/255", "--steps", "1"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "pgd: sanity checks on the first 2 images" in err
    assert err.index("pgd: sanity checks") < err.index("pgd:", err.index("pgd: sanity checks") + 1)  # before the bar
    assert main([*argv, "--no-progress", "--out", str(tmp_path / "b")]) == 0
    assert "sanity checks" not in capsys.readouterr().err   # --no-progress: quiet


def test_cpu_kernel_first_build_is_announced(tmp_path, monkeypatch, capsys):
    from robust_attn.layers import cpu_kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    cpu_kernels._announce_build("robust_attn_cpu_kernels_test")
    err = capsys.readouterr().err
    assert "compiling the CPU kernels (first use, about a minute; cached in" in err and str(tmp_path) in err
    built = tmp_path / "robust_attn_cpu_kernels_test" / "robust_attn_cpu_kernels_test.so"
    built.parent.mkdir(exist_ok=True)
    built.write_bytes(b"")   # a build newer than the sources: cached, nothing to say
    cpu_kernels._announce_build("robust_attn_cpu_kernels_test")
    assert "compiling" not in capsys.readouterr().err


# --- reports -----------------------------------------------------------------------------------
def _tiny(num_classes=10):
    torch.manual_seed(0)
    return _head(num_classes).eval()


def _info(dataset="synthetic", limit=None, sha=None, **extra):
    return {"model": "resnet26", "dataset": {"name": dataset, "split": "test", "limit": limit, **extra},
            "checkpoint": {"path": "x.safetensors", "sha256": sha} if sha else None}


SETTINGS = [AttackSetting(8, 4, 2), AttackSetting(8, 2, 4)]


def test_runs_of_one_model_on_other_images_or_weights_get_distinct_labels(tmp_path):
    data8 = build_dataset("synthetic", split="test", limit=8)
    data4 = build_dataset("synthetic", split="test", limit=4)
    kw = dict(num_classes=10, batch_size=4, settings=SETTINGS, progress=False, checks=False)
    dirs = [run_pgd(_tiny(), data8, tmp_path / "p8", run_info=_info(limit=8, sha="a" * 64), **kw).root,
            run_pgd(_tiny(), data4, tmp_path / "p4", run_info=_info(limit=4, sha="a" * 64), **kw).root,
            run_pgd(_tiny(), data4, tmp_path / "p4b", run_info=_info(limit=4, sha="b" * 64), **kw).root]
    shown = format_pgd(pgd_table(load_runs(dirs)))
    labels = shown["Method"].tolist()
    assert len(set(labels)) == 3, labels
    assert labels[0] == "resnet26 [synthetic] (n=8, ckpt aaaaaaaa)"
    assert labels[1] == "resnet26 [synthetic] (n=4, ckpt aaaaaaaa)"
    assert labels[2] == "resnet26 [synthetic] (n=4, ckpt bbbbbbbb)"
    # one run alone keeps the plain label
    assert format_pgd(pgd_table(load_runs(dirs[:1])))["Method"].tolist() == ["resnet26 [synthetic]"]
    files = make_report(dirs, tmp_path / "report", n_boot=50, plots=False)
    md = (tmp_path / "report" / "table10_pgd.md").read_text()
    assert all(f"| {label} |" in md for label in labels)
    ci_labels = set(__import__("pandas").read_csv(tmp_path / "report" / "headline_ci.csv")["label"])
    assert ci_labels == set(labels)
    assert tmp_path / "report" / "report.md" in files


def test_distinct_labels_fall_back_to_the_run_name():
    same = {"split": "test", "images": "n=4", "weights": "ckpt aaaaaaaa"}
    assert distinct_labels([("m", same, "run1"), ("m", same, "run2"), ("x", same, "run3")]) == [
        "m (run1)", "m (run2)", "x"]
    other = dict(same, images="n=8")
    assert distinct_labels([("m", same, "r1"), ("m", same, "r2"), ("m", other, "r3")]) == [
        "m (n=4, r1)", "m (n=4, r2)", "m (n=8)"]


def _four_class_data(n=8):
    gen = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (n, 3, 32, 32), generator=gen, dtype=torch.uint8)
    return TensorImageDataset(images, torch.arange(n) % 4)


@pytest.mark.parametrize("recorded", [True, False], ids=["num_classes recorded", "inferred from records"])
def test_top5_is_na_with_five_classes_or_fewer(tmp_path, recorded):
    extra = {"num_classes": 4} if recorded else {}
    few = run_rotation(_tiny(4), _four_class_data(), tmp_path / "few", conditions=rotation_conditions(0),
                       batch_size=4, run_info=_info("four_shapes", **extra), progress=False).root
    many = run_rotation(_tiny(10), build_dataset("synthetic", split="test", limit=8), tmp_path / "many",
                        conditions=rotation_conditions(0), batch_size=4, run_info=_info(), progress=False).root
    table = rotation_table(load_runs([few, many]))
    shown = format_rotation(table)
    top5_cols = [c for c in shown.columns if c.endswith("top-5")]
    assert (shown.loc[0, top5_cols] == TOP5_NA).all()          # 4 classes: top-5 is always 100%
    assert table.loc[0, "num_classes"] == 4 and not table.loc[0, "top5_meaningful"]
    assert table.loc[0, [c for c in table.columns if "top5" in c and c != "top5_meaningful"]].isna().all()
    assert table.loc[1, "none_top5"] == table.loc[1, "none_top5"]   # 10 classes: a number, shown as one
    assert shown.loc[1, "no rotation top-5"] == f"{table.loc[1, 'none_top5']:.1f}"
    assert shown.loc[0, "no rotation top-1"] == f"{table.loc[0, 'none_top1']:.1f}"  # top-1 still shown
    make_report([few, many], tmp_path / "report", n_boot=20, plots=True)
    md = (tmp_path / "report" / "table9_rotation.md").read_text()
    assert md.count(TOP5_NA) == 5 and "| 100.0 |" not in md.splitlines()[2]
    sweep = __import__("pandas").read_csv(tmp_path / "report" / "rotation_conditions.csv")
    assert sweep.loc[sweep["dataset"] == "four_shapes", "top5"].isna().all()
    assert sweep.loc[sweep["dataset"] == "synthetic", "top5"].notna().all()


# --- a user's model at real resolution: every fault a clear error or a correct result -------------
TINY_ARGS = ["--model", "resnet26", "--model-args", "width=0.25", "stem_downsample=4", "--dataset", "synthetic",
             "--limit", "2", "--batch-size", "2", "--no-progress"]

UNIT_MODEL = '''
import torch
import torch.nn as nn

from robust_attn.data.synthetic import class_patterns


class NearestColour(nn.Module):
    """The class whose pattern's mean colour is nearest, on [0, 1] images (RobustBench's
    convention: it takes [0, 1] input and does its own preprocessing)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("colours", class_patterns().mean((2, 3)))

    def forward(self, x):
        return -100 * torch.cdist(x.mean((2, 3)), self.colours)


def build(num_classes=10):
    return NearestColour()


def declared(num_classes=10):
    model = NearestColour()
    model.input_range = "unit"
    return model


class NormalizedNearestColour(NearestColour):
    """The same rule on images normalized with the synthetic set's mean 0.5 and std 0.25."""

    def forward(self, x):
        return super().forward(x * 0.25 + 0.5)


def normalized(num_classes=10):
    return NormalizedNearestColour()


def dropout(num_classes=10):
    class Noisy(NearestColour):
        def forward(self, x):
            return torch.nn.functional.dropout(super().forward(x), 0.5, training=True)

    return Noisy()
'''


@pytest.fixture()
def unit_file(tmp_path):
    path = tmp_path / "unit_model.py"
    path.write_text(UNIT_MODEL)
    return path


def _nearest_colour_top1(n=100):
    """Top-1 of the nearest-colour rule on the first n test images, computed here on [0, 1] images."""
    from robust_attn.data.synthetic import class_patterns

    data = build_dataset("synthetic", split="test", limit=n)
    images = torch.stack([data[i][0] for i in range(n)])
    labels = torch.tensor([data[i][1] for i in range(n)])
    pred = torch.cdist(images.mean((2, 3)), class_patterns().mean((2, 3))).argmin(1)
    return 100.0 * float((pred == labels).double().mean())


@pytest.mark.parametrize("other,assumed,n,higher", [
    (15, 5, 100, True), (14, 5, 100, False),        # 10 points (and 10 images) above; 9 points
    (5, 0, 20, True), (4, 0, 20, False),            # 5 images (25 points) above; 4 images (20 points)
    (130, 100, 300, True), (129, 100, 300, False),  # 30 images = 10 points of 300; 29
])
def test_the_probe_calls_a_score_clearly_higher_at_five_images_and_ten_points(other, assumed, n, higher):
    """The input-contract probe refuses an undeclared model when its top-1 on [0, 1] images is
    clearly above its top-1 on normalized ones: by at least 5 images and 10 percentage points."""
    assert clearly_higher(other, assumed, n) is higher


def test_an_undeclared_unit_model_is_refused_naming_the_flag(unit_file, tmp_path, capsys):
    """A file model that takes [0, 1] images, without a declaration: the probe of the first 64
    images scores it both ways and stops, naming --model-input unit; with the flag (or its
    input_range attribute) it scores what the rule scores on [0, 1] images."""
    argv = ["eval", "rotation", "--model", f"{unit_file}:build", "--dataset", "synthetic", "--limit", "100",
            "--batch-size", "50", "--angle-step", "0", "--no-hflip", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "probe")]) == 2
    err = capsys.readouterr().err
    assert "--model-input unit" in err and "64 of 64 on [0, 1] images" in err and "Traceback" not in err
    assert not (tmp_path / "probe").exists()
    expected = _nearest_colour_top1()
    shas = []
    for extra, spec, origin in ((["--model-input", "unit"], f"{unit_file}:build", "flag"),
                                ([], f"{unit_file}:declared", "declaration")):
        out = tmp_path / origin
        argv[3] = spec
        assert main([*argv, *extra, "--out", str(out)]) == 0
        err = capsys.readouterr().err
        assert "model input: [0, 1] images (it normalizes inside)" in err
        desc = json.loads((out / "run.json").read_text())
        assert desc["input_contract"] == "unit" and desc["input_contract_from"]["from"] == origin
        records = __import__("robust_attn.runs.store", fromlist=["load_records"]).load_records(out)
        assert 100 * records.loc[records["condition"] == "none", "top1"].mean() == pytest.approx(expected)
        shas.append(desc["weights_sha256"])
    assert expected > 90
    # the recorded sha256 is of the model as evaluated, its normalization left out: the same for the flag and
    # the declaration, another for the same function evaluated on normalized images
    argv[3] = f"{unit_file}:build"
    assert main([*argv, "--model-input", "normalized", "--out", str(tmp_path / "normalized")]) == 0
    normalized = json.loads((tmp_path / "normalized" / "run.json").read_text())["weights_sha256"]
    assert shas[0] == shas[1] != normalized


def test_an_undeclared_normalized_model_passes_the_probe_and_is_evaluated_normalized(unit_file, tmp_path, capsys):
    """The probe scores the model both ways and then puts its normalization back: the run scores
    what the rule scores on normalized images, not what the probe's [0, 1] pass scored."""
    out = tmp_path / "n"
    assert main(["eval", "rotation", "--model", f"{unit_file}:normalized", "--dataset", "synthetic", "--limit", "100",
                 "--batch-size", "50", "--angle-step", "0", "--no-hflip", "--no-progress", "--out", str(out)]) == 0
    desc = json.loads((out / "run.json").read_text())
    assert desc["input_contract"] == "normalized" and desc["input_contract_from"]["from"] == "probe"
    probe = desc["input_contract_from"]["probe"]
    assert probe["images"] == 64 and probe["normalized_correct"] == 64 * _nearest_colour_top1(64) / 100
    assert probe["unit_correct"] < probe["normalized_correct"] - 10
    records = __import__("robust_attn.runs.store", fromlist=["load_records"]).load_records(out)
    assert 100 * records.loc[records["condition"] == "none", "top1"].mean() == pytest.approx(_nearest_colour_top1())


def test_a_normalized_model_is_probed_and_recorded(tmp_path, capsys):
    """The registry's models take normalized input by their source's convention (no probe)."""
    assert main(["eval", "rotation", *TINY_ARGS, "--angle-step", "0", "--out", str(tmp_path / "r")]) == 0
    assert "model input: normalized images (robust-attn applies the mean/std) (the registry convention)" in \
        capsys.readouterr().err
    assert json.loads((tmp_path / "r" / "run.json").read_text())["input_contract"] == "normalized"
    assert main(["eval", "rotation", *TINY_ARGS, "--model-input", "unit", "--out", str(tmp_path / "u")]) == 2
    assert "--model-input unit is for a FILE.py:FUNCTION" in capsys.readouterr().err


@pytest.mark.parametrize("protocol", [["rotation"], ["pgd", "--steps", "1"], ["attack", "--attack", "pgd"],
                                      ["occlusion"], ["shuffle"], ["corruption", "--corruptions", "gaussian_noise"],
                                      ["transfer"]],
                         ids=lambda p: p[0])
def test_a_model_with_dropout_left_on_is_refused_by_every_protocol(protocol, unit_file, tmp_path, capsys):
    spec = f"{unit_file}:dropout"
    model = ["--source", spec, "--target", spec] if protocol == ["transfer"] else ["--model", spec]
    argv = ["eval", *protocol, *model, "--model-input", "unit", "--dataset", "synthetic",
            "--limit", "4", "--no-progress", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is not deterministic" in err and "model.eval()" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_a_folder_of_one_class_is_refused(tmp_path, capsys):
    from PIL import Image

    (tmp_path / "data" / "cat").mkdir(parents=True)
    Image.new("RGB", (32, 32), (10, 20, 30)).save(tmp_path / "data" / "cat" / "a.png")
    argv = ["eval", "rotation", "--model", "resnet26", "--dataset", "imagefolder", "--root", str(tmp_path / "data"),
            "--no-progress", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "has 1 class" in err and "at least 2" in err
    assert main(["eval", "transfer", "--source", "resnet26", "--target", "resnet26", *argv[4:]]) == 2
    assert "has 1 class" in capsys.readouterr().err


def test_a_truncated_jpeg_names_its_file(tmp_path, capsys):
    from PIL import Image

    gen = np.random.default_rng(0)
    for c in ("a", "b"):
        (tmp_path / "data" / c).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(gen.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(tmp_path / "data" / c / f"{i}.jpg")
    bad = tmp_path / "data" / "b" / "1.jpg"
    bad.write_bytes(bad.read_bytes()[:300])
    assert main(["eval", "rotation", "--model", "resnet26", "--model-args", "width=0.125", "--dataset", "imagefolder",
                 "--root", str(tmp_path / "data"), "--angle-step", "0", "--no-progress",
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "damaged or not an image" in err and "class b" in err and "Traceback" not in err


def test_a_manifest_entry_without_its_weights_file_names_the_entry_and_the_fix(good, tmp_path, monkeypatch,
                                                                                  capsys):
    arch = json.loads(good["sidecar"])["arch"]
    manifest = tmp_path / "zoo" / "manifest.json"
    manifest.parent.mkdir()
    manifest.write_text(json.dumps({"models": [{"name": "resnet26", "dataset": "synthetic", "arch": arch,
                                                "weights": "gone.safetensors", "sha256": "f" * 64}]}))
    monkeypatch.setenv("ROBUST_ATTN_ZOO_MANIFEST", str(manifest))
    assert main([*EVAL, "--zoo", "--model", "resnet26", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "zoo entry 'resnet26' (synthetic)" in err and str(manifest) in err and "gone.safetensors" in err
    assert "git lfs pull" in err and "remove the entry" in err


def test_a_corruption_baseline_of_other_images_is_refused(tmp_path, capsys):
    argv = ["eval", "corruption", *TINY_ARGS, "--corruptions", "gaussian_noise", "--severities", "1"]
    assert main([*argv, "--out", str(tmp_path / "base")]) == 0
    # another subset of the same dataset, another split, another dataset: refused before any work
    for change in (["--limit", "3"], ["--split", "val"], ["--dataset", "fashion_mnist"]):
        other = list(argv)
        if change[0] in other:
            other[other.index(change[0]) + 1] = change[1]
        else:
            other += change
        capsys.readouterr()
        code = main([*other, "--baseline", str(tmp_path / "base"), "--out", str(tmp_path / f"o{change[0]}")])
        err = capsys.readouterr().err
        if change[1] == "fashion_mnist" and "not found" in err:
            continue   # the Fashion-MNIST files are not on this machine: refused for that reason first
        assert code == 2 and "was measured on other images" in err, err
    # the same images: the relative mCE against itself is 100
    assert main([*argv, "--baseline", str(tmp_path / "base"), "--out", str(tmp_path / "same")]) == 0
    assert f"against resnet26 ({tmp_path / 'base'}): mCE 100.0" in capsys.readouterr().out


def test_ctrl_c_exits_130_with_the_resume_line(tmp_path, monkeypatch, capsys):
    import robust_attn.protocols.rotation as rotation

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(rotation, "run_rotation", interrupted)
    assert main(["eval", "rotation", *TINY_ARGS, "--out", str(tmp_path / "o")]) == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C)" in err and "run the same command again to resume" in err and "Traceback" not in err


OUT_OF_MEMORY = {"MemoryError": MemoryError(),
                 "CPU allocator": RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                                               "9000000000 bytes"),
                 "CUDA": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.10 GiB "
                                                "total capacity)")}


@pytest.mark.parametrize("command, module, function", [("rotation", "rotation", "run_rotation"),
                                                       ("pgd", "pgd", "run_pgd")])
@pytest.mark.parametrize("error", list(OUT_OF_MEMORY))
def test_out_of_memory_names_a_batch_size(command, module, function, error, tmp_path, monkeypatch, capsys):
    """Python's, the CPU allocator's and CUDA's out-of-memory errors (the last raised on a CPU
    machine here) end the command with one line naming a quarter of the batch size; exit 2."""
    import importlib

    def oom(*args, **kwargs):
        raise OUT_OF_MEMORY[error]

    monkeypatch.setattr(importlib.import_module(f"robust_attn.protocols.{module}"), function, oom)
    argv = ["eval", command, *TINY_ARGS[:-3], "--batch-size", "16", "--no-progress", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "out of memory" in err and "at --batch-size 16" in err and "--batch-size 4" in err
    assert "Traceback" not in err and sum("out of memory" in line for line in err.splitlines()) == 1


@pytest.mark.parametrize("protocol, option", [("rotation", "--batch-size"), ("apgd", "--attack-batch-size")])
def test_out_of_memory_in_a_study_step_names_the_option_of_its_batch(protocol, option, tmp_path, tiny_zoo,
                                                                     monkeypatch, capsys):
    """A study has two batch sizes: the step that ran out of memory names its own (the attacks on
    the attack subset run ``--attack-batch-size`` images at a time), with a quarter of it."""
    import dataclasses

    from robust_attn.protocols.study_step import STUDY_PROTOCOLS

    def oom(*args, **kwargs):
        raise OUT_OF_MEMORY["CUDA"]

    failing = dataclasses.replace(STUDY_PROTOCOLS.get(protocol), step=oom)
    monkeypatch.setitem(STUDY_PROTOCOLS._entries, protocol, failing)
    argv = ["study", "--dataset", "synthetic", "--manifest", str(tiny_zoo), "--preset", "none", "--limit", "8",
            "--attack-limit", "8", "--protocols", protocol, "--batch-size", "12", "--attack-batch-size", "8",
            "--workers", "1", "--device", "cpu", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"),
            "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    batch = {"--batch-size": 12, "--attack-batch-size": 8}[option]
    assert f"in the study's {protocol} step at {option} {batch}" in err and f"with {option} {batch // 4}," in err
    assert "Traceback" not in err


def test_other_runtime_errors_are_not_called_out_of_memory(tmp_path, monkeypatch):
    import robust_attn.protocols.rotation as rotation

    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(rotation, "run_rotation", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main(["eval", "rotation", *TINY_ARGS, "--out", str(tmp_path / "o")])


@pytest.mark.parametrize("device, words", [("gpu", "--device 'gpu' is not a device torch knows"),
                                           ("cuda", "CUDA is not available here; use --device cpu")])
def test_a_device_that_is_not_there_is_a_clear_error(device, words, tmp_path, capsys):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["eval", "rotation", *TINY_ARGS, "--device", device, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", [["pgd", "--steps", "1", "--no-checks"],
                                     ["attack", "--attack", "pgd", "--steps", "1", "--no-checks"]], ids=lambda c: c[0])
def test_one_eps_syntax_in_every_command(command, tmp_path, capsys):
    """``0.5/255`` and its float work in both commands and name the same condition; both record
    the radius in image units (eval pgd's condition name keeps Table 10's 1/255 number)."""
    names = []
    for eps in ("0.5/255", repr(0.5 / 255)):
        out = tmp_path / eps.replace("/", "_")
        assert main(["eval", *command, *TINY_ARGS, "--eps", eps, "--out", str(out)]) == 0, capsys.readouterr().err
        desc = json.loads((out / "run.json").read_text())
        condition = desc["conditions"][1]
        names.append(condition["name"])
        assert desc["parameters"]["units"] == "[0, 1] image units" and condition["eps"] == pytest.approx(0.5 / 255)
        if command[0] == "pgd":
            assert condition["name"] == "pgd_eps0.5_step0.5_n1" and condition["step"] == pytest.approx(0.5 / 255)
            linf = load_records(out).set_index("condition")["linf"]
            assert linf["clean"].eq(0).all() and (linf[condition["name"]] <= 0.5 / 255 + 1e-7).all()
            assert linf[condition["name"]].max() > 0.4 / 255   # image units, not 1/255
    assert names[0] == names[1]


# --- timm without a network (a stand-in timm module) ----------------------------------------------
def _fake_timm(monkeypatch, cfg: dict):
    import sys
    import types

    calls = []

    def create_model(name, pretrained=False, **kwargs):
        calls.append({"pretrained": pretrained, "offline": __import__("os").environ.get("HF_HUB_OFFLINE"), **kwargs})
        head = nn.Linear(3, kwargs.get("num_classes", cfg["num_classes"]))
        net = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), head)
        net.pretrained_cfg = dict(cfg)
        return net

    fake = types.ModuleType("timm")
    fake.is_model = lambda name: name == "fakenet"
    fake.list_models = lambda: ["fakenet"]
    fake.create_model = create_model
    fake.data = types.ModuleType("timm.data")
    fake.data.resolve_data_config = lambda args, model=None: {"input_size": (3, 32, 32), "mean": (0.5,) * 3,
                                                              "std": (0.5,) * 3, "crop_pct": 1.0}
    monkeypatch.setitem(sys.modules, "timm", fake)
    monkeypatch.setitem(sys.modules, "timm.data", fake.data)
    return calls


def test_timm_class_mismatch_is_refused_before_any_download(monkeypatch, tmp_path, capsys):
    calls = _fake_timm(monkeypatch, {"num_classes": 1000, "hf_hub_id": "timm/fakenet.in1k"})
    assert main(["eval", "rotation", "--model", "timm:fakenet", *TINY_ARGS[5:], "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "classify 1000 classes but the dataset has 10" in err and "pretrained=False" in err
    assert "--checkpoint" in err and [c["pretrained"] for c in calls] == [False]   # nothing fetched


def test_timm_without_a_network_fails_at_once_naming_the_fixes(monkeypatch, tmp_path, capsys):
    import socket

    calls = _fake_timm(monkeypatch, {"num_classes": 10, "hf_hub_id": "timm/fakenet.in1k"})
    tried = []

    def no_network(address, timeout=None, *args, **kwargs):
        tried.append((address, timeout))
        raise OSError("Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert main(["eval", "rotation", "--model", "timm:fakenet", *TINY_ARGS[5:], "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "not on this machine and huggingface.co cannot be reached" in err
    assert "--checkpoint LOCAL_STATE_DICT" in err and "pretrained=False" in err
    assert [c["pretrained"] for c in calls] == [False] and tried == [(("huggingface.co", 443), 3.0)]


def test_timm_weights_on_this_machine_load_offline(monkeypatch, tmp_path):
    from robust_attn.data import dataset_info
    from robust_attn.sources import load_model_spec

    weights = tmp_path / "fakenet.safetensors"
    weights.write_bytes(b"cached")
    calls = _fake_timm(monkeypatch, {"num_classes": 10, "file": str(weights)})
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    load_model_spec("timm:fakenet", dataset_info=dataset_info("synthetic"))
    assert [(c["pretrained"], c["offline"]) for c in calls] == [(False, None), (True, "1")]
    assert "HF_HUB_OFFLINE" not in __import__("os").environ
