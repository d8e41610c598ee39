"""The worked examples of docs/extending.md do what the page says: each is read from the page,
loaded as a module (its registrations run, as they would from its file in the package) and
checked against a reference written here; the registrations are taken out again afterwards."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from robust_attn.cli import main
from robust_attn.data import build_dataset, dataset_info

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "extending.md"
SYNTHETIC_MEAN, SYNTHETIC_STD = dataset_info("synthetic").mean, dataset_info("synthetic").std


def examples() -> dict[str, str]:
    """The page's example files: path in the repository -> code."""
    blocks = re.findall(r"```python\n# (robust_attn/\S+\.py)\n(.*?)```", PAGE.read_text(), flags=re.S)
    return {path: code for path, code in blocks}


def _registries():
    from robust_attn.attacks.base import ATTACKS
    from robust_attn.data.base import DATASETS
    from robust_attn.protocols.eval_step import EVAL_PROTOCOLS
    from robust_attn.protocols.report_section import REPORT_SECTIONS
    from robust_attn.protocols.study_step import STUDY_PROTOCOLS
    from robust_attn.sources import SOURCES

    return [ATTACKS, DATASETS, EVAL_PROTOCOLS, REPORT_SECTIONS, STUDY_PROTOCOLS, SOURCES]


@pytest.fixture
def load_example(tmp_path):
    """``load_example(path)``: the example of ``path`` as a module; what it registered is removed
    from the registries after the test."""
    registries = _registries()
    before = [set(r.names()) for r in registries]   # discovered first: only the example's names are new
    loaded = []

    def load(path: str):
        name = "extending_example_" + Path(path).stem
        file = tmp_path / f"{name}.py"
        file.write_text(examples()[path])
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        loaded.append(name)
        spec.loader.exec_module(module)
        return module

    yield load
    for registry, names in zip(registries, before):
        for name in set(registry.names()) - names:
            registry.remove(name)
    for name in loaded:
        sys.modules.pop(name, None)


def test_the_page_has_one_example_per_plug_in_point_each_a_new_file_of_its_package():
    paths = sorted(examples())
    assert [Path(p).parent.name for p in paths] == ["attacks", "data", "protocols", "sources"]
    for path in paths:
        assert (ROOT / Path(path).parent / "__init__.py").is_file()
        assert not (ROOT / path).exists()   # an example, not a module the package ships


def _colours_model(num_classes: int = 10) -> torch.nn.Module:
    """Logits from the mean colour: enough to know the prediction without the data pipeline."""
    torch.manual_seed(0)
    fc = torch.nn.Linear(3, num_classes)

    class Colours(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = fc

        def forward(self, x):
            return self.fc(x.mean((2, 3)))

    return Colours().eval()


def test_the_attack_example(load_example, capsys):
    load_example("robust_attn/attacks/fgsm.py")
    from robust_attn.attacks.base import AttackConfig, list_attacks, make_attack

    assert "fgsm" in list_attacks()
    torch.manual_seed(1)
    linear = torch.nn.Linear(3 * 4 * 4, 5)
    model = torch.nn.Sequential(torch.nn.Flatten(), linear).eval()
    images, labels = torch.rand(6, 3, 4, 4), torch.tensor([0, 1, 2, 3, 4, 0])
    adv = make_attack(AttackConfig("fgsm", eps=8 / 255)).run(model, images, labels).adv
    # the gradient of the cross-entropy of a linear model: W^T (softmax - one-hot), per image
    with torch.no_grad():
        p = torch.softmax(images.flatten(1) @ linear.weight.T + linear.bias, 1)
        grad = (p - torch.nn.functional.one_hot(labels, 5)) @ linear.weight
    expected = (images + 8 / 255 * grad.sign().view_as(images)).clamp(0, 1)
    assert torch.allclose(adv, expected, atol=1e-6)
    with pytest.raises(SystemExit):
        main(["eval", "attack", "--help"])
    assert "fgsm" in capsys.readouterr().out


PROBE = ("import torch\n\n\ndef colours(num_classes=10):\n    torch.manual_seed(0)\n"
         "    fc = torch.nn.Linear(3, num_classes)\n"
         "    return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), fc)\n")


def test_the_attack_example_joins_the_study(load_example, tmp_path):
    load_example("robust_attn/attacks/fgsm.py")
    from robust_attn.runs.store import load_records
    from robust_attn.study.config import StudyModel, study_config_class
    from robust_attn.study.run import run_study

    (tmp_path / "probe.py").write_text(PROBE)
    config = study_config_class()(
        dataset="synthetic", limit=6, attack_limit=4, attack_batch_size=4, batch_size=6, bootstrap=10,
        protocols=("fgsm",), fgsm_eps=(2 / 255, 8 / 255), baseline="colours",
        models=(StudyModel(f"{tmp_path / 'probe.py'}:colours", label="colours"),))
    run_study(config, tmp_path / "runs", tmp_path / "report", device="cpu", progress=False, log=lambda *_: None)
    records = load_records(tmp_path / "runs" / "fgsm-colours")
    assert records.groupby("condition").size().to_dict() == {"clean": 4, "fgsm_linf_eps2": 4, "fgsm_linf_eps8": 4}
    assert "FGSM at eps [2.0, 8.0]/255" in (tmp_path / "report" / "report.md").read_text()
    with pytest.raises(ValueError, match="fgsm_eps are radii in image units"):
        study_config_class()(dataset="synthetic", fgsm_eps=(8.0,))


def test_the_protocol_example(load_example, tmp_path, capsys):
    module = load_example("robust_attn/protocols/grayscale.py")
    (tmp_path / "probe.py").write_text(PROBE)
    out = tmp_path / "run"
    assert main(["eval", "grayscale", "--gray-mix", "0.5,1", "--model", f"{tmp_path / 'probe.py'}:colours",
                 "--dataset", "synthetic", "--limit", "6", "--batch-size", "3", "--device", "cpu",
                 "--no-progress", "--out", str(out)]) == 0
    from robust_attn.runs.store import load_records

    records = load_records(out)
    assert sorted(records["condition"].unique()) == ["clean", "gray0.5", "gray1"]
    # reference: the mean colour of each image, mixed with its luma, normalized, through the same layer
    dataset = build_dataset("synthetic", split="test", limit=6)
    fc = _colours_model().fc
    luma = np.array([0.299, 0.587, 0.114])
    for index in sorted(records["index"].unique()):
        image, label = dataset[int(index)]
        colour = image.double().mean((1, 2)).numpy()
        for name, mix in (("clean", 0.0), ("gray0.5", 0.5), ("gray1", 1.0)):
            mixed = (1 - mix) * colour + mix * (luma @ colour)
            x = (torch.tensor(mixed, dtype=torch.float32) - torch.tensor(SYNTHETIC_MEAN)) / torch.tensor(SYNTHETIC_STD)
            with torch.no_grad():
                expected = int(fc(x).argmax())
            row = records[(records["condition"] == name) & (records["index"] == index)]
            assert (int(row["pred"].iloc[0]), int(row["label"].iloc[0])) == (expected, label)
    # its report section and its place in the study (config field, option, check)
    from robust_attn.reports import make_report

    make_report([out], tmp_path / "report", n_boot=10, plots=False)
    assert "## Grayscale" in (tmp_path / "report" / "report.md").read_text()
    assert (tmp_path / "report" / "grayscale_conditions.csv").is_file()
    from robust_attn.study import config as study_config

    config_cls = study_config.study_config_class()
    assert config_cls(dataset="synthetic").gray_mix == (0.5, 1.0)
    with pytest.raises(ValueError, match="gray_mix are shares in"):
        config_cls(dataset="synthetic", gray_mix=(2.0,))
    with pytest.raises(SystemExit):
        main(["study", "--help"])
    assert "--gray-mix" in capsys.readouterr().out
    assert module.to_gray(torch.ones(1, 3, 2, 2), 1.0).allclose(torch.ones(1, 1, 2, 2))
    # its cost in the study's plan: the clean pass and one per mix
    from robust_attn.study.estimate import protocol_passes

    assert protocol_passes("grayscale", config_cls(dataset="synthetic", gray_mix=(0.25, 0.5, 1.0))).forward == 4


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")
def test_the_model_source_example(load_example, tmp_path):
    load_example("robust_attn/sources/torchscript_source.py")
    from robust_attn.sources import SourceError, check_spec, load_model_spec, spec_label

    net = _colours_model()
    path = tmp_path / "colours.pt"
    torch.jit.save(torch.jit.script(net), str(path))
    info = dataset_info("synthetic")
    loaded = load_model_spec(f"torchscript:{path}", dataset_info=info)
    images = torch.rand(4, 3, info.image_size, info.image_size)
    with torch.no_grad():
        expected = net((images - torch.tensor(info.mean).view(1, 3, 1, 1)) / torch.tensor(info.std).view(1, 3, 1, 1))
        assert torch.allclose(loaded.model(images), expected, atol=1e-6)
    assert loaded.description["weights_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert loaded.description["source"] == "torchscript" and spec_label(f"torchscript:{path}") == "colours"
    with pytest.raises(SourceError, match="does not exist"):
        check_spec(f"torchscript:{tmp_path / 'missing.pt'}")


def test_the_dataset_example(load_example, tmp_path):
    from PIL import Image

    module = load_example("robust_attn/data/imagenette.py")
    wnids = (ROOT / "robust_attn" / "data" / "imagenet_wnids.txt").read_text().split()
    folder = tmp_path / "imagenette2" / "val"
    chosen = [module.WNIDS[0], module.WNIDS[4], module.WNIDS[9]]
    for wnid in chosen:
        (folder / wnid).mkdir(parents=True)
        Image.new("RGB", (40, 30), (200, 30, 30)).save(folder / wnid / "a.JPEG", format="JPEG")
    info = dataset_info("imagenette")
    assert info.num_classes == 10 and list(info.logit_subset) == [wnids.index(w) for w in module.WNIDS]
    dataset = build_dataset("imagenette", root=tmp_path)
    assert sorted((Path(p).parent.name, y) for p, y in dataset.samples) == [(w, module.WNIDS.index(w)) for w in chosen]
    assert json.loads(json.dumps(info.logit_subset)) == [wnids.index(w) for w in module.WNIDS]
