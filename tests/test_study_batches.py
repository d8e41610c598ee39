"""The study's batch sizes by image size (robust_attn.study.batches): the 32 px defaults the zoo's
studies were made with, ImageNet resolution's sized by the memory measured at 224 px, presets
capped, values given kept, and a study at 224 px running one process with batches of 16."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from robust_attn.cli import main
from robust_attn.runs.store import RunStore
from robust_attn.study.batches import DEFAULT_BATCHES, default_batches
from robust_attn.study.config import StudyConfig
from robust_attn.study.presets import PRESETS, preset_values
from robust_attn.study.run import default_workers

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "benchmarks" / "results" / "memory_224.json"
ATTACK_STEPS = ("attack", "transfer")   # eval commands whose study steps run attack_batch_size images


@pytest.mark.parametrize("dataset", ["synthetic", "cifar10", "fashion_mnist"])
def test_32_px_studies_keep_the_batch_sizes_of_the_committed_reports(dataset):
    config = StudyConfig(dataset=dataset)
    assert (config.batch_size, config.attack_batch_size) == (250, 100)
    assert preset_values("quick", dataset)["batch_size"] == PRESETS["quick"]["batch_size"] == 100


@pytest.mark.parametrize("dataset", ["imagenet", "imagefolder"])
def test_imagenet_resolution_studies_default_to_smaller_batches_and_keep_given_ones(dataset):
    config = StudyConfig(dataset=dataset)
    assert (config.batch_size, config.attack_batch_size) == (16, 16) == tuple(vars(DEFAULT_BATCHES["imagenet"]).values())
    given = StudyConfig(dataset=dataset, batch_size=64)
    assert (given.batch_size, given.attack_batch_size) == (64, 16) and given.describe()["batch_size"] == 64
    for preset in PRESETS:   # sized at 32 px: capped at 224 px
        values = preset_values(preset, dataset)
        assert values.get("batch_size", 16) <= 16 and values.get("attack_batch_size", 16) <= 16
    assert default_workers(dataset) == 1 and default_workers("cifar10") == max(1, os.cpu_count() or 1)


@pytest.mark.skipif(not MEASURED.is_file(), reason="benchmarks/results/memory_224.json is not in this checkout")
def test_the_224_px_defaults_stay_within_half_the_measured_budget():
    """benchmarks/bench_memory.py fitted each step's peak at 224 px (fixed + per image x batch) and
    said how many images fit its budget; the defaults take at most half of that."""
    measured = json.loads(MEASURED.read_text())
    assert measured["budget_mb"] <= 8 * 1024 and measured["fits"]
    defaults = default_batches("imagenet")
    for fit in measured["fits"]:
        batch = defaults.attack_batch_size if fit["protocol"].startswith(ATTACK_STEPS) else defaults.batch_size
        assert fit["fixed_mb"] + fit["per_image_mb"] * 2 * batch <= measured["budget_mb"], fit
        # the fit reproduces the measured peaks it was drawn through
        for row in (r for r in measured["rows"] if (r["arch"], r["protocol"]) == (fit["arch"], fit["protocol"])):
            assert fit["fixed_mb"] + fit["per_image_mb"] * row["batch"] == pytest.approx(row["peak_mb"], abs=0.2)


def test_a_224_px_study_runs_batches_of_16_without_being_told(tmp_path):
    from PIL import Image

    gen = np.random.default_rng(0)
    for c in ("a", "b"):
        (tmp_path / "images" / c).mkdir(parents=True)
        for i in range(10):
            Image.fromarray(gen.integers(0, 255, (224, 224, 3), dtype=np.uint8)).save(tmp_path / "images" / c / f"{i}.png")
    (tmp_path / "tiny.py").write_text(
        "import torch.nn as nn\n"
        "def build(num_classes=2):\n"
        "    net = nn.Sequential(nn.AvgPool2d(32), nn.Flatten(), nn.Linear(3 * 7 * 7, num_classes))\n"
        "    net.input_range = 'normalized'\n"
        "    return net.eval()\n")
    (tmp_path / "study.toml").write_text(
        f'dataset = "imagefolder"\nroot = "{tmp_path / "images"}"\nprotocols = ["rotation"]\nangle_step = 0\n'
        f'bootstrap = 10\nbaseline = "tiny"\nmodels = [{{ spec = "{tmp_path / "tiny.py"}:build", label = "tiny" }}]\n')
    runs = tmp_path / "runs"
    assert main(["study", str(tmp_path / "study.toml"), "--device", "cpu", "--runs", str(runs),
                 "--out", str(tmp_path / "report"), "--no-progress"]) == 0
    description = RunStore(runs / "rotation-tiny").description()
    assert description["num_images"] == 20 and description["chunk_size"] == 16
    assert json.loads((tmp_path / "report" / "study.json").read_text())["config"]["batch_size"] == 16
