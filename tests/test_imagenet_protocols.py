"""Every protocol on ImageNet as users hold it: rotation, Table 10 PGD and an
evaluation attack with ``--limit`` on a tiny 224 px ImageNet folder, in both layouts (class
folders; flat val + LOC_val_solution.csv), with a user's file model that brings its own
preprocessing. The images the model sees are checked against an independent PIL pipeline."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from robust_attn.cli import main
from robust_attn.runs.store import load_records
from helpers import IMAGENET_CLASSES, tiny_imagenet

PROBE = '''
import os
import torch
import torch.nn as nn


class Probe(nn.Module):
    """1000 classes from 224x224 input only; saves the first real batch it sees to ``record_to``."""

    def __init__(self, num_classes, record_to):
        super().__init__()
        self.record_to = record_to
        self.net = nn.Sequential(nn.Conv2d(3, 4, 8, stride=8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(4, num_classes))
        self.preprocessing = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "input_size": 224,
                              "resize_size": 240, "crop_size": 224, "interpolation": "bicubic"}

    def forward(self, x):
        if tuple(x.shape[1:]) != (3, 224, 224):
            raise ValueError(f"Probe takes 3x224x224 images, got {tuple(x.shape)}")
        if self.record_to and x.std() > 0 and not os.path.exists(self.record_to):
            torch.save(x.detach().clone(), self.record_to)
        return self.net(x)


def probe(num_classes=1000, record_to=""):
    return Probe(num_classes, record_to)


def probe_b(num_classes=1000):
    return Probe(num_classes, "")


def plain(num_classes=1000):
    net = Probe(num_classes, "")
    del net.preprocessing     # the dataset's own evaluation images (resize 256, crop 224)
    return net
'''


def _reference(path) -> torch.Tensor:
    """Resize the shorter side to 240 (PIL bicubic), centre-crop 224, [0, 1] floats, normalized
    with mean = std = 0.5: written with PIL and NumPy alone."""
    from PIL import Image

    image = Image.open(path).convert("RGB")
    w, h = image.size
    short, long = (w, h) if w <= h else (h, w)
    size = (240, int(240 * long / short)) if w <= h else (int(240 * long / short), 240)
    image = image.resize(size, Image.BICUBIC)
    w, h = image.size
    top, left = int(round((h - 224) / 2.0)), int(round((w - 224) / 2.0))
    array = np.asarray(image.crop((left, top, left + 224, top + 224)), dtype=np.float32) / 255.0
    return (torch.from_numpy(array).permute(2, 0, 1) - 0.5) / 0.5


PROTOCOLS = {
    "rotation": ["rotation", "--angle-step", "0", "--no-hflip"],
    "pgd": ["pgd", "--eps", "8/255", "--steps", "1", "--no-checks"],
    "attack": ["attack", "--attack", "pgd", "--targeted", "--eps", "8/255", "--steps", "2", "--no-checks"],
}
CONDITIONS = {"rotation": ["none", "cw90", "cw180", "cw270", "flip_ud"], "pgd": ["clean", "pgd_eps8_step8_n1"],
              "attack": ["clean", "pgd_linf_eps8_t_n2"]}


@pytest.mark.parametrize("layout", ["folders", "flat"])
@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_protocol_on_a_tiny_imagenet_folder(tmp_path, layout, protocol):
    files = tiny_imagenet(tmp_path / "data", layout, size=(300, 260))
    (tmp_path / "probe.py").write_text(PROBE)
    seen, out = tmp_path / "seen.pt", tmp_path / "run"
    argv = ["eval", *PROTOCOLS[protocol], "--model", f"{tmp_path / 'probe.py'}:probe", "--model-args",
            f"record_to={seen}", "--dataset", "imagenet", "--root", str(tmp_path / "data"), "--limit", "2",
            "--batch-size", "2", "--device", "cpu", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    desc = json.loads((out / "run.json").read_text())
    assert desc["source"] == "callable" and desc["dataset"] == {"name": "imagenet", "split": "test", "limit": 2}
    assert desc["preprocessing"] == {"mean": [0.5] * 3, "std": [0.5] * 3, "input_size": 224, "resize_size": 240,
                                     "crop_size": 224, "interpolation": "bicubic"}
    assert desc["data_source"] == str(tmp_path / "data" / "val")
    records = load_records(out)
    assert sorted(records["condition"].unique()) == sorted(CONDITIONS[protocol])
    assert (records.groupby("condition").size() == 2).all()
    # the images the model saw are two of the three files, through its own preprocessing
    batch = torch.load(seen)
    references = [(_reference(path), label) for path, label in files]
    clean = records[records["condition"] == CONDITIONS[protocol][0]].sort_values("index")
    for image, recorded in zip(batch, clean["label"]):
        matches = [label for ref, label in references if torch.allclose(image, ref, atol=1e-5)]
        assert matches == [recorded]   # one file, whose wnid's index in the sorted 1,000 is the label
    assert set(clean["label"]) <= set(IMAGENET_CLASSES.values())
    if protocol != "rotation":
        targets = records[records["condition"] != "clean"]["target"]
        assert ((targets >= 0) & (targets < 1000)).all() and (targets.to_numpy() != clean["label"].to_numpy()).all()


def test_transfer_between_model_specs_on_a_tiny_imagenet_folder(tmp_path, capsys):
    tiny_imagenet(tmp_path / "data", "folders")
    (tmp_path / "probe.py").write_text(PROBE)
    net = tmp_path / "probe.py"
    common = ["--dataset", "imagenet", "--root", str(tmp_path / "data"), "--limit", "2", "--batch-size", "2",
              "--eps", "8/255", "--steps", "1", "--device", "cpu", "--no-progress"]
    out = tmp_path / "transfer"
    assert main(["eval", "transfer", "--source", f"{net}:probe", "--target", f"{net}:probe_b", *common,
                 "--out", str(out)]) == 0
    desc = json.loads((out / "run.json").read_text())
    assert desc["model"] == "probe-probe" and list(desc["target_models"]) == ["probe-probe_b"]
    assert desc["sources"][0]["preprocessing"]["resize_size"] == 240 and desc["weights_origin"] == "user"
    records = load_records(out)
    assert set(records["target_model"]) == {"probe-probe_b"} and (records.groupby("condition").size() == 2).all()
    # a transferred image is one tensor for every model: other preprocessing is refused, before any run
    assert main(["eval", "transfer", "--source", f"{net}:probe", "--target", f"{net}:plain", *common,
                 "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert "probe-probe: resize 240 (bicubic), crop 224" in err and "probe-plain: the dataset's images" in err
    assert not (tmp_path / "refused").exists()
