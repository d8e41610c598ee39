"""Memory bounded by the batch size: the gradient-masking checks of ``eval attack`` run the model on
at most ``--batch-size`` images at a time, so at 224 px their peak stays near the attack's own.

The peak is the resident set's high-water mark of a fresh ``robust-attn`` process
(``resource.getrusage``), with and without the checks, on one model and one image folder. The
model is cheap in arithmetic and heavy in activations (1x1 convolutions at full resolution, about
40 MB of saved activations per 224 px image), so a check that took its 16 images at once, or the
loss sweep's former 256, would show as several times the attack's peak."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import subprocess_env

MODEL = '''
import torch
import torch.nn as nn


class Wide(nn.Module):
    def __init__(self, num_classes, width=32):
        super().__init__()
        self.a = nn.Conv2d(3, width, 1)
        self.b = nn.Conv2d(width, width, 1, groups=width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.tanh(self.b(h)) * h
        return self.head(h.mean((2, 3)))


def build(num_classes=2):
    torch.manual_seed(0)
    return Wide(num_classes)
'''

PEAK = ("import json, resource, sys; from robust_attn.cli import main; code = main(sys.argv[1:]); "
        "print(json.dumps({'code': code, 'maxrss_kb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("img224")
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (root / c).mkdir()
        for i in range(8):
            Image.fromarray((rng.random((224, 224, 3)) * 255).astype("uint8")).save(root / c / f"{i}.png")
    (root.parent / "wide.py").write_text(MODEL)
    return root


def _peak_mb(folder, out, *extra) -> float:
    argv = ["eval", "attack", "--attack", "apgd-ce", "--steps", "2", "--model", f"{folder.parent / 'wide.py'}:build",
            "--model-input", "normalized", "--dataset", "imagefolder", "--root", str(folder), "--limit", "16",
            "--batch-size", "4", "--no-progress", "--out", str(out), *extra]
    done = subprocess.run([sys.executable, "-c", PEAK, *argv], capture_output=True, text=True, env=subprocess_env(),
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, done.stderr[-2000:]
    return result["maxrss_kb"] / 1024


def test_masking_checks_at_224px_stay_near_the_attacks_peak(folder, tmp_path):
    bare = _peak_mb(folder, tmp_path / "bare", "--no-checks")
    checked = _peak_mb(folder, tmp_path / "checked")
    names = [c["name"] for c in json.loads((tmp_path / "checked" / "checks.json").read_text())]
    assert {"unbounded_attack", "input_gradients", "loss_saturation"} <= set(names)
    assert checked <= 1.5 * bare, (checked, bare)
