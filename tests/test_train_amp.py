"""runtime.amp = "auto": bf16 autocast where the device has bf16 in hardware, float32 elsewhere;
the precision a run used is recorded in its checkpoint, and an explicit bf16 on a CPU that only
emulates it warns with the override that fixes it."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import robust_attn.train.precision as precision
from robust_attn.models.checkpoint import read_sidecar
from robust_attn.train import recipe_from_dict, train
from robust_attn.train.recipe import RecipeError
from robust_attn.utils.hardware import native_bf16

from test_train import quiet, tiny_recipe


def _train(tmp_path, name, amp, messages=None):
    raw = tiny_recipe(epochs=1, runtime={"device": "cpu", "amp": amp})
    log = quiet if messages is None else messages.append
    return train(recipe_from_dict(raw), tmp_path / name, progress=False, log=log)


def test_native_bf16_follows_the_cpu_flags(monkeypatch):
    for avx512_bf16, amx, expected in ((False, False, False), (True, False, True), (False, True, True)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert native_bf16(torch.device("cpu")) is expected
    assert native_bf16("mps") is False


@pytest.mark.parametrize("native", [False, True])
def test_auto_trains_as_the_precision_it_resolves_to(tmp_path, monkeypatch, native):
    """With native bf16 "auto" is bf16 autocast, bit for bit; without it, float32."""
    monkeypatch.setattr(precision, "native_bf16", lambda device: native)
    messages = []
    auto = _train(tmp_path, "auto", "auto", messages)
    same = _train(tmp_path, "same", "bf16" if native else "none")
    other = _train(tmp_path, "other", "none" if native else "bf16")
    a, b, c = (load_file(r["weights"]) for r in (auto, same, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)    # the two precisions train differently
    meta = read_sidecar(auto["weights"])
    assert meta["amp"] == ("bf16" if native else "none") and meta["recipe"]["runtime"]["amp"] == "auto"
    assert any("runtime.amp = auto" in m and ("native bf16" if native else "float32") in m for m in messages)


def test_bf16_on_a_cpu_that_emulates_it_warns_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(precision, "native_bf16", lambda device: False)
    messages = []
    result = _train(tmp_path, "bf16", "bf16", messages)
    warning, = [m for m in messages if m.startswith("warning: runtime.amp")]
    assert "emulated" in warning and "runtime.amp=auto" in warning
    assert read_sidecar(result["weights"])["amp"] == "bf16"     # kept as asked
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    messages.clear()
    _train(tmp_path, "native", "bf16", messages)
    assert not [m for m in messages if m.startswith("warning")]


def test_an_unknown_precision_is_a_recipe_error_that_lists_the_choices():
    with pytest.raises(RecipeError, match="auto"):
        recipe_from_dict(tiny_recipe(runtime={"device": "cpu", "amp": "bfloat16"}))


def test_a_resumed_run_records_a_change_of_precision(tmp_path, monkeypatch):
    """runtime.amp = "auto" resumed on a machine that resolves it otherwise: a warning, and the
    sidecar's amp_epochs says which epochs trained under which precision."""
    recipe = recipe_from_dict(tiny_recipe(epochs=3, runtime={"device": "cpu", "amp": "auto"}))
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    train(recipe, tmp_path / "run", progress=False, log=quiet, stop_after=1)
    assert read_sidecar(tmp_path / "run/checkpoints/epoch_0001/model.safetensors")["amp_epochs"] == {"1": "bf16"}
    monkeypatch.setattr(precision, "native_bf16", lambda device: False)
    messages = []
    train(recipe, tmp_path / "run", resume=True, progress=False, log=messages.append, stop_after=1)
    assert any(m.startswith("warning: epochs 1-1 trained under runtime.amp 'bf16'") for m in messages), messages
    messages.clear()
    done = train(recipe, tmp_path / "run", resume=True, progress=False, log=messages.append)
    assert not [m for m in messages if "amp" in m and m.startswith("warning")]   # no change this time
    meta = read_sidecar(done["weights"])
    assert meta["amp_epochs"] == {"1": "bf16", "2": "none"} and meta["amp"] == "none"


def test_a_checkpoint_without_the_record_starts_it_at_the_next_epoch():
    from robust_attn.train.precision import amp_epochs_on_resume

    messages = []
    assert amp_epochs_on_resume({}, 2, "none", messages.append) == {"3": "none"}
    assert amp_epochs_on_resume({"amp": "none"}, 2, "none", messages.append) == {"3": "none"}
    assert not messages
    assert amp_epochs_on_resume({"amp": "bf16"}, 2, "none", messages.append) == {"3": "none"}
    assert amp_epochs_on_resume({"amp_epochs": {"1": "none"}, "amp": "none"}, 2, "none", messages.append) == \
        {"1": "none"}
    assert len(messages) == 1 and "'bf16'" in messages[0]
