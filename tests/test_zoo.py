import json

import pytest
import torch

import robust_attn
from robust_attn.checkpoint import CheckpointError, save_checkpoint
from robust_attn.cli import main
from robust_attn.wrapper import NormalizedModel
from robust_attn.zoo import Manifest, ZooEntry, load_model, verify_zoo


@pytest.fixture
def checkpoint(tmp_path):
    model = NormalizedModel(robust_attn.create_model("resnet26", 10, "cifar", width=0.25), (0.3,) * 3, (0.3,) * 3)
    path = tmp_path / "ckpt" / "resnet26.safetensors"
    save_checkpoint(path, model.eval(), {"metrics": {"top1": 12.5}})
    return path, model


def test_add_then_load_model_returns_the_same_model_in_eval_mode(tmp_path, checkpoint):
    path, model = checkpoint
    manifest_path = tmp_path / "zoo" / "manifest.json"
    assert main(["zoo", "add", "resnet26", "--dataset", "synthetic", "--checkpoint", str(path),
                 "--manifest", str(manifest_path), "--command", "robust-attn train x.toml"]) == 0
    entry = json.loads(manifest_path.read_text())["models"][0]
    assert entry["weights"] == "../ckpt/resnet26.safetensors"   # relative to the manifest
    assert entry["metrics"] == {"top1": 12.5} and entry["command"] == "robust-attn train x.toml"
    loaded = load_model("resnet26", dataset="synthetic", manifest=manifest_path)
    assert not loaded.training
    x = torch.rand(2, 3, 32, 32)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_tampered_weights_are_refused_and_verify_reports_them(tmp_path, checkpoint, capsys):
    path, _ = checkpoint
    manifest_path = tmp_path / "manifest.json"
    main(["zoo", "add", "resnet26", "--dataset", "synthetic", "--checkpoint", str(path), "--manifest", str(manifest_path)])
    assert main(["zoo", "verify", "--manifest", str(manifest_path)]) == 0
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        load_model("resnet26", "synthetic", manifest=manifest_path)
    assert main(["zoo", "verify", "--manifest", str(manifest_path)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_manifest_architecture_must_match_the_sidecar(tmp_path, checkpoint):
    path, _ = checkpoint
    manifest = Manifest(tmp_path / "manifest.json")
    from robust_attn.zoo import entry_from_checkpoint
    entry = entry_from_checkpoint("resnet26", "synthetic", path, manifest)
    entry.arch = dict(entry.arch, overrides={"width": 0.5})
    manifest.add(entry)
    manifest.save()
    with pytest.raises(CheckpointError, match="edited by hand"):
        load_model("resnet26", "synthetic", manifest=manifest.path)
    assert verify_zoo(Manifest(manifest.path))[0][1] is not None


def test_unknown_entry_names_what_the_zoo_has(tmp_path):
    with pytest.raises(KeyError, match="nothing yet"):
        load_model("resnet26", "fashion_mnist", manifest=tmp_path / "missing.json")


def test_invalid_entries_are_rejected():
    with pytest.raises(ValueError, match="sha256"):
        ZooEntry(name="x", dataset="d", weights="w.safetensors", sha256="abc")
    with pytest.raises(ValueError, match="source"):
        ZooEntry(name="x", dataset="d", source="http")


def test_torchvision_entry_is_recorded_without_downloading(tmp_path):
    manifest_path = tmp_path / "manifest.json"
    assert main(["zoo", "add", "tv_resnet50", "--dataset", "imagenet", "--torchvision", "resnet50",
                 "--weights", "IMAGENET1K_V1", "--manifest", str(manifest_path)]) == 0
    entry = Manifest(manifest_path).get("tv_resnet50", "imagenet")
    assert entry.source == "torchvision" and entry.torchvision == {"model": "resnet50", "weights": "IMAGENET1K_V1"}


def test_shipped_manifest_verifies():
    results = verify_zoo()
    assert all(error is None for _, error in results), results
