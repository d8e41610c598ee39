"""Dataset readers: real bytes where they are available, hand-made files otherwise."""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED

from robust_attn.data import build_dataset, dataset_info, locate_dataset, SeededAugment
from robust_attn.data import cifar100, fashion_mnist
from robust_attn.data.splits import holdout_split, subset_indices
from robust_attn.data.transforms import RandomCropFlip

CIFAR_BUNDLE = SHARED / "data" / "cifar100"
FASHION_DEBIAN = Path("/usr/share/datasets/fashion-mnist")


# --- info and API ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,classes,size,res", [("cifar100", 100, 32, "cifar"), ("imagenet", 1000, 224, "imagenet"),
                                                   ("fashion_mnist", 10, 32, "cifar"), ("synthetic", 10, 32, "cifar")])
def test_dataset_info(name, classes, size, res):
    info = dataset_info(name)
    assert (info.name, info.num_classes, info.image_size, info.resolution) == (name, classes, size, res)
    assert len(info.mean) == len(info.std) == 3 and all(0 < s < 1 for s in info.std)
    with pytest.raises(AttributeError):
        info.num_classes = 3  # frozen


def test_unknown_dataset_and_split():
    with pytest.raises(ValueError, match="Did you mean 'imagenet'"):
        dataset_info("imagenett")
    with pytest.raises(ValueError, match="unknown split"):
        build_dataset("synthetic", split="validation")


@pytest.mark.parametrize("name", ["cifar100", "imagenet"])
def test_missing_dataset_names_root_and_fix(name, tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        build_dataset(name, root=tmp_path / "nowhere", split="test")
    assert str(tmp_path / "nowhere") in str(err.value)
    assert "ROBUST_ATTN_DATA" in str(err.value)


# --- synthetic, splits, limit ---------------------------------------------------------------

def test_synthetic_is_deterministic_and_balanced():
    a, b = build_dataset("synthetic", split="train"), build_dataset("synthetic", split="train")
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    x, y = a[0]
    assert x.dtype == torch.float32 and x.shape == (3, 32, 32) and 0 <= x.min() and x.max() <= 1
    assert isinstance(y, int)
    assert torch.bincount(a.labels).tolist() == [60] * 10
    test = build_dataset("synthetic", split="test")
    assert not torch.equal(test.images[:10], a.images[:10])


def test_holdout_split_properties():
    labels = [i % 7 for i in range(7 * 30)]
    train, val = holdout_split(labels, per_class=5)
    assert sorted(train + val) == list(range(len(labels)))
    assert np.bincount([labels[i] for i in val]).tolist() == [5] * 7
    assert holdout_split(labels, per_class=5) == (train, val)
    assert holdout_split(labels, per_class=5, seed=1)[1] != val
    with pytest.raises(ValueError, match="cannot hold out"):
        holdout_split(labels, per_class=30)


def test_val_split_is_held_out_of_train():
    info = dataset_info("synthetic")
    full = build_dataset("synthetic", split="train")
    train = build_dataset("synthetic", split="train", holdout=True)
    val = build_dataset("synthetic", split="val")
    assert len(val) == info.val_per_class * info.num_classes and len(train) + len(val) == len(full)
    assert torch.bincount(val.labels).tolist() == [info.val_per_class] * info.num_classes
    # every val image is a training image, and none of them is in the held-out train split
    flat = lambda d: {bytes(img.flatten().numpy()) for img in d.images}  # noqa: E731
    assert flat(val) <= flat(full) and not flat(val) & flat(train)


def test_limit_is_a_fixed_subset():
    a = build_dataset("synthetic", split="test", limit=50)
    b = build_dataset("synthetic", split="test", limit=50)
    assert len(a) == 50 and torch.equal(a.images, b.images)
    assert len(set(a.labels.tolist())) == 10  # a random subset, not the first 50
    assert subset_indices(10, None) is None and subset_indices(10, 20) is None
    with pytest.raises(ValueError):
        subset_indices(10, 0)


# --- augmentation ---------------------------------------------------------------------------

def test_random_crop_flip_is_a_shifted_window_of_the_padded_image():
    torch.manual_seed(0)
    image = torch.rand(3, 8, 8)
    padded = torch.nn.functional.pad(image, (4, 4, 4, 4))
    for _ in range(20):
        out = RandomCropFlip(4)(image)
        assert out.shape == image.shape
        windows = [padded[:, t:t + 8, s:s + 8] for t in range(9) for s in range(9)]
        assert any(torch.equal(out, w) or torch.equal(out, w.flip(-1)) for w in windows)


def test_seeded_augment_depends_only_on_seed_epoch_index():
    data = SeededAugment(build_dataset("synthetic", split="train", augment=True, limit=20), seed=3)
    torch.manual_seed(123)
    first = data[5][0]
    torch.manual_seed(999)  # global state does not matter ...
    assert torch.equal(data[5][0], first)
    state = torch.get_rng_state()
    data[6]
    assert torch.equal(torch.get_rng_state(), state)  # ... and is not consumed
    changed = []
    for epoch in range(1, 6):
        data.set_epoch(epoch)
        changed.append(not torch.equal(data[5][0], first))
    assert any(changed)


# --- CIFAR-100 on the canonical bytes ---------------------------------------------------------

needs_bundle = pytest.mark.skipif(not (CIFAR_BUNDLE / "test.prefix").is_file(),
                                  reason=f"CIFAR-100 sample bundle not at {CIFAR_BUNDLE}")


def _extract_sample():
    spec = importlib.util.spec_from_file_location("extract_sample", CIFAR_BUNDLE / "extract_sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_bundle
def test_cifar_meta_real_file():
    meta = cifar100.read_meta(CIFAR_BUNDLE / "meta", verify=True)
    assert len(meta["fine_label_names"]) == 100 and len(meta["coarse_label_names"]) == 20
    assert meta["fine_label_names"][:3] == ["apple", "aquarium_fish", "baby"]
    assert hashlib.md5((CIFAR_BUNDLE / "meta").read_bytes()).hexdigest() == cifar100.MD5["meta"]


@needs_bundle
def test_cifar_test_pickle_rebuilt_from_canonical_prefix(tmp_path):
    """header of the real file + its available pixel rows + zero rows for the missing ones +
    the closing bytes gives a byte-valid pickle of the canonical size (README.md's arithmetic)."""
    raw = (CIFAR_BUNDLE / "test.prefix").read_bytes()
    n, row = 10000, 3072
    start = raw.find(b"T" + (n * row).to_bytes(4, "little"))
    body = raw[start + 5:]
    n_rows = len(body) // row
    rebuilt = raw[:start + 5] + body[:n_rows * row] + bytes((n - n_rows) * row) + b"tbu."
    assert len(rebuilt) == 31_049_707  # the canonical file size
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    (folder / "test").write_bytes(rebuilt)

    reference, ref_data = _extract_sample().decode(str(CIFAR_BUNDLE / "test.prefix"), n)
    batch = cifar100.read_batch(folder / "test")
    assert batch["images"].shape == (n, 3, 32, 32)
    assert batch["fine_labels"].tolist() == reference["fine_labels"]
    assert batch["coarse_labels"].tolist() == reference["coarse_labels"]
    assert batch["filenames"] == reference["filenames"]
    assert n_rows == len(ref_data) == 916
    assert torch.equal(batch["images"][:n_rows].reshape(n_rows, -1), torch.from_numpy(ref_data.copy()))
    assert torch.bincount(batch["fine_labels"]).tolist() == [100] * 100

    dataset = build_dataset("cifar100", root=tmp_path, split="test", limit=None)
    image, label = dataset[3]
    assert label == reference["fine_labels"][3]
    # the official layout: 1024 red, then green, then blue values, each row-major
    assert torch.allclose(image[1, 2, 5] * 255, torch.tensor(float(ref_data[3][1024 + 2 * 32 + 5])))
    with pytest.raises(ValueError, match="md5"):  # zero rows are not the canonical bytes
        build_dataset("cifar100", root=tmp_path, split="test", verify=True)


def test_cifar_reader_refuses_foreign_globals(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    (folder / "test").write_bytes(pickle.dumps({b"data": os.getcwd}, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        cifar100.read_batch(folder / "test")


def test_cifar_reader_on_a_small_pickle_in_the_canonical_format(tmp_path):
    """numpy array + byte-string keys, protocol 2, as the official files."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (4, 3072), dtype=np.uint8)
    obj = {b"filenames": [b"a.png", b"b.png", b"c.png", b"d.png"], b"batch_label": b"testing batch 1 of 1",
           b"fine_labels": [3, 1, 99, 0], b"coarse_labels": [1, 2, 3, 4], b"data": data}
    (tmp_path / "test").write_bytes(pickle.dumps(obj, protocol=2))
    batch = cifar100.read_batch(tmp_path / "test")
    assert batch["filenames"][2] == "c.png" and batch["fine_labels"].tolist() == [3, 1, 99, 0]
    assert torch.equal(batch["images"][1, 2].flatten(), torch.from_numpy(data[1, 2048:]))
    assert locate_dataset("cifar100", tmp_path, split="test") == tmp_path


# --- Fashion-MNIST ----------------------------------------------------------------------------

def _idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


@pytest.mark.parametrize("compress", [False, True])
def test_idx_reader_plain_and_gzip(tmp_path, compress):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    data = _idx_bytes(array)
    path = tmp_path / "x-idx3-ubyte"
    path.write_bytes(gzip.compress(data) if compress else data)
    assert np.array_equal(fashion_mnist.read_idx(path), array)
    path.write_bytes(data[:-1])
    with pytest.raises(ValueError, match="truncated"):
        fashion_mnist.read_idx(path)


def test_fashion_mnist_torchvision_layout(tmp_path, monkeypatch):
    monkeypatch.setattr(fashion_mnist, "KNOWN_LOCATIONS", [])
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    images = np.random.default_rng(1).integers(1, 256, (5, 28, 28), dtype=np.uint8)
    labels = np.array([0, 9, 3, 3, 1], dtype=np.uint8)
    for split in ("train", "t10k"):
        (raw / f"{split}-images-idx3-ubyte").write_bytes(_idx_bytes(images))
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(_idx_bytes(labels))
    dataset = build_dataset("fashion_mnist", root=tmp_path, split="test")
    image, label = dataset[1]
    assert image.shape == (3, 32, 32) and label == 9
    assert torch.equal(image[0], image[2])
    assert image[:, :2].abs().sum() == 0 and image[:, :, -2:].abs().sum() == 0  # zero padding
    assert torch.allclose(image[0, 2:30, 2:30] * 255, torch.from_numpy(images[1]).float())
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        build_dataset("fashion_mnist", root=tmp_path / "empty", split="test")


def test_fashion_mnist_explicit_root_never_falls_back(tmp_path):
    """An explicit root without the files is an error even where the Debian package or the embedded
    copy exists; the message names the folders searched."""
    with pytest.raises(FileNotFoundError) as err:
        build_dataset("fashion_mnist", root=tmp_path, split="test")
    assert str(tmp_path) in str(err.value) and "/usr/share" not in str(err.value)


def test_fashion_mnist_embedded_test_set(tmp_path, monkeypatch, capsys):
    """Without root, default root or Debian package the test split comes from the package's embedded copy,
    which is the real test set: 1,000 per class, first image an ankle boot; a line names where it came from."""
    monkeypatch.setattr(fashion_mnist, "KNOWN_LOCATIONS", [])
    monkeypatch.setenv("ROBUST_ATTN_DATA", str(tmp_path))
    test = build_dataset("fashion_mnist", split="test")
    assert "embedded" in test.source and "embedded" in capsys.readouterr().err
    assert len(test) == 10000 and torch.bincount(test.labels).tolist() == [1000] * 10 and test.labels[0] == 9
    if FASHION_DEBIAN.is_dir():
        debian = build_dataset("fashion_mnist", root=FASHION_DEBIAN, split="test")
        assert torch.equal(debian.images, test.images) and torch.equal(debian.labels, test.labels)
    with pytest.raises(FileNotFoundError, match="searched"):
        build_dataset("fashion_mnist", split="train")  # training data is never embedded


@pytest.mark.skipif(not FASHION_DEBIAN.is_dir(), reason="Debian package dataset-fashion-mnist not installed")
def test_fashion_mnist_debian_package(tmp_path, monkeypatch):
    monkeypatch.setenv("ROBUST_ATTN_DATA", str(tmp_path))  # nothing in the default root: the package's copy
    test = build_dataset("fashion_mnist", split="test")
    assert test.source == str(FASHION_DEBIAN)
    assert len(test) == 10000 and torch.bincount(test.labels).tolist() == [1000] * 10
    raw = gzip.decompress((FASHION_DEBIAN / "t10k-images-idx3-ubyte.gz").read_bytes())
    first = np.frombuffer(raw, dtype=np.uint8, offset=16, count=784).reshape(28, 28)
    assert torch.equal(test.images[0, 1, 2:30, 2:30], torch.from_numpy(first.copy()))
    assert test.labels[0] == 9  # the first test image is an ankle boot
    info = dataset_info("fashion_mnist")
    sample = test.images[:2000].float() / 255  # the test set's statistics are close to the train set's
    assert abs(sample.mean().item() - info.mean[0]) < 0.02 and abs(sample.std().item() - info.std[0]) < 0.02


# --- ImageNet ImageFolder ---------------------------------------------------------------------

def test_imagenet_folder_layout_and_transforms(tmp_path):
    from PIL import Image

    wnids = ["n01440764", "n01443537", "n01484850"]
    for split in ("train", "val"):
        for k, wnid in enumerate(wnids):
            folder = tmp_path / "imagenet" / split / wnid
            folder.mkdir(parents=True)
            for j, size in enumerate([(300, 260), (180, 400)]):
                Image.new("RGB", size, color=(80 * k, 10, 200)).save(folder / f"img{j}.JPEG")
    val = build_dataset("imagenet", root=tmp_path, split="test")
    assert len(val) == 6 and val.classes == wnids
    for i in range(len(val)):
        image, label = val[i]
        assert image.shape == (3, 224, 224) and image.dtype == torch.float32
        assert label == i // 2  # sorted wnid order is the class index
        assert abs(image[0].mean().item() * 255 - 80 * label) < 3
    train = build_dataset("imagenet", root=tmp_path / "imagenet", split="train", augment=True)
    assert train[0][0].shape == (3, 224, 224)
    small = build_dataset("imagenet", root=tmp_path, split="test", limit=3)
    assert len(small) == 3 and small.targets == [small[i][1] for i in range(3)]


def test_val_split_is_never_augmented_even_when_asked():
    plain = build_dataset("synthetic", split="val")
    asked = build_dataset("synthetic", split="val", augment=True)
    assert len(asked) == len(plain)
    torch.manual_seed(0)
    for i in range(0, len(plain), 7):
        assert torch.equal(asked[i][0], plain[i][0]), i


@pytest.mark.parametrize("compress", [False, True])
def test_idx_file_with_trailing_bytes_is_refused(tmp_path, compress):
    from robust_attn.data.fashion_mnist import read_idx

    body = struct.pack(">BBBB", 0, 0, 0x08, 3) + struct.pack(">III", 2, 2, 2) + bytes(range(8))
    good, bad = tmp_path / "good-idx3-ubyte", tmp_path / "bad-idx3-ubyte"
    for path, raw in ((good, body), (bad, body + b"\x00")):
        path.write_bytes(gzip.compress(raw) if compress else raw)
    assert read_idx(good).shape == (2, 2, 2)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_idx(bad)


def test_random_crop_reaches_every_offset_of_the_padded_image():
    torch.manual_seed(0)
    image = torch.arange(1, 17, dtype=torch.float32).view(1, 4, 4)
    p = 2
    padded = torch.nn.functional.pad(image, (p, p, p, p))
    crop = RandomCropFlip(p, flip=False)
    seen = set()
    for _ in range(400):
        out = crop(image)
        hits = [(t, s) for t in range(2 * p + 1) for s in range(2 * p + 1)
                if torch.equal(out, padded[:, t:t + 4, s:s + 4])]
        assert len(hits) == 1
        seen.add(hits[0])
    assert seen == {(t, s) for t in range(2 * p + 1) for s in range(2 * p + 1)}


def test_subset_indices_are_sorted_and_distinct():
    keep = subset_indices(1000, 50, seed=0)
    assert keep == sorted(keep) and len(set(keep)) == 50 and keep[-1] - keep[0] > 500
    test = build_dataset("synthetic", split="test")
    limited = build_dataset("synthetic", split="test", limit=20)
    assert torch.equal(limited.images, test.images[subset_indices(len(test), 20)])


@pytest.mark.parametrize("run,limit", [("rotation-resnet26", 2000), ("apgd-resnet26", 1000)])
def test_the_seeded_subsets_are_the_images_the_committed_cifar10_study_ran_on(run, limit):
    """``subset_indices`` decides which test images a limited study sees; the committed CIFAR-10
    study's records (2,000 seeded images for rotation, a seeded 1,000 for the attacks) hold the
    labels of the images it ran on, in index order, and they are the embedded test set's labels at
    ``subset_indices(10000, limit)``: a change of the draw would compare new runs with other images."""
    import pandas as pd

    records = pd.read_csv(Path(__file__).parents[1] / "reports" / "study-cifar10" / "runs" / run / "records.csv.gz")
    first = records[records["condition"] == records["condition"].iloc[0]].sort_values("index")
    assert list(first["index"]) == list(range(limit))
    test = build_dataset("cifar10", split="test")
    assert first["label"].tolist() == test.labels[subset_indices(len(test), limit)].tolist()


def test_seeded_augment_differs_between_seeds():

    base = build_dataset("synthetic", split="train", augment=True, limit=20)
    a, b = SeededAugment(base, seed=3), SeededAugment(base, seed=4)
    assert any(not torch.equal(a[i][0], b[i][0]) for i in range(20))
    assert all(torch.equal(a[i][0], SeededAugment(base, seed=3)[i][0]) for i in range(20))
