"""A model whose logits are NaN or infinite on some images: no protocol records a prediction from
them (an argmax over NaN is arbitrary); the run stops with an error naming the images."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from robust_attn.data.base import TensorImageDataset
from robust_attn.protocols.attack import attack_records
from robust_attn.protocols.pgd import AttackSetting, run_pgd
from robust_attn.protocols.rotation import run_rotation
from robust_attn.shifts.rotation import rotation_conditions
from robust_attn.protocols.runner import NonFiniteLogitsError, finite_logits
from robust_attn.protocols.shift_runner import prediction_records
from robust_attn.runs.store import RunStore

BAD = 5   # the one image (dataset index) on which the model below returns NaN logits


class NaNOnBright(nn.Module):
    """Logits from a fixed linear map of the image; NaN for an image whose mean is above 0.9 (the
    all-white image BAD, whatever its rotation, flip or an 8/255 perturbation does to it)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(3 * 32 * 32, num_classes)

    def forward(self, x):
        logits = self.linear(x.flatten(1))
        bright = x.flatten(1).mean(1, keepdim=True) > 0.9
        return torch.where(bright, torch.full_like(logits, float("nan")), logits)


def _data(n: int = 8) -> TensorImageDataset:
    gen = torch.Generator().manual_seed(1)
    images = torch.randint(0, 200, (n, 3, 32, 32), generator=gen, dtype=torch.uint8)
    images[BAD] = 255
    return TensorImageDataset(images, torch.arange(n) % 10)


def _written(root) -> list[int]:
    return sorted({a for _, a, _ in RunStore(root).chunks()})


def test_rotation_stops_at_the_batch_with_nan_logits_and_records_none_of_it(tmp_path):
    with pytest.raises(NonFiniteLogitsError, match=rf"1 of 4 images .*dataset indices \[{BAD}\]"):
        run_rotation(NaNOnBright(), _data(), tmp_path / "rot", conditions=rotation_conditions(0), batch_size=4,
                     progress=False)
    assert _written(tmp_path / "rot") == [0]        # images 0-3 are recorded, the chunk of image 5 is not


def test_pgd_stops_at_the_batch_with_nan_logits(tmp_path):
    with pytest.raises(NonFiniteLogitsError, match=rf"dataset indices \[{BAD}\]"):
        run_pgd(NaNOnBright(), _data(), tmp_path / "pgd", num_classes=10, settings=[AttackSetting(8, 4, 2)],
                batch_size=4, progress=False, checks=False)
    assert 4 not in _written(tmp_path / "pgd")


def test_record_builders_refuse_non_finite_logits_and_pass_finite_ones():
    logits = torch.randn(4, 10)
    labels, indices = torch.arange(4), torch.tensor([10, 11, 12, 13])
    assert finite_logits(logits, indices, "x") is logits
    assert len(prediction_records(logits, labels, indices)) == 4
    for value in (float("nan"), float("inf"), float("-inf")):
        bad = logits.clone()
        bad[2, 3] = value
        with pytest.raises(NonFiniteLogitsError, match=r"1 of 4 images \(shifted images; dataset indices \[12\]\)"):
            prediction_records(bad, labels, indices)
        images = torch.rand(4, 3, 8, 8)
        with pytest.raises(NonFiniteLogitsError, match=r"attacked images; dataset indices \[12\]"):
            attack_records(indices, labels, None, logits, bad, images, images)
        with pytest.raises(NonFiniteLogitsError, match=r"clean images; dataset indices \[12\]"):
            attack_records(indices, labels, None, bad, logits, images, images)
    assert isinstance(NonFiniteLogitsError("x"), ValueError)   # the CLI's exit code 2, no traceback


def test_transfer_records_refuse_non_finite_logits_of_target_or_source():
    from robust_attn.protocols.transfer import _records

    logits, labels, indices = torch.randn(3, 10), torch.arange(3), torch.tensor([7, 8, 9])
    images = torch.rand(3, 3, 8, 8)
    bad = logits.clone()
    bad[0, 0] = float("nan")
    assert len(_records(indices, labels, None, "src", "tgt", logits, logits, logits, images, images)) == 3
    for args, words in (((logits, bad, logits), "tgt on images crafted on src"), ((logits, logits, bad), "source src"),
                        ((bad, logits, logits), "tgt on clean images")):
        with pytest.raises(NonFiniteLogitsError, match=rf"{words}; dataset indices \[7\]"):
            _records(indices, labels, None, "src", "tgt", *args, images, images)
