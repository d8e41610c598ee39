"""CIFAR-10 readers on real bytes, the embedded test sets, and where data is looked for.

Real bytes: the project's shared CIFAR-10-JPEG copy (``../shared/data/cifar10/cifar10-jpeg.tar.gz`` or
its extraction ``../data/cifar10-jpeg``, both beside the checkout); on a clone without them the
readers' tests take their real files from the embedded test set instead (its JPEG bytes, written
back into class folders; a few of its images stand in for training images), and only the test that
compares the embedded set with the shared copy skips. Canonical pickles are rebuilt here, in the
official format, from a few of those images. The reference decode is Pillow called directly on the
files, not the package's reader.
"""
from __future__ import annotations

import hashlib
import pickle
import shutil
import tarfile
from functools import lru_cache
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED

from robust_attn.data import build_dataset, cifar10, embedded, locate_dataset

TARBALL = SHARED / "data" / "cifar10" / "cifar10-jpeg.tar.gz"
EXTRACTED = SHARED.parent / "data" / "cifar10-jpeg"  # ../data beside the checkout, as extracted here
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
PER_CLASS = 2  # real JPEGs per class and split copied into the hand-made roots


def _wanted(name: str) -> bool:
    """Every test image, and the first PER_CLASS training images of each class."""
    parts = name.split("/")
    return len(parts) == 3 and (parts[0] == "test" or (parts[0] == "train" and int(parts[2][:4]) < PER_CLASS))


@lru_cache(maxsize=1)
def _shared_jpegs() -> dict[str, bytes] | None:
    """``{"test/cat/0007.jpg": bytes}`` from the extracted copy, else from the tarball; None if neither."""
    if (EXTRACTED / "test").is_dir() and sorted(p.name for p in (EXTRACTED / "test").iterdir()) == CLASSES:
        return {str(p.relative_to(EXTRACTED)): p.read_bytes()
                for split in ("train", "test") for p in sorted((EXTRACTED / split).glob("*/*.jpg"))
                if _wanted(str(p.relative_to(EXTRACTED)))}
    if TARBALL.is_file():
        out = {}
        with tarfile.open(TARBALL, "r|gz") as archive:
            for member in archive:
                name = member.name.removeprefix("./")
                if member.isfile() and _wanted(name):
                    out[name] = archive.extractfile(member).read()
        return out
    return None


@lru_cache(maxsize=1)
def _embedded_jpegs() -> dict[str, bytes]:
    """The same layout from the embedded test set's blobs: every test image under its class, and
    per class the last PER_CLASS test images again as ``train/<class>/0000.jpg, ...``."""
    blobs, labels = embedded.read_jpeg_set("cifar10_jpeg_test")
    out = {}
    for label, name in enumerate(CLASSES):
        members = [blobs[i] for i in np.flatnonzero(labels.numpy() == label)]
        out.update({f"test/{name}/{k:04d}.jpg": blob for k, blob in enumerate(members)})
        out.update({f"train/{name}/{k:04d}.jpg": blob for k, blob in enumerate(members[-PER_CLASS:])})
    return out


@pytest.fixture
def shared_jpegs() -> dict[str, bytes]:
    found = _shared_jpegs()
    if not found:
        pytest.skip(f"CIFAR-10-JPEG copy not at {EXTRACTED} or {TARBALL} (a user's clone has no ../shared)")
    return found


@pytest.fixture
def jpegs() -> dict[str, bytes]:
    """Real CIFAR-10-JPEG files: the shared copy's, else the embedded test set's (module docstring)."""
    return _shared_jpegs() or _embedded_jpegs()


def _decode(blob: bytes) -> np.ndarray:
    """Independent reference: Pillow's RGB decode, (32, 32, 3) uint8."""
    from PIL import Image

    with Image.open(BytesIO(blob)) as image:
        return np.asarray(image.convert("RGB"))


def _names(jpegs: dict[str, bytes], split: str, per_class: int = PER_CLASS) -> list[str]:
    """The first ``per_class`` files of every class, in label then file order."""
    return [n for c in CLASSES for n in sorted(k for k in jpegs if k.startswith(f"{split}/{c}/"))[:per_class]]


def _jpeg_root(base: Path, jpegs: dict[str, bytes], splits=("train", "test")) -> Path:
    """``base/cifar10-jpeg/{split}/<class>/*.jpg`` holding a few real files; returns ``base``."""
    for split in splits:
        for name in _names(jpegs, split):
            target = base / "cifar10-jpeg" / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(jpegs[name])
    return base


def _pickle_row(image_hwc: np.ndarray) -> np.ndarray:
    """The official row layout: 1024 red values (row-major), then 1024 green, then 1024 blue."""
    return np.concatenate([image_hwc[:, :, c].reshape(-1) for c in range(3)])


def _pickle_root(base: Path, jpegs: dict[str, bytes]) -> tuple[Path, dict[str, tuple[np.ndarray, list[int]]]]:
    """``base/cifar-10-batches-py`` in the canonical python-version format (dicts with byte-string keys,
    numpy data, protocol 2) holding the decoded shared JPEGs: the train images spread over
    data_batch_1..5, the test images in test_batch. Returns the folder and the HWC images/labels per split."""
    folder = base / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    truth = {}
    for split in ("train", "test"):
        names = _names(jpegs, split)
        truth[split] = (np.stack([_decode(jpegs[n]) for n in names]), [CLASSES.index(n.split("/")[1]) for n in names])
    images, labels = truth["train"]
    parts = np.array_split(np.arange(len(labels)), 5)
    batches = [(f"data_batch_{i + 1}", f"training batch {i + 1} of 5", idx) for i, idx in enumerate(parts)]
    batches.append(("test_batch", "testing batch 1 of 1", None))
    for file, label, idx in batches:
        imgs, labs = truth["test"] if idx is None else (images[idx], [labels[i] for i in idx])
        obj = {b"batch_label": label.encode(), b"labels": list(labs),
               b"data": np.stack([_pickle_row(im) for im in imgs]).astype(np.uint8),
               b"filenames": [f"img_{k}.png".encode() for k in range(len(labs))]}
        (folder / file).write_bytes(pickle.dumps(obj, protocol=2))
    meta = {b"num_cases_per_batch": 10000, b"label_names": [c.encode() for c in CLASSES], b"num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return folder, truth


def _chw(images_hwc: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(images_hwc.transpose(0, 3, 1, 2)))


@pytest.fixture
def empty_default_root(tmp_path, monkeypatch) -> Path:
    """$ROBUST_ATTN_DATA pointing at an empty folder: nothing but the embedded sets can be found."""
    root = tmp_path / "default-root"
    root.mkdir()
    monkeypatch.setenv("ROBUST_ATTN_DATA", str(root))
    return root


# --- the embedded test set -------------------------------------------------------------------

def test_embedded_cifar10_test_set(empty_default_root, capsys):
    """With nothing in the default root the test split is the embedded copy, announced on stderr:
    10,000 images, 1,000 per class in label order."""
    blobs, labels = embedded.read_jpeg_set("cifar10_jpeg_test")
    assert len(blobs) == 10000 and labels.tolist() == [i // 1000 for i in range(10000)]
    test = build_dataset("cifar10", split="test", limit=500)
    assert (test.variant, test.source) == ("cifar10-jpeg", str(embedded.path("cifar10_jpeg_test")))
    assert "embedded" in test.source and test.source in capsys.readouterr().err  # the command says which
    assert test.images.shape == (500, 3, 32, 32) and len(set(test.labels.tolist())) == 10


def test_embedded_cifar10_test_set_is_the_shared_jpegs(shared_jpegs):
    """Every embedded blob is byte for byte the shared file at the same sorted position, and the
    package's decode of a sample equals Pillow's decode of those files."""
    jpegs = shared_jpegs
    blobs, labels = embedded.read_jpeg_set("cifar10_jpeg_test")
    shared = _names(jpegs, "test", per_class=10**6)
    assert len(shared) == len(blobs) == 10000
    assert all(blob == jpegs[name] for blob, name in zip(blobs, shared))
    assert labels.tolist() == [CLASSES.index(name.split("/")[1]) for name in shared]
    sample = np.random.default_rng(0).choice(10000, 64, replace=False)
    decoded = cifar10.decode_jpegs([blobs[i] for i in sample])
    assert torch.equal(decoded, _chw(np.stack([_decode(jpegs[shared[i]]) for i in sample])))


@pytest.fixture
def embedded_copy(tmp_path, monkeypatch):
    """A writable copy of the embedded folder in place of the package's (checksum cache cleared on
    both sides, so neither this copy nor a damaged verdict outlives the test)."""
    copy = tmp_path / "embedded"
    copy.mkdir()
    shutil.copy(embedded.HERE / "SHA256SUMS", copy)
    for name in embedded.checksums():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(embedded.HERE / name, copy / name)
    embedded._verified.cache_clear()
    monkeypatch.setattr(embedded, "HERE", copy)
    yield copy
    embedded._verified.cache_clear()


def test_embedded_copy_verifies_unchanged(embedded_copy):
    """The fixture's copy itself passes (so the failures below come from the damage)."""
    assert embedded.path("cifar10_jpeg_test") == embedded_copy / "cifar10_jpeg_test.npz"
    assert embedded.path("fashion_mnist_test") == embedded_copy / "fashion_mnist_test"


@pytest.mark.parametrize("dataset,file", [("cifar10", "cifar10_jpeg_test.npz"),
                                          ("fashion_mnist", "fashion_mnist_test/t10k-labels-idx1-ubyte.gz")])
def test_damaged_embedded_file_is_an_error(dataset, file, embedded_copy, empty_default_root, monkeypatch):
    from robust_attn.data import fashion_mnist

    monkeypatch.setattr(fashion_mnist, "KNOWN_LOCATIONS", [])  # no Debian copy: the embedded one is used
    raw = bytearray((embedded_copy / file).read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit
    (embedded_copy / file).write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"sha256.*damaged.*reinstall") as err:
        build_dataset(dataset, split="test")
    assert str(embedded_copy / file) in str(err.value)
    (embedded_copy / file).unlink()
    embedded._verified.cache_clear()
    with pytest.raises(FileNotFoundError, match="missing: reinstall"):
        build_dataset(dataset, split="test")


def test_embedded_fashion_mnist_matches_its_checksums():
    """The shipped Fashion-MNIST files are the gzipped IDX test set: 10,000 28x28 images, 10,000 labels
    in 0..9 (magic numbers and sizes read here directly), and their digests are those in SHA256SUMS."""
    import gzip

    folder = embedded.path("fashion_mnist_test")
    sums = embedded.checksums()
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        raw = (folder / name).read_bytes()
        assert hashlib.sha256(raw).hexdigest() == sums[f"fashion_mnist_test/{name}"]
    images = gzip.decompress((folder / "t10k-images-idx3-ubyte.gz").read_bytes())
    labels = gzip.decompress((folder / "t10k-labels-idx1-ubyte.gz").read_bytes())
    assert images[:4] == b"\x00\x00\x08\x03" and len(images) == 16 + 10000 * 28 * 28
    assert labels[:4] == b"\x00\x00\x08\x01" and len(labels) == 8 + 10000 and max(labels[8:]) == 9


# --- the image-folder reader on real JPEGs ----------------------------------------------------

def test_folder_reader_on_real_jpegs(tmp_path, jpegs, capsys):
    root = _jpeg_root(tmp_path, jpegs)
    built = {}
    for split in ("test", "train"):
        data = built[split] = build_dataset("cifar10", root=root, split=split)
        names = _names(jpegs, split)
        assert (data.variant, data.source) == ("cifar10-jpeg", str(root / "cifar10-jpeg"))
        assert data.labels.tolist() == [i // PER_CLASS for i in range(10 * PER_CLASS)]
        assert torch.equal(data.images, _chw(np.stack([_decode(jpegs[n]) for n in names])))
        image, label = data[3]
        assert image.dtype == torch.float32 and label == 3 // PER_CLASS
    assert capsys.readouterr().err == ""  # an explicit root: nothing to announce
    # ROOT may also be the image folder itself (ROOT/{train,test})
    direct = build_dataset("cifar10", root=root / "cifar10-jpeg", split="test")
    assert direct.source == str(root / "cifar10-jpeg") and torch.equal(direct.images, built["test"].images)
    assert not torch.equal(built["train"].images, built["test"].images)
    assert locate_dataset("cifar10", root) == root / "cifar10-jpeg"


# --- canonical pickles rebuilt from real images -----------------------------------------------

def test_canonical_pickles_rebuilt_from_real_images(tmp_path, jpegs):
    folder, truth = _pickle_root(tmp_path, jpegs)
    for split in ("train", "test"):
        data = build_dataset("cifar10", root=tmp_path, split=split)
        assert (data.variant, data.source) == ("cifar10", str(folder))
        images, labels = truth[split]
        assert data.labels.tolist() == labels and torch.equal(data.images, _chw(images))
    # the pixel layout, spelled out once: pixel (row 2, column 5) of image 3's green plane
    image, _ = build_dataset("cifar10", root=tmp_path, split="test")[3]
    assert image[1, 2, 5].item() * 255 == pytest.approx(float(truth["test"][0][3, 2, 5, 1]))
    # where both forms are present, the canonical pickles are read
    _jpeg_root(tmp_path, jpegs, splits=("test",))
    assert build_dataset("cifar10", root=tmp_path, split="test").variant == "cifar10"


def test_md5_check_of_the_pickles(tmp_path, jpegs, monkeypatch):
    """verify=True compares each batch with the canonical md5: rebuilt files differ, a clear error."""
    folder, _ = _pickle_root(tmp_path, jpegs)
    with pytest.raises(ValueError, match=r"md5 [0-9a-f]{32}, expected the canonical .*download") as err:
        build_dataset("cifar10", root=tmp_path, split="test", verify=True)
    assert str(folder / "test_batch") in str(err.value)
    assert cifar10.MD5["test_batch"] in str(err.value)
    # the check reads the digest of the bytes on disk: a file carrying the canonical digest passes
    batch = (folder / "test_batch").read_bytes()
    monkeypatch.setitem(cifar10.MD5, "test_batch", hashlib.md5(batch).hexdigest())
    assert len(build_dataset("cifar10", root=tmp_path, split="test", verify=True)) == 10 * PER_CLASS
    (folder / "test_batch").write_bytes(batch[: len(batch) // 2])
    with pytest.raises(ValueError, match="truncated"):
        build_dataset("cifar10", root=tmp_path, split="test")


# --- missing and partial roots ----------------------------------------------------------------

def _assert_names_the_fix(message: str, root: Path):
    assert str(root) in message  # where it looked
    assert "cifar10-jpeg/{train,test}/<class>" in message  # where to put it
    assert "download=True" in message and "tar -xzf cifar10-jpeg.tar.gz" in message  # how to get it


def test_missing_root_is_an_error_naming_the_fix(tmp_path, capsys):
    with pytest.raises(FileNotFoundError) as err:
        build_dataset("cifar10", root=tmp_path / "nowhere", split="test")
    _assert_names_the_fix(str(err.value), tmp_path / "nowhere")
    assert "ROBUST_ATTN_DATA" in str(err.value)


def test_default_root_without_training_data_names_the_fix(empty_default_root):
    """The embedded copy covers only the test split."""
    with pytest.raises(FileNotFoundError) as err:
        build_dataset("cifar10", split="train")
    _assert_names_the_fix(str(err.value), empty_default_root)


def test_partial_image_folder_root(tmp_path, jpegs):
    root = _jpeg_root(tmp_path, jpegs, splits=("train",))
    with pytest.raises(FileNotFoundError) as err:  # only train/ present
        build_dataset("cifar10", root=root, split="test")
    _assert_names_the_fix(str(err.value), root)
    assert f"{root / 'cifar10-jpeg'} holds train/ but no test/" in str(err.value)
    assert len(build_dataset("cifar10", root=root, split="train")) == 10 * PER_CLASS  # what is there still reads

    shutil.rmtree(root / "cifar10-jpeg" / "train" / "cat")  # a class folder missing
    with pytest.raises(ValueError, match=r"missing \['cat'\]") as err:
        build_dataset("cifar10", root=root, split="train")
    _assert_names_the_fix(str(err.value), root / "cifar10-jpeg" / "train")

    (root / "cifar10-jpeg" / "train" / "cat").mkdir()  # ... or empty
    with pytest.raises(ValueError, match="holds no images") as err:
        build_dataset("cifar10", root=root, split="train")
    _assert_names_the_fix(str(err.value), root / "cifar10-jpeg" / "train" / "cat")


def test_partial_pickle_root(tmp_path, jpegs):
    folder, _ = _pickle_root(tmp_path, jpegs)
    (folder / "data_batch_5").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks \['data_batch_5'\]") as err:
        build_dataset("cifar10", root=tmp_path, split="train")
    _assert_names_the_fix(str(err.value), tmp_path)
    assert len(build_dataset("cifar10", root=tmp_path, split="test")) == 10 * PER_CLASS


# --- data roots: explicit roots are searched alone, default locations are announced --

def _tiny_cifar100(root: Path) -> Path:
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    data = np.random.default_rng(0).integers(0, 256, (3, 3072), dtype=np.uint8)
    obj = {b"filenames": [b"a.png", b"b.png", b"c.png"], b"batch_label": b"testing batch 1 of 1",
           b"fine_labels": [5, 0, 99], b"coarse_labels": [1, 2, 3], b"data": data}
    (folder / "test").write_bytes(pickle.dumps(obj, protocol=2))
    return folder


def _tiny_imagenet(root: Path) -> Path:
    from PIL import Image

    for wnid in ("n01440764", "n01443537"):
        (root / "imagenet" / "val" / wnid).mkdir(parents=True)
        for j in range(2):
            Image.new("RGB", (40, 36), color=(60 * j, 20, 90)).save(root / "imagenet" / "val" / wnid / f"{j}.JPEG")
    return root / "imagenet" / "val"


@pytest.mark.parametrize("name,make,variant", [("cifar100", _tiny_cifar100, "cifar100"),
                                               ("imagenet", _tiny_imagenet, "imagenet-val-original")])
def test_explicit_root_never_falls_back_to_the_default(name, make, variant, tmp_path, monkeypatch, capsys):
    default = tmp_path / "default-root"
    source = make(default)
    monkeypatch.setenv("ROBUST_ATTN_DATA", str(default))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as err:  # the default root holds the data; the explicit one does not
        build_dataset(name, root=empty, split="test")
    assert str(empty) in str(err.value) and str(default) not in str(err.value)
    assert "root=" in str(err.value) and "ROBUST_ATTN_DATA" in str(err.value)

    explicit = build_dataset(name, root=default, split="test")
    assert (explicit.variant, explicit.source) == (variant, str(source))
    assert capsys.readouterr().err == ""
    fallback = build_dataset(name, split="test", limit=2)  # no root: the default location, announced
    assert (fallback.variant, fallback.source) == (variant, str(source)) and len(fallback) == 2
    assert f"read from {source} (default location" in capsys.readouterr().err


def test_cifar10_explicit_root_never_falls_back(tmp_path, monkeypatch, jpegs):
    """Neither to the default root nor to the embedded test set."""
    default = _jpeg_root(tmp_path / "default-root", jpegs, splits=("test",))
    monkeypatch.setenv("ROBUST_ATTN_DATA", str(default))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as err:
        build_dataset("cifar10", root=empty, split="test")
    assert str(default) not in str(err.value) and "embedded" not in str(err.value)
    assert build_dataset("cifar10", split="test").source == str(default / "cifar10-jpeg")
