"""Where a run's model came from: the Python API's runs record it (``model_info=``),
reports say it per model and label random weights only when they are known to be random; a
user's own PGD targets as a tensor."""
from __future__ import annotations

import hashlib
import json

import pandas as pd
import pytest
import torch
import torch.nn as nn

from robust_attn.data import TensorImageDataset, dataset_info
from robust_attn.protocols.pgd import AttackSetting, run_pgd
from robust_attn.protocols.rotation import run_rotation
from robust_attn.shifts.rotation import rotation_conditions
from robust_attn.reports import make_report
from robust_attn.runs.store import load_records
from robust_attn.sources import load_model_spec

QUIET = dict(batch_size=4, progress=False)


class Tiny(nn.Module):
    """A classifier of [0, 1] images that knows nothing about robust-attn."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(4, classes))

    def forward(self, x):
        return self.net(x)


def _sha256_of_state(module: nn.Module) -> str:
    """An independent weights hash: name, dtype, shape and raw bytes of every tensor, in name order."""
    digest = hashlib.sha256()
    for name in sorted(module.state_dict()):
        t = module.state_dict()[name].contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode() + t.numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture
def data():
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8, generator=gen)
    return TensorImageDataset(images, torch.arange(8) % 10)


def test_api_run_of_a_bare_module_records_a_user_module_not_random_weights(tmp_path, data):
    model = Tiny().eval()
    store = run_rotation(model, data, tmp_path / "rot", conditions=rotation_conditions(0), **QUIET)
    desc = json.loads((store.root / "run.json").read_text())
    assert desc["source"] == "user module" and desc["model"] == "Tiny" and desc["spec"] is None
    assert desc["weights_origin"] == "user" and desc["preprocessing"] is None
    assert desc["weights_sha256"] == _sha256_of_state(model)
    assert desc["params"] == 3 * 4 * 9 + 4 + 4 * 10 + 10
    report = make_report([store.root], tmp_path / "report", n_boot=10, plots=False)
    text = (tmp_path / "report" / "report.md").read_text()
    assert "random weights" not in text and report
    models = pd.read_csv(tmp_path / "report" / "models.csv")
    assert desc["dataset"] == {"name": "TensorImageDataset", "split": None, "limit": None}
    assert models[["label", "source", "weights_origin", "params"]].values.tolist() == [
        ["Tiny [TensorImageDataset]", "user module", "user", desc["params"]]]
    assert models["weights_sha256"].item() == desc["weights_sha256"]
    assert f"| Tiny [TensorImageDataset] | user module | - | user {desc['weights_sha256'][:12]} | the dataset's images | 162 |" in text


def test_model_info_says_where_the_weights_came_from(tmp_path, data):
    model = Tiny().eval()
    info = {"name": "my_net", "weights_origin": "pretrained", "weights": "ImageNet-1k, my run 7",
            "preprocessing": {"mean": [0.5] * 3, "std": [0.5] * 3, "input_size": 16, "resize_size": 18,
                              "crop_size": 16, "interpolation": "bicubic"}}
    store = run_pgd(model, data, tmp_path / "pgd", num_classes=10, settings=[AttackSetting(8, 8, 1)], checks=False,
                    model_info=info, **QUIET)
    desc = json.loads((store.root / "run.json").read_text())
    assert (desc["model"], desc["weights_origin"], desc["weights"]) == ("my_net", "pretrained", "ImageNet-1k, my run 7")
    assert desc["preprocessing"]["resize_size"] == 18
    make_report([store.root], tmp_path / "report", n_boot=10, plots=False)
    text = (tmp_path / "report" / "report.md").read_text()
    assert "resize 18 (bicubic), crop 16; mean 0.5/0.5/0.5" in text and "random weights" not in text
    # known random weights are labelled so, with the warning
    store = run_rotation(model, data, tmp_path / "rand", conditions=rotation_conditions(0),
                         model_info={"weights_origin": "random"}, **QUIET)
    make_report([store.root], tmp_path / "report2", n_boot=10, plots=False)
    text = (tmp_path / "report2" / "report.md").read_text()
    assert "Tiny [random weights]" in text and "**Warning: some runs used random weights" in text
    with pytest.raises(ValueError, match="weights_origin must be one of"):
        run_rotation(model, data, tmp_path / "bad", model_info={"weights_origin": "trained-ish"}, **QUIET)


def test_a_loaded_spec_passes_its_description(tmp_path, data):
    loaded = load_model_spec("resnet26", dataset_info=dataset_info("synthetic"), seed=2,
                             model_args={"width": 0.25, "stem_downsample": 4})
    store = run_rotation(loaded.model, data, tmp_path / "rot", conditions=rotation_conditions(0), model_info=loaded,
                         **QUIET)
    desc = json.loads((store.root / "run.json").read_text())
    assert (desc["source"], desc["spec"], desc["weights_origin"], desc["init_seed"]) == ("registry", "resnet26",
                                                                                         "random", 2)
    assert desc["params"] == sum(p.numel() for p in loaded.model.parameters())


def test_runs_recorded_before_provenance_keys_resume(tmp_path, data):
    """run.json written by earlier versions lacks source/spec/...: such a run still resumes."""
    model = Tiny().eval()
    out = tmp_path / "rot"
    run_rotation(model, data, out, conditions=rotation_conditions(0), run_info={"model": "old"}, **QUIET)
    desc = json.loads((out / "run.json").read_text())
    for key in ("source", "spec", "weights_origin", "weights_sha256", "params", "preprocessing", "dataset"):
        desc.pop(key)
    (out / "run.json").write_text(json.dumps(desc))
    run_rotation(model, data, out, conditions=rotation_conditions(0), run_info={"model": "old"}, **QUIET)
    assert json.loads((out / "run.json").read_text()) == desc   # nothing rewritten
    from robust_attn.runs.store import RunMismatchError

    other = Tiny().eval()   # drawn after ``model``: other weights
    run_rotation(model, data, tmp_path / "new", conditions=rotation_conditions(0), **QUIET)
    with pytest.raises(RunMismatchError, match="weights_sha256"):
        run_rotation(other, data, tmp_path / "new", conditions=rotation_conditions(0), **QUIET)


# --- a user's PGD targets as a tensor ---------------------------------------------------------------
def test_run_pgd_takes_targets_as_a_tensor(tmp_path, data):
    model = Tiny().eval()
    labels = torch.arange(8) % 10
    targets = (labels + 3) % 10
    store = run_pgd(model, data, tmp_path / "pgd", num_classes=10, settings=[AttackSetting(8, 4, 2)], checks=False,
                    targets=targets, **QUIET)
    records = load_records(store.root)
    for _, group in records.groupby("condition"):
        assert group.sort_values("index")["target"].tolist() == targets.tolist()
    saved = pd.read_csv(store.root / "targets.csv")
    assert saved["target"].tolist() == targets.tolist() and saved["label"].tolist() == labels.tolist()
    params = json.loads((store.root / "run.json").read_text())["parameters"]["targets"]
    assert params["sha256"] == hashlib.sha256(targets.numpy().astype("<i8").tobytes()).hexdigest()
    # the same targets from the file the run saved give the same records
    again = run_pgd(model, data, tmp_path / "again", num_classes=10, settings=[AttackSetting(8, 4, 2)], checks=False,
                    targets_file=store.root / "targets.csv", **QUIET)
    pd.testing.assert_frame_equal(load_records(again.root), records)


@pytest.mark.parametrize("targets, message", [
    (torch.arange(8) % 10, "have their own label"),
    (torch.ones(5, dtype=torch.long), "one integer class per image of the dataset \\(8\\)"),
    (torch.full((8,), 10), "out of range"),
    (torch.rand(8), "one integer class per image"),
])
def test_bad_target_tensors_are_refused(tmp_path, data, targets, message):
    with pytest.raises(ValueError, match=message):
        run_pgd(Tiny(), data, tmp_path / "pgd", num_classes=10, targets=targets, checks=False, **QUIET)
    assert not (tmp_path / "pgd").exists()


def test_targets_and_targets_file_together_are_refused(tmp_path, data):
    with pytest.raises(ValueError, match="not both"):
        run_pgd(Tiny(), data, tmp_path / "pgd", num_classes=10, targets=torch.ones(8, dtype=torch.long),
                targets_file=tmp_path / "t.csv", checks=False, **QUIET)

