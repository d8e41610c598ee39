"""ImageNet-A, ImageNet-R, ImageNet-Sketch and ImageNetV2 (matched-frequency) as dataset plug-ins:
each reads a tiny tree written here in its published layout and runs through ``eval rotation``.

The model is a colour classifier (a linear layer on the mean colour) and every image one solid
colour, so what it predicts is known without the data pipeline: the reference below decodes each
file with PIL, takes its colour, normalizes it with ImageNet's mean and std (what a user's model
without its own preprocessing is wrapped with) and applies the same linear layer, restricted
(ImageNet-A, -R) to the set's 200 classes found in the ImageNet class list by hand."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from robust_attn.cli import main
from robust_attn.data import build_dataset, dataset_info, list_datasets, locate_dataset
from robust_attn.runs.store import load_records

WNIDS_FILE = Path(__file__).resolve().parents[1] / "robust_attn" / "data" / "imagenet_wnids.txt"

PROBE = '''
import torch
import torch.nn as nn


class Colours(nn.Module):
    """1000 logits from the mean colour of the image."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 1000)

    def forward(self, x):
        return self.fc(x.mean((2, 3)))


def colours(num_classes=1000):
    return Colours()
'''

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
COLOURS = [(250, 10, 10), (10, 240, 30), (20, 30, 230), (200, 200, 20), (128, 128, 128), (5, 5, 5)]


def _imagenet_wnids() -> list[str]:
    return WNIDS_FILE.read_text().split()


def _write(folder: Path, names: list[str], ext: str) -> list[tuple[Path, str]]:
    """Two solid-colour images in each class folder of ``names``; (file, folder name) pairs."""
    from PIL import Image

    files = []
    for k, name in enumerate(names):
        (folder / name).mkdir(parents=True)
        for j in range(2):
            path = folder / name / f"img{j}{ext}"
            Image.new("RGB", (64, 48), COLOURS[(2 * k + j) % len(COLOURS)]).save(path, format="JPEG", quality=95)
            files.append((path, name))
    return files


def _tree(name: str, root: Path):
    """The tiny tree of dataset ``name``: (files with their class folder, label of a folder, the
    ImageNet index of each label where the set has 200 classes)."""
    imagenet = _imagenet_wnids()
    if name in ("imagenet_a", "imagenet_r"):
        module = __import__(f"robust_attn.data.{name}", fromlist=["WNIDS"])
        wnids = list(module.WNIDS)
        assert len(wnids) == 200 and wnids == sorted(wnids) and set(wnids) <= set(imagenet)
        folder = root / name.replace("_", "-")
        files = _write(folder, [wnids[0], wnids[57], wnids[199]], ".jpg")
        return files, {w: wnids.index(w) for w in wnids}, [imagenet.index(w) for w in wnids]
    if name == "imagenet_sketch":
        files = _write(root / "sketch", [imagenet[0], imagenet[500], imagenet[999]], ".JPEG")
        return files, {w: imagenet.index(w) for w in imagenet}, None
    files = _write(root / "imagenetv2-matched-frequency-format-val", ["0", "2", "10", "999"], ".jpeg")
    return files, {str(i): i for i in range(1000)}, None


def _reference_prediction(path: Path, subset) -> int:
    from PIL import Image

    colour = torch.tensor(np.asarray(Image.open(path).convert("RGB"), dtype=np.float32).mean((0, 1)) / 255.0)
    colour = (colour - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)   # the wrapper's normalization
    torch.manual_seed(0)
    fc = torch.nn.Linear(3, 1000)
    with torch.no_grad():
        logits = fc(colour)
    if subset is not None:
        logits = logits[subset]
    return int(logits.argmax())


VARIANTS = ["imagenet_a", "imagenet_r", "imagenet_sketch", "imagenetv2"]


def test_the_variants_are_registered_with_their_classes():
    assert set(VARIANTS) <= set(list_datasets())
    for name, classes, subset in [("imagenet_a", 200, 200), ("imagenet_r", 200, 200), ("imagenet_sketch", 1000, 0),
                                  ("imagenetv2", 1000, 0)]:
        info = dataset_info(name)
        assert (info.num_classes, len(info.logit_subset), info.image_size) == (classes, subset, 224)
        assert info.for_models().num_classes == 1000


@pytest.mark.parametrize("name", VARIANTS)
def test_a_variant_reads_its_published_layout(tmp_path, name):
    files, label_of, _ = _tree(name, tmp_path)
    dataset = build_dataset(name, root=tmp_path, split="test")
    assert len(dataset) == len(files)
    assert sorted((Path(p).name, Path(p).parent.name, y) for p, y in dataset.samples) == \
        sorted((p.name, folder, label_of[folder]) for p, folder in files)
    image, _ = dataset[0]
    assert tuple(image.shape) == (3, 224, 224)
    with pytest.raises(FileNotFoundError, match="test set"):
        locate_dataset(name, tmp_path, "train")
    with pytest.raises(FileNotFoundError, match=f"dataset '{name}' not found"):
        locate_dataset(name, tmp_path / "elsewhere")


def test_a_folder_that_is_not_a_class_is_refused(tmp_path):
    _tree("imagenet_r", tmp_path)
    (tmp_path / "imagenet-r" / "n01440764").mkdir()   # an ImageNet class that ImageNet-R does not have
    with pytest.raises(ValueError, match="not its classes: 'n01440764'"):
        build_dataset("imagenet_r", root=tmp_path)


@pytest.mark.parametrize("name", VARIANTS)
def test_eval_rotation_on_a_variant(tmp_path, name):
    files, label_of, subset = _tree(name, tmp_path / "data")
    (tmp_path / "probe.py").write_text(PROBE)
    out = tmp_path / "run"
    argv = ["eval", "rotation", "--angle-step", "0", "--no-hflip", "--model", f"{tmp_path / 'probe.py'}:colours",
            "--dataset", name, "--root", str(tmp_path / "data"), "--batch-size", "4", "--device", "cpu",
            "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    records = load_records(out)
    clean = records[records["condition"] == "none"].sort_values("index")
    dataset = build_dataset(name, root=tmp_path / "data")
    expected = [(label_of[Path(path).parent.name], _reference_prediction(Path(path), subset))
                for path, _ in dataset.samples]
    assert list(zip(clean["label"], clean["pred"])) == expected
    # a solid colour is the same image turned or flipped: every condition predicts the same
    for condition in ("cw90", "cw180", "cw270", "flip_ud"):
        assert list(records[records["condition"] == condition].sort_values("index")["pred"]) == list(clean["pred"])
    description = json.loads((out / "run.json").read_text())
    assert description.get("logit_subset") == ({"classes": 200, "of": 1000} if subset is not None else None)
