import json

import pytest
import torch

from robust_attn import create_model
from robust_attn.models.checkpoint import (CheckpointError, check_safetensors_file, load_checkpoint, save_checkpoint,
                                    sidecar_path)
from robust_attn.utils.io import atomic_write_text, sha256_file
from robust_attn.models.wrapper import NormalizedModel


def tiny(num_classes=10):
    return NormalizedModel(create_model("resnet26", num_classes, "cifar", width=0.25), (0.5, 0.4, 0.3), (0.2, 0.2, 0.25))


def test_round_trip_restores_weights_buffers_and_normalization(tmp_path):
    model = tiny().eval()
    x = torch.rand(2, 3, 32, 32)
    sha = save_checkpoint(tmp_path / "m.safetensors", model, {"epoch": 3})
    assert sha == sha256_file(tmp_path / "m.safetensors")
    meta = json.loads(sidecar_path(tmp_path / "m.safetensors").read_text())
    assert meta["epoch"] == 3 and meta["arch"]["overrides"] == {"width": 0.25}
    loaded = load_checkpoint(tmp_path / "m.safetensors", expected_sha256=sha)
    assert not loaded.training
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    torch.testing.assert_close(loaded.mean.flatten(), torch.tensor([0.5, 0.4, 0.3]))


def test_wrong_sha256_is_refused(tmp_path):
    save_checkpoint(tmp_path / "m.safetensors", tiny())
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(tmp_path / "m.safetensors", expected_sha256="0" * 64)


def test_weights_that_do_not_fit_the_architecture_are_refused(tmp_path):
    save_checkpoint(tmp_path / "m.safetensors", tiny(num_classes=10))
    meta = json.loads(sidecar_path(tmp_path / "m.safetensors").read_text())
    meta["arch"]["num_classes"] = 5  # sidecar now describes another head
    sidecar_path(tmp_path / "m.safetensors").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="do not fit"):
        load_checkpoint(tmp_path / "m.safetensors")


def test_missing_checkpoint_or_sidecar_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.safetensors")
    save_checkpoint(tmp_path / "m.safetensors", tiny())
    sidecar_path(tmp_path / "m.safetensors").unlink()
    with pytest.raises(CheckpointError, match="sidecar"):
        load_checkpoint(tmp_path / "m.safetensors")


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    target = tmp_path / "f.txt"
    atomic_write_text(target, "old")

    class Boom(Exception):
        pass

    from robust_attn.utils.io import atomic_path
    with pytest.raises(Boom):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise Boom
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_an_atomic_write_has_the_permissions_of_a_plain_one(tmp_path):
    from robust_attn.utils.io import atomic_write_text

    plain = tmp_path / "plain.txt"
    plain.write_text("x")                          # what open() gives under this process's umask
    atomic_write_text(tmp_path / "new.txt", "x")   # not mkstemp's 0600
    assert (tmp_path / "new.txt").stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    plain.chmod(0o640)                             # an existing file keeps its own
    atomic_write_text(plain, "y")
    assert plain.stat().st_mode & 0o777 == 0o640 and plain.read_text() == "y"


def test_wrapper_normalizes_inside():
    inner = torch.nn.Identity()
    wrapped = NormalizedModel(inner, (0.5,), (0.25,))
    x = torch.rand(1, 1, 2, 2)
    torch.testing.assert_close(wrapped(x), (x - 0.5) / 0.25)
    with pytest.raises(ValueError, match="std"):
        NormalizedModel(inner, (0.5,), (0.0,))


def test_a_sidecar_given_as_the_weights_is_named_json(tmp_path):
    """Passing the .json sidecar (or any JSON file) where the weights go names it as JSON text and
    says to pass the .safetensors file, instead of a bare 'not a safetensors file'."""
    save_checkpoint(tmp_path / "m.safetensors", tiny())
    wrong = tmp_path / "wrong.safetensors"
    wrong.write_bytes(sidecar_path(tmp_path / "m.safetensors").read_bytes())
    with pytest.raises(CheckpointError) as err:
        check_safetensors_file(wrong)
    assert "JSON text" in str(err.value) and "pass the .safetensors weights file" in str(err.value)
