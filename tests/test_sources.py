"""Model specs: every source builds, gives its preprocessing, records where the model
came from; bad specs are clear errors. CPU, random weights, no network."""
from __future__ import annotations

import hashlib
import json
import math
import sys
import types

import pytest
import torch
import torch.nn as nn

from robust_attn.models.checkpoint import CheckpointError, load_checkpoint
from robust_attn.cli import main
from robust_attn.data import dataset_info
from robust_attn.sources import (LoadedModel, Preprocessing, SourceError, load_model_spec, parse_spec, spec_label,
                                 state_dict_sha256)
from robust_attn.sources.base import load_weights_file
from robust_attn.models.wrapper import NormalizedModel

SYNTH = dataset_info("synthetic")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CLI = ["--dataset", "synthetic", "--limit", "2", "--batch-size", "2", "--angle-step", "0", "--no-hflip",
       "--no-progress"]

USER_FILE = """
import torch.nn as nn

def make(num_classes=10, width=4):
    return nn.Sequential(nn.Conv2d(3, width, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(width, num_classes))

def five():
    return make(num_classes=5)

def not_a_module(num_classes=10):
    return {"num_classes": num_classes}

def with_preprocessing(num_classes=10):
    net = make(num_classes)
    net.preprocessing = {"mean": (0.2, 0.3, 0.4), "std": (0.5, 0.5, 0.5), "input_size": 64, "resize_size": 72,
                         "crop_size": 64, "interpolation": "bicubic"}
    return net

def bad_preprocessing(num_classes=10):
    net = make(num_classes)
    net.preprocessing = {"size": 64}
    return net

def raises(num_classes=10):
    raise RuntimeError("weights file not found")
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(USER_FILE)
    return path


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- parsing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, source, target", [
    ("resnet26", "registry", "resnet26"),
    ("zoo:resnet26", "zoo", "resnet26"),
    ("timm:vit_small_patch16_224", "timm", "vit_small_patch16_224"),
    ("torchvision:resnet18:none", "torchvision", "resnet18:none"),
    ("san-official:/x/san10.pth", "san-official", "/x/san10.pth"),
    ("/x/m.py:make", "callable", "/x/m.py:make"),
    ("pkg.module:make", "callable", "pkg.module:make"),
])
def test_spec_forms_pick_their_source(spec, source, target):
    assert parse_spec(spec) == (source, target)


@pytest.mark.parametrize("spec, label", [
    ("resnet26", "resnet26"), ("zoo:san10_pairwise", "san10_pairwise"), ("timm:halonet26t", "timm-halonet26t"),
    ("timm:resnet50.a1_in1k", "timm-resnet50_a1_in1k"), ("torchvision:swin_t:IMAGENET1K_V1", "torchvision-swin_t"),
    ("san-official:/ckpt/model_best.pth:san15_patchwise", "san15_patchwise"),
    ("san-official:/ckpt/san19_pairwise.pth", "san19_pairwise"), ("/x/my net.py:build", "my_net-build"),
    ("pkg.models:vit_tiny", "models-vit_tiny"),
])
def test_spec_labels_name_folders_and_report_rows(spec, label):
    assert spec_label(spec) == label


# --- torchvision -----------------------------------------------------------------------------
def test_torchvision_random_init_takes_preprocessing_from_the_weights_metadata():
    tvm = pytest.importorskip("torchvision.models")
    loaded = load_model_spec("torchvision:resnet18:none", dataset_info=SYNTH, seed=3)
    ref = tvm.ResNet18_Weights.DEFAULT.transforms()    # metadata: no download
    p = loaded.preprocessing
    assert (p.resize_size, p.crop_size, p.input_size, p.interpolation) == (256, 224, 224, "bilinear")
    assert [p.resize_size] == list(ref.resize_size) and [p.crop_size] == list(ref.crop_size)
    assert p.interpolation == ref.interpolation.value
    assert p.mean == pytest.approx(ref.mean) and p.std == pytest.approx(ref.std)
    assert p.mean == pytest.approx(IMAGENET_MEAN) and p.std == pytest.approx(IMAGENET_STD)
    # torchvision's net takes ImageNet-normalized input: the wrapper holds the weights' mean/std
    model = loaded.model
    assert isinstance(model, NormalizedModel) and not model.training
    torch.testing.assert_close(model.mean.flatten(), torch.tensor(IMAGENET_MEAN))
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        ref_out = model.model((x - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1))
                              / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1))
    assert out.shape == (2, 10)   # random init: the head is the dataset's
    torch.testing.assert_close(out, ref_out)
    d = loaded.description
    assert d["source"] == "torchvision" and d["spec"] == "torchvision:resnet18:none"
    assert d["preprocessing"] == p.as_dict() and d["weights_sha256"] == state_dict_sha256(model)
    # the hash tells weights apart: same seed, same hash; another seed, another
    assert load_model_spec("torchvision:resnet18:none", dataset_info=SYNTH, seed=3,
                           check=False).description["weights_sha256"] == d["weights_sha256"]
    assert load_model_spec("torchvision:resnet18:none", dataset_info=SYNTH, seed=4,
                           check=False).description["weights_sha256"] != d["weights_sha256"]


def test_torchvision_local_weights_file_and_bad_weights_names(tmp_path):
    tvm = pytest.importorskip("torchvision.models")
    torch.manual_seed(7)
    net = tvm.resnet18(num_classes=10)
    path = tmp_path / "r18.pth"
    torch.save({"state_dict": net.state_dict()}, path)
    loaded = load_model_spec("torchvision:resnet18", dataset_info=SYNTH, checkpoint=path, check=False)
    assert loaded.description["weights_sha256"] == _sha256(path)
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), net.eval()(
            (x - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)))
    with pytest.raises(SourceError, match="has no weights 'IMAGENET9'.*IMAGENET1K_V1"):
        load_model_spec("torchvision:resnet18:IMAGENET9", dataset_info=SYNTH)
    with pytest.raises(SourceError, match="no classification model 'resnet181'.*Did you mean resnet18"):
        load_model_spec("torchvision:resnet181:none", dataset_info=SYNTH)


def test_torchvision_records_parameters_and_random_origin_on_imagenet():
    tvm = pytest.importorskip("torchvision.models")
    loaded = load_model_spec("torchvision:resnet18:none", dataset_info=dataset_info("imagenet"), check=False)
    d = loaded.description
    assert d["params"] == tvm.ResNet18_Weights.IMAGENET1K_V1.meta["num_params"]   # torchvision's own count
    assert d["weights_origin"] == "random" and d["init_seed"] == 0


def test_pretrained_torchvision_weights_of_other_classes_are_refused_before_any_download(monkeypatch):
    pytest.importorskip("torchvision.models")
    from torchvision.models._api import WeightsEnum

    def download(self, *args, **kwargs):
        raise AssertionError("no download should be tried")

    monkeypatch.setattr(WeightsEnum, "get_state_dict", download)
    with pytest.raises(SourceError, match="IMAGENET1K_V1 weights classify 1000 classes but dataset synthetic has "
                                          "10.*torchvision:resnet18:none with --checkpoint"):
        load_model_spec("torchvision:resnet18:IMAGENET1K_V1", dataset_info=SYNTH)


# --- zoo, registry ---------------------------------------------------------------------------
def test_zoo_spec_loads_the_manifest_entry_by_its_hash():
    from robust_attn.models.manifest import Manifest

    entry = Manifest().get("resnet26", "fashion_mnist")
    loaded = load_model_spec("zoo:resnet26", dataset_info=dataset_info("fashion_mnist"))
    path = Manifest().resolve(entry.weights)
    d = loaded.description
    assert d["source"] == "zoo" and d["spec"] == "zoo:resnet26" and loaded.preprocessing is None
    assert d["weights_sha256"] == entry.sha256 == _sha256(path)
    x = torch.rand(3, 3, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), load_checkpoint(path)(x))
    with pytest.raises(SourceError, match="no 'resnet26' trained on 'synthetic'"):
        load_model_spec("zoo:resnet26", dataset_info=SYNTH)


def test_registry_spec_records_source_and_hash():
    kw = dict(dataset_info=SYNTH, model_args={"width": 0.25, "stem_downsample": 4})
    a = load_model_spec("resnet26", seed=1, **kw)
    assert a.preprocessing is None and a.description["source"] == "registry" and a.description["spec"] == "resnet26"
    torch.testing.assert_close(a.model.mean.flatten(), torch.tensor(SYNTH.mean))
    assert a.description["weights_sha256"] == load_model_spec("resnet26", seed=1, **kw).description["weights_sha256"]
    assert a.description["weights_sha256"] != load_model_spec("resnet26", seed=2, **kw).description["weights_sha256"]


# --- a user's function -----------------------------------------------------------------------
def test_user_file_through_the_cli_records_its_source(tmp_path, user_file, capsys):
    out = tmp_path / "run"
    spec = f"{user_file}:make"
    assert main(["eval", "rotation", "--model", spec, *CLI, "--out", str(out)]) == 0
    desc = json.loads((out / "run.json").read_text())
    assert desc["source"] == "callable" and desc["spec"] == spec and desc["file"] == str(user_file.resolve())
    assert desc["preprocessing"] is None and len(desc["weights_sha256"]) == 64
    assert desc["weights_origin"] == "user" and desc["params"] == 3 * 4 * 9 + 4 + 4 * 10 + 10
    assert "rotation m-make on synthetic" in capsys.readouterr().out


def test_user_function_may_carry_its_preprocessing(user_file):
    loaded = load_model_spec(f"{user_file}:with_preprocessing", dataset_info=dataset_info("imagenet"),
                             model_args={"num_classes": 1000})
    p = loaded.preprocessing
    assert (p.input_size, p.resize_size, p.crop_size, p.interpolation) == (64, 72, 64, "bicubic")
    assert loaded.description["preprocessing"] == p.as_dict() and loaded.description["weights_origin"] == "user"
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():   # the wrapper normalizes with the model's own mean/std, not the dataset's
        ref = loaded.model.model((x - torch.tensor([0.2, 0.3, 0.4]).view(1, 3, 1, 1)) / 0.5)
        torch.testing.assert_close(loaded.model(x), ref)
    with pytest.raises(SourceError, match="unknown keys \\['size'\\].*give mean, std, input_size"):
        load_model_spec(f"{user_file}:bad_preprocessing", dataset_info=SYNTH)


def test_user_function_is_wrapped_with_the_dataset_normalization(user_file):
    loaded = load_model_spec(f"{user_file}:make", dataset_info=SYNTH, model_args={"width": 6}, seed=5)
    namespace: dict = {}
    exec(USER_FILE, namespace)
    torch.manual_seed(5)
    ref = namespace["make"](num_classes=10, width=6).eval()   # the same draws: the same weights
    x = torch.rand(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), ref((x - 0.5) / 0.25))
    assert loaded.description["arch"]["width"] == 6


def test_package_module_function_returning_its_own_normalized_model(tmp_path, monkeypatch):
    pkg = tmp_path / "userpkg_issue15"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(USER_FILE + """
from robust_attn.models.wrapper import NormalizedModel

def wrapped(num_classes=10):
    return NormalizedModel(make(num_classes), (0.1, 0.2, 0.3), (0.5, 0.5, 0.5))
""")
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = load_model_spec("userpkg_issue15.nets:wrapped", dataset_info=SYNTH)
    torch.testing.assert_close(loaded.model.mean.flatten(), torch.tensor([0.1, 0.2, 0.3]))   # taken as is
    assert not isinstance(loaded.model.model, NormalizedModel)
    assert loaded.description["module"] == "userpkg_issue15.nets"
    monkeypatch.delitem(sys.modules, "userpkg_issue15.nets")
    monkeypatch.delitem(sys.modules, "userpkg_issue15")


# --- san-official ----------------------------------------------------------------------------
def test_san_official_file_converts_like_the_importer(tmp_path):
    test_importers = pytest.importorskip("test_importers")
    from robust_attn.importers.san_official import import_san_official

    official = test_importers.random_official("san10", pairwise=True)
    src = tmp_path / "san10_pairwise.pth"
    torch.save({"epoch": 100, "state_dict": {f"module.{k}": v for k, v in official.items()}}, src)
    imagenet = dataset_info("imagenet")
    loaded = load_model_spec(f"san-official:{src}", dataset_info=imagenet, check=False)
    d = loaded.description
    assert d["source"] == "san-official" and d["model"] == "san10_pairwise" and d["weights_sha256"] == _sha256(src)
    p = loaded.preprocessing   # the authors' tool/test.py: Resize(256), CenterCrop(224), ImageNet mean/std
    assert (p.resize_size, p.crop_size, p.interpolation) == (256, 224, "bilinear") and p.mean == IMAGENET_MEAN
    import_san_official(src, "san10_pairwise", tmp_path / "ref.safetensors")
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), load_checkpoint(tmp_path / "ref.safetensors")(x))
    with pytest.raises(SourceError, match="does not exist"):
        load_model_spec(f"san-official:{tmp_path / 'nope.pth'}", dataset_info=imagenet)


# --- timm (optional) -------------------------------------------------------------------------
def test_timm_model_builds_when_timm_is_installed():
    timm = pytest.importorskip("timm")
    loaded = load_model_spec("timm:resnet18", dataset_info=SYNTH, model_args={"pretrained": False})
    cfg = timm.data.resolve_data_config({}, model=loaded.model.model)
    p = loaded.preprocessing
    assert p.crop_size == cfg["input_size"][1] and p.resize_size == math.floor(cfg["input_size"][1] / cfg["crop_pct"])
    assert p.mean == pytest.approx(cfg["mean"]) and loaded.description["source"] == "timm"


def test_without_timm_the_error_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "timm", None)   # import timm -> ImportError, installed or not
    with pytest.raises(SourceError, match="pip install timm"):
        load_model_spec("timm:resnet18", dataset_info=SYNTH)
    assert main(["eval", "rotation", "--model", "timm:resnet18", *CLI, "--out", str(tmp_path / "r")]) == 2
    assert "pip install timm" in capsys.readouterr().err


def test_timm_config_becomes_the_preprocessing(monkeypatch):
    """A stand-in timm module: the source's use of create_model and the pretrained config."""
    calls = {}

    def create_model(name, pretrained=False, **kwargs):
        calls.clear()
        calls.update(name=name, pretrained=pretrained, **kwargs)
        net = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, kwargs.get("num_classes", 1000)))
        net.pretrained_cfg = {"tag": "fake_in1k"}
        return net

    config = {"input_size": (3, 240, 240), "interpolation": "bicubic", "mean": (0.5, 0.45, 0.4),
              "std": (0.25, 0.2, 0.3), "crop_pct": 0.9, "crop_mode": "center"}
    fake = types.ModuleType("timm")
    fake.__version__ = "0.fake"
    fake.is_model = lambda name: name == "fakenet"
    fake.list_models = lambda: ["fakenet"]
    fake.create_model = create_model
    fake.data = types.ModuleType("timm.data")
    fake.data.resolve_data_config = lambda args, model=None: dict(config)
    monkeypatch.setitem(sys.modules, "timm", fake)
    monkeypatch.setitem(sys.modules, "timm.data", fake.data)
    loaded = load_model_spec("timm:fakenet", dataset_info=SYNTH, model_args={"pretrained": False})
    assert calls == {"name": "fakenet", "pretrained": False, "num_classes": 10}
    assert loaded.preprocessing == Preprocessing(mean=(0.5, 0.45, 0.4), std=(0.25, 0.2, 0.3), input_size=240,
                                                 resize_size=int(240 / 0.9), crop_size=240, interpolation="bicubic")
    torch.testing.assert_close(loaded.model.mean.flatten(), torch.tensor([0.5, 0.45, 0.4]))
    torch.testing.assert_close(loaded.model.std.flatten(), torch.tensor([0.25, 0.2, 0.3]))
    # pretrained (the default): timm's own head is kept, and a 1000-class head is refused on 10 classes
    with pytest.raises(CheckpointError, match="outputs 1000 classes but the dataset has 10"):
        load_model_spec("timm:fakenet", dataset_info=SYNTH)
    assert calls["pretrained"] is True and "num_classes" not in calls
    with pytest.raises(SourceError, match="timm has no model 'fakenet2'.*Did you mean fakenet"):
        load_model_spec("timm:fakenet2", dataset_info=SYNTH)


# --- preprocessing ---------------------------------------------------------------------------
def test_eval_transform_resizes_and_crops_without_normalizing():
    from PIL import Image
    import torchvision.transforms.functional as TF

    p = Preprocessing(mean=IMAGENET_MEAN, std=IMAGENET_STD, input_size=8, resize_size=10, crop_size=8,
                      interpolation="bilinear")
    image = torch.rand(3, 20, 30)
    out = p.eval_transform()(image)
    ref = TF.center_crop(TF.resize(image, 10, antialias=True), 8)   # shorter side 10 -> 10x15 -> 8x8
    assert out.shape == (3, 8, 8) and 0 <= out.min() and out.max() <= 1
    torch.testing.assert_close(out, ref)
    pil = Image.fromarray((image.permute(1, 2, 0).numpy() * 255).astype("uint8"))
    out_pil = p.eval_transform()(pil)
    assert out_pil.dtype == torch.float32 and out_pil.shape == (3, 8, 8) and 0 <= out_pil.min() <= out_pil.max() <= 1
    assert p.as_dict() == {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "input_size": 8,
                           "resize_size": 10, "crop_size": 8, "interpolation": "bilinear"}
    with pytest.raises(SourceError, match="interpolation"):
        Preprocessing(mean=IMAGENET_MEAN, std=IMAGENET_STD, input_size=8, resize_size=10, crop_size=8,
                      interpolation="cubic-ish")


# --- bad specs through the CLI: exit 2 and the fix -------------------------------------------
@pytest.mark.parametrize("spec, message", [
    ("tim:resnet18", "Did you mean 'timm:'"),
    ("zo:resnet26", "Did you mean 'zoo:'"),
    ("{tmp}/missing.py:make", "does not exist"),
    ("{tmp}/m.py:not_a_module", "returned a dict, not a torch.nn.Module"),
    ("{tmp}/m.py:nothing", "has no function 'nothing'; it defines: bad_preprocessing, five, make, not_a_module, "
                           "raises, with_"),
    ("{tmp}/m.py:raises", "raised RuntimeError: weights file not found (at {tmp}/m.py:"),
    ("{tmp}/m.py:five", "outputs 5 classes but the dataset has 10"),
    ("{tmp}/m.py", "name the function"),
    ("bad-source:x", "unknown model source 'bad-source'"),
    ("nosuchpkg_issue15.models:make", "no importable module 'nosuchpkg_issue15'"),
])
def test_bad_specs_are_clear_errors(spec, message, tmp_path, user_file, capsys):
    spec = spec.format(tmp=user_file.parent)
    assert main(["eval", "rotation", "--model", spec, *CLI, "--out", str(tmp_path / "run")]) == 2
    assert message.format(tmp=user_file.parent) in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_loaded_model_is_returned_in_eval_mode_on_the_device(user_file):
    loaded = load_model_spec(f"{user_file}:make", dataset_info=SYNTH, device="cpu")
    assert isinstance(loaded, LoadedModel) and not loaded.model.training
    assert next(loaded.model.parameters()).device.type == "cpu"


def test_user_function_with_var_keywords_gets_the_dataset_class_count(tmp_path):
    path = tmp_path / "kw.py"
    path.write_text("import torch.nn as nn\n\n"
                    "def make(**kwargs):\n"
                    "    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),\n"
                    "                         nn.Linear(3, kwargs.get('num_classes', 1000)))\n")
    loaded = load_model_spec(f"{path}:make", dataset_info=SYNTH, check=False)
    with torch.no_grad():
        assert loaded.model(torch.rand(2, 3, 8, 8)).shape == (2, SYNTH.num_classes)


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_weights_file_with_missing_or_extra_keys_is_refused(tmp_path, change):
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    state = dict(net.state_dict())
    if change == "missing":
        del state["3.bias"]
    else:
        state["4.weight"] = torch.zeros(2, 2)
    path = tmp_path / "w.pth"
    torch.save(state, path)
    fresh = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(SourceError, match="do not fit"):
        load_weights_file(fresh, path, "m.py:make")


def test_weights_hash_covers_buffers():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    b = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    b.load_state_dict(a.state_dict())
    assert state_dict_sha256(a) == state_dict_sha256(b)
    b[1].running_mean.add_(0.5)          # same parameters, other BN statistics: other weights
    assert state_dict_sha256(a) != state_dict_sha256(b)
    inner = nn.Linear(3, 2)
    assert state_dict_sha256(NormalizedModel(inner, (0.5,) * 3, (0.25,) * 3)) != \
        state_dict_sha256(NormalizedModel(inner, (0.4,) * 3, (0.25,) * 3))


def test_record_preprocessing_keeps_the_weights_own_apart_when_not_applied(capsys):
    from robust_attn.sources.inputs import record_preprocessing

    own = Preprocessing(mean=(0.5,) * 3, std=(0.5,) * 3, input_size=224, resize_size=256, crop_size=224)
    desc = {"model": "m", "preprocessing": own.as_dict()}
    out = record_preprocessing(desc, None)          # a tensor dataset: images used as they are
    assert out["preprocessing"] is None and out["weights_preprocessing"] == own.as_dict()
    assert "evaluated as they are" in capsys.readouterr().err
    applied = record_preprocessing(desc, own)       # a file dataset: the model's transform applied
    assert applied["preprocessing"] == own.as_dict() and "weights_preprocessing" not in applied


@pytest.mark.parametrize("mode", ["squash", "border"])
def test_timm_crop_modes_other_than_center_are_refused(mode):
    from robust_attn.sources.timm_source import preprocessing_of

    config = {"input_size": (3, 224, 224), "interpolation": "bicubic", "mean": (0.5,) * 3, "std": (0.5,) * 3,
              "crop_pct": 0.9}
    assert preprocessing_of(dict(config, crop_mode="center")).resize_size == 248
    with pytest.raises(SourceError, match=f"crop_mode='{mode}'"):
        preprocessing_of(dict(config, crop_mode=mode))
