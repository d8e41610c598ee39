"""ImageNet as users hold it (class folders, flat val + ground truth) and the generic image folder."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from robust_attn.cli import main
from robust_attn.data import build_dataset, dataset_info, takes_transform
from robust_attn.data import imagenet

FIRST, LAST = "n01440764", "n15075141"


def _image(path: Path, value: int, size=(260, 240)) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color=(value, 20, 200)).save(path)


def _eval(tmp_path, dataset, root, model=("resnet26", "--model-args", "width=0.25")):
    out = tmp_path / "run"
    rc = main(["eval", "rotation", "--model", *model, "--dataset", dataset,
               "--root", str(root), "--limit", "2", "--batch-size", "2", "--angle-step", "0", "--no-progress",
               "--out", str(out)])
    return rc, out


# --- the wnid list --------------------------------------------------------------------------

def test_wnid_list_is_the_sorted_ilsvrc2012_list():
    data = (Path(imagenet.__file__).parent / "imagenet_wnids.txt").read_bytes()
    assert hashlib.sha256(data).hexdigest() == imagenet.WNIDS_SHA256
    wnids = imagenet.wnids()
    assert len(wnids) == len(set(wnids)) == 1000 and list(wnids) == sorted(wnids)
    assert wnids[0] == FIRST and wnids[-1] == LAST
    assert all(len(w) == 9 and w[0] == "n" and w[1:].isdigit() for w in wnids)
    # well-known indices of the standard order: 1 goldfish, 207 golden retriever, 281 tabby, 409 analog clock
    assert [wnids[i] for i in (1, 207, 281, 409)] == ["n01443537", "n02099601", "n02123045", "n02708093"]


# --- class-folder layout --------------------------------------------------------------------

def test_class_subset_keeps_true_indices(tmp_path):
    """Only two classes present: labels are 0 and 999 (their places in the 1,000), not 0 and 1."""
    for wnid, value in ((FIRST, 40), (LAST, 220)):
        for j in range(2):
            _image(tmp_path / "imagenet" / "val" / wnid / f"{wnid}_{j}.JPEG", value)
    val = build_dataset("imagenet", root=tmp_path, split="test")
    assert val.targets == [0, 0, 999, 999] and val.num_classes == 1000
    assert val.classes == [FIRST, LAST] and val.class_to_idx == {FIRST: 0, LAST: 999}
    image, label = val[3]
    assert label == 999 and image.shape == (3, 224, 224) and abs(image[0].mean().item() * 255 - 220) < 3
    small = build_dataset("imagenet", root=tmp_path, split="test", limit=2)
    assert small.num_classes == 1000 and small.targets == [small[i][1] for i in range(2)]


def test_non_wnid_folder_is_an_error_naming_it(tmp_path):
    for name in ("n01440764", "cats"):
        _image(tmp_path / "val" / name / "a.jpg", 10)
    with pytest.raises(ValueError, match="'cats'.*imagefolder"):
        build_dataset("imagenet", root=tmp_path, split="test")


def test_imagenet_cli_on_a_two_class_folder_is_an_error(tmp_path, capsys):
    """The bad-input case: a 1000-class model on a folder of own classes no longer runs silently."""
    for name in ("cat", "dog"):
        _image(tmp_path / "imgs" / "val" / name / "a.jpg", 10)
    rc, out = _eval(tmp_path, "imagenet", tmp_path / "imgs")
    assert rc == 2 and "not ImageNet-1k wnids" in capsys.readouterr().err and not (out / "records").exists()
    for name in ("cat", "dog"):  # the classes straight under --root: not found, with the hint
        _image(tmp_path / "own" / name / "a.jpg", 10)
    rc, _ = _eval(tmp_path, "imagenet", tmp_path / "own")
    assert rc == 2 and "--dataset imagefolder" in capsys.readouterr().err


# --- flat validation folder -----------------------------------------------------------------

def _flat_val(root: Path, wnids: dict[int, str]) -> None:
    for k in wnids:
        _image(root / "val" / f"ILSVRC2012_val_{k:08d}.JPEG", 3 * k, size=(300, 256))


def test_flat_val_with_loc_solution_csv(tmp_path):
    wnids = {1: "n01751748", 2: "n09193705", 5: FIRST, 7: LAST}
    _flat_val(tmp_path, wnids)
    rows = ["ImageId,PredictionString"] + [f"ILSVRC2012_val_{k:08d},{w} 10 20 100 200 {w} 5 5 50 50"
                                           for k, w in sorted(wnids.items(), reverse=True)]
    rows.append("ILSVRC2012_val_00000099,n02119789 1 1 2 2")  # an image not present: ignored
    (tmp_path / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
    val = build_dataset("imagenet", root=tmp_path, split="test")
    index = imagenet.wnid_index()
    assert val.targets == [index[wnids[k]] for k in sorted(wnids)]
    assert val.targets[2:] == [0, 999] and val.variant == "imagenet-val-original"
    assert val.ground_truth == str(tmp_path / "LOC_val_solution.csv")
    image, label = val[1]
    assert image.shape == (3, 224, 224) and label == index["n09193705"]


def test_flat_val_with_filename_wnid_table_and_missing_entries(tmp_path):
    _flat_val(tmp_path, {3: FIRST, 4: LAST})
    (tmp_path / "val" / "val_labels.txt").write_text("filename,wnid\nILSVRC2012_val_00000003.JPEG,n15075141\n"
                                                     "ILSVRC2012_val_00000004.JPEG,n01440764\n")
    assert build_dataset("imagenet", root=tmp_path, split="test").targets == [999, 0]
    (tmp_path / "val" / "val_labels.txt").write_text("ILSVRC2012_val_00000003 n15075141\n")
    with pytest.raises(ValueError, match="1 images .* no entry"):
        build_dataset("imagenet", root=tmp_path, split="test")
    (tmp_path / "val" / "val_labels.txt").unlink()
    with pytest.raises(FileNotFoundError, match="LOC_val_solution.csv"):
        build_dataset("imagenet", root=tmp_path, split="test")


def _meta_mat(path: Path, order: list[str]) -> None:
    """A devkit-style meta.mat: a struct array ``synsets`` with ILSVRC2012_ID, WNID, num_children,
    the 1,000 leaves in ``order`` (IDs 1..1000) followed by an inner synset (ID 1001)."""
    from scipy.io import savemat

    dtype = [("ILSVRC2012_ID", "O"), ("WNID", "O"), ("words", "O"), ("num_children", "O")]
    synsets = np.zeros((len(order) + 1, 1), dtype=dtype)
    for i, w in enumerate(order + ["n00001740"]):
        synsets[i, 0] = (np.array([[i + 1]]), np.array([w]), np.array(["x"]), np.array([[0 if i < 1000 else 3]]))
    path.parent.mkdir(parents=True, exist_ok=True)
    savemat(path, {"synsets": synsets})


def test_flat_val_with_devkit_ground_truth(tmp_path):
    """The devkit's IDs index meta.mat's order, not the sorted one: a shuffled order maps back to the right wnid."""
    pytest.importorskip("scipy")
    order = list(imagenet.wnids())
    np.random.default_rng(0).shuffle(order)
    _meta_mat(tmp_path / imagenet.DEVKIT_FOLDER / "data" / "meta.mat", order)
    ids = [order.index(FIRST) + 1, 17, order.index(LAST) + 1]
    (tmp_path / imagenet.DEVKIT_FOLDER / "data" / imagenet.DEVKIT_TRUTH).write_text("".join(f"{i}\n" for i in ids))
    _flat_val(tmp_path, {1: "", 3: ""})
    val = build_dataset("imagenet", root=tmp_path, split="test")
    assert val.targets == [0, 999]
    import tarfile  # the devkit archive as downloaded, in the data root, is read the same way

    archive = tmp_path / "elsewhere" / imagenet.DEVKIT_ARCHIVE
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / imagenet.DEVKIT_FOLDER, arcname=imagenet.DEVKIT_FOLDER)
    (tmp_path / "elsewhere" / "val").symlink_to(tmp_path / "val")
    assert build_dataset("imagenet", root=tmp_path / "elsewhere", split="test").targets == [0, 999]
    (tmp_path / imagenet.DEVKIT_FOLDER / "data" / "meta.mat").unlink()
    with pytest.raises(FileNotFoundError, match="meta.mat"):
        build_dataset("imagenet", root=tmp_path, split="test")


def _kaggle_tree(top: Path) -> dict[str, int]:
    """Kaggle's ImageNet Object Localization download in miniature: ``LOC_val_solution.csv``
    and ``LOC_synset_mapping.txt`` at ``top``, ``ILSVRC/Data/CLS-LOC/train/<wnid>/`` and the
    flat ``ILSVRC/Data/CLS-LOC/val/`` (plus the unlabelled ``test/`` Kaggle also ships).
    Returns val file stem -> label."""
    data = top / "ILSVRC" / "Data" / "CLS-LOC"
    val = {1: LAST, 2: FIRST, 3: "n02099601"}
    for k, wnid in val.items():
        _image(data / "val" / f"ILSVRC2012_val_{k:08d}.JPEG", 10 * k)
    for wnid in (FIRST, "n02099601"):
        _image(data / "train" / wnid / f"{wnid}_1.JPEG", 70)
    _image(data / "test" / "ILSVRC2012_test_00000001.JPEG", 90)
    (top / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "".join(
        f"ILSVRC2012_val_{k:08d},{w} 1 2 30 40 {w} 5 6 70 80\n" for k, w in val.items()))
    (top / "LOC_synset_mapping.txt").write_text("".join(f"{w} name of {w}\n" for w in imagenet.wnids()))
    (top / "LOC_sample_submission.csv").write_text("ImageId,PredictionString\n")
    return {f"ILSVRC2012_val_{k:08d}": imagenet.wnid_index()[w] for k, w in val.items()}


@pytest.mark.parametrize("where", ["top", "parent"])
def test_kaggle_layout_is_found_from_the_root_a_user_gives(tmp_path, where):
    """--root is Kaggle's top folder (where LOC_val_solution.csv is), or a data root holding it as imagenet/."""
    top = tmp_path / "imagenet-object-localization-challenge" if where == "top" else tmp_path / "imagenet"
    labels = _kaggle_tree(top)
    root = top if where == "top" else tmp_path
    val = build_dataset("imagenet", root=root, split="test")
    assert val.source == str(top / "ILSVRC" / "Data" / "CLS-LOC" / "val")
    assert val.ground_truth == str(top / "LOC_val_solution.csv")
    assert val.targets == [labels[f"ILSVRC2012_val_{k:08d}"] for k in (1, 2, 3)] == [999, 0, 207]
    train = build_dataset("imagenet", root=root, split="train")
    assert sorted(train.targets) == [0, 207] and train.variant == "imagenet"
    rc, out = _eval(tmp_path, "imagenet", root)
    assert rc == 0
    assert json.loads((out / "run.json").read_text())["data_source"] == val.source


def test_imagenet_cli_on_both_layouts(tmp_path):
    folders = tmp_path / "folders"
    for wnid in (FIRST, LAST):
        _image(folders / "val" / wnid / "a.JPEG", 50)
    flat = tmp_path / "flat"
    _flat_val(flat, {1: "", 2: ""})
    (flat / "LOC_val_solution.csv").write_text(f"ImageId,PredictionString\nILSVRC2012_val_00000001,{LAST} 1 1 9 9\n"
                                               f"ILSVRC2012_val_00000002,{FIRST} 1 1 9 9\n")
    for root in (folders, flat):
        rc, out = _eval(tmp_path / root.name, "imagenet", root)
        assert rc == 0
        run = json.loads((out / "run.json").read_text())
        assert run["data_variant"] == "imagenet-val-original" and run["data_source"] == str(root / "val")


# --- image folder ---------------------------------------------------------------------------

def test_imagefolder_classes_info_and_splits(tmp_path):
    for split, names in (("train", ("ant", "bee", "cow")), ("test", ("ant", "cow"))):
        for value, name in enumerate(names):
            _image(tmp_path / split / name / "x.png", 60 * value + 10, size=(240, 300))
    info = dataset_info("imagefolder", root=tmp_path)
    assert info.num_classes == 3 and info.image_size == 224 and info.mean == dataset_info("imagenet").mean
    test = build_dataset("imagefolder", root=tmp_path, split="test")
    assert test.classes == ["ant", "bee", "cow"] and test.targets == [0, 2]  # "bee" absent from test: no shift
    assert test[1][0].shape == (3, 224, 224) and test.num_classes == 3
    assert build_dataset("imagefolder", root=tmp_path, split="train").targets == [0, 1, 2]
    with pytest.raises(ValueError, match="--root"):
        dataset_info("imagefolder")


@pytest.mark.parametrize("protocol, option", [("shuffle", ["--grids", "1,2"]), ("occlusion", ["--areas", "25"])])
def test_the_shift_protocols_read_an_image_folder_from_root(tmp_path, protocol, option):
    for value, name in enumerate(("ant", "bee")):
        _image(tmp_path / "data" / name / "x.png", 60 * value + 10)
    out = tmp_path / "run"
    assert main(["eval", protocol, "--model", "resnet26", "--model-args", "width=0.25", "--dataset", "imagefolder",
                 "--root", str(tmp_path / "data"), "--batch-size", "2", "--no-progress", *option,
                 "--out", str(out)]) == 0
    assert json.loads((out / "run.json").read_text())["data_source"] == str(tmp_path / "data")


def test_imagefolder_takes_a_model_transform_and_tensor_sets_refuse_one(tmp_path):
    from robust_attn.sources.base import Preprocessing

    _image(tmp_path / "a" / "x.png", 100, size=(300, 200))
    _image(tmp_path / "b" / "y.png", 30, size=(300, 200))
    transform = Preprocessing(mean=(0.5,) * 3, std=(0.5,) * 3, input_size=96, resize_size=110,
                              crop_size=96).eval_transform()
    data = build_dataset("imagefolder", root=tmp_path, split="test", transform=transform)
    image, label = data[0]
    assert image.shape == (3, 96, 96) and label == 0 and abs(image[0].mean().item() * 255 - 100) < 2
    assert takes_transform("imagenet") and takes_transform("imagefolder") and not takes_transform("synthetic")
    with pytest.raises(ValueError, match="takes no model transform"):
        build_dataset("synthetic", split="test", transform=transform)
    with pytest.raises(ValueError, match="augment"):
        build_dataset("imagefolder", root=tmp_path, split="test", augment=True, transform=transform)


def test_imagefolder_cli(tmp_path, capsys):
    for value, name in enumerate(("cat", "dog")):
        for j in range(2):
            _image(tmp_path / "imgs" / name / f"{j}.jpg", 100 * value)
    rc, out = _eval(tmp_path, "imagefolder", tmp_path / "imgs")  # random weights: the model gets 2 classes
    assert rc == 0
    from robust_attn.runs.store import load_records

    records = load_records(out)
    clean = records[records["condition"] == "none"]
    assert len(clean) == 2 and set(clean["label"]) <= {0, 1} and set(records["pred"]) <= {0, 1}
    (tmp_path / "net.py").write_text("import torch.nn as nn\n\ndef imagenet_head():\n"
                                     "    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 1000))\n")
    rc, _ = _eval(tmp_path / "again", "imagefolder", tmp_path / "imgs",
                  model=(f"{tmp_path / 'net.py'}:imagenet_head",))
    assert rc == 2 and "outputs 1000 classes but the dataset has 2" in capsys.readouterr().err


def test_damaged_wnid_list_is_refused(monkeypatch):
    real = imagenet.resources.files("robust_attn.data").joinpath("imagenet_wnids.txt").read_bytes()
    lines = real.decode().split()
    lines[0], lines[1] = lines[1], lines[0]      # two classes swapped: indices 0 and 1 exchanged
    damaged = ("\n".join(lines) + "\n").encode()

    class _File:
        def joinpath(self, name):
            return self

        def read_bytes(self):
            return damaged

    class _Resources:
        @staticmethod
        def files(package):
            return _File()

    imagenet.wnids.cache_clear()
    monkeypatch.setattr(imagenet, "resources", _Resources)
    try:
        with pytest.raises(RuntimeError, match="does not match its sha256"):
            imagenet.wnids()
    finally:
        imagenet.wnids.cache_clear()


def test_imagenet_eval_transform_resizes_the_short_side_to_256_then_crops_224(tmp_path):
    from PIL import Image
    import torchvision.transforms.functional as TF

    wnid = "n01440764"
    folder = tmp_path / "imagenet" / "val" / wnid
    folder.mkdir(parents=True)
    pixels = np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8)   # H 300, W 400
    Image.fromarray(pixels).save(folder / "a.png")
    image, label = build_dataset("imagenet", root=tmp_path, split="test")[0]
    ref = TF.to_tensor(TF.center_crop(TF.resize(Image.fromarray(pixels), 256), 224))   # 256 x 341, then 224 x 224
    assert image.shape == (3, 224, 224) and label == 0
    torch.testing.assert_close(image, ref)
