"""ImageNet (ILSVRC-2012) as users hold it: class folders, or the flat validation folder.

Class index: the position of the class's WordNet id in the standard sorted list of the 1,000
ILSVRC-2012 wnids (``imagenet_wnids.txt`` in this package, sha256-checked when read; the order
of torchvision's ``ImageFolder`` on the full set, timm and every public ImageNet-1k checkpoint).
It never depends on the folders present: a subset of the classes keeps the true indices.

Layouts, under ``ROOT/imagenet/`` or ``ROOT/``:

* ``{train,val}/<wnid>/*.JPEG``: one folder per class (e.g. after the usual ``valprep.sh``).
  A folder whose name is not one of the 1,000 wnids is an error naming it.
* ``val/ILSVRC2012_val_00000001.JPEG ...``: the flat validation folder as downloaded (image
  files directly in ``val/``) plus a ground-truth file, looked for in ``val/``, then
  ``ROOT/imagenet/`` (or ``ROOT/``), then ``ROOT``:

  - ``LOC_val_solution.csv`` (Kaggle's ``ImageId,PredictionString``; the first word of the
    prediction string is the wnid);
  - ``val_labels.txt`` / ``val_labels.csv``: ``filename,wnid`` lines (a header line is allowed;
    whitespace separates too); the file name may leave out its extension;
  - the devkit's ``ILSVRC2012_validation_ground_truth.txt`` (one ILSVRC2012_ID in 1..1000 per
    line, line k for ``ILSVRC2012_val_{k:08d}.JPEG``), also inside
    ``ILSVRC2012_devkit_t12/data/`` or the ``ILSVRC2012_devkit_t12.tar.gz`` archive. Its IDs
    follow the devkit's ``meta.mat`` synset order, which is not the sorted wnid order, so the
    devkit's own ``data/meta.mat`` (next to the file, or in the archive) gives the ID -> wnid
    mapping; it is read with ``scipy.io.loadmat``. Without it the devkit file is an error naming
    the missing ``meta.mat``.

  Every image must have a ground-truth entry; entries for absent images are ignored (a subset).

The test split is the original validation set ("val-original"). Transforms (SAN section 5.1):
training uses a random-resized crop to 224 and horizontal flip; evaluation resizes the short
side to 256 and takes the central 224x224 crop, unless ``build(..., transform=)`` gives a
model's own eval transform.

Where it is looked for: an explicit ``root`` is searched alone (``ROOT/imagenet``, then ``ROOT``)
and a root without the split's folder is an error; without one, the default data root
(``$ROBUST_ATTN_DATA`` or ``./data``) is searched the same way. There is no other fallback. The
dataset built (:class:`~robust_attn.data.imagefolder.ImageListDataset`) carries ``variant``
("imagenet" for train, "imagenet-val-original" for test), ``source`` (the split's folder),
``classes`` (the wnids present, sorted), ``class_to_idx`` (each to its index in the 1,000) and
``num_classes`` (1000).
"""
from __future__ import annotations

import csv
import hashlib
import io
import tarfile
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Callable

from robust_attn.data.base import DatasetInfo, default_data_root, missing_dataset_error, register_dataset
from robust_attn.data.imagefolder import IMAGE_EXTENSIONS, ImageListDataset, class_folders, list_images
from robust_attn.data.transforms import imagenet_eval_transform, imagenet_train_transform

__all__ = ["INFO", "locate", "build", "wnids", "wnid_index", "read_ground_truth", "WNIDS_SHA256",
           "GROUND_TRUTH_FILES", "TAKES_TRANSFORM"]

FOLDERS = {"train": "train", "test": "val"}
TAKES_TRANSFORM = True
#: sha256 of imagenet_wnids.txt (1,000 sorted wnids, n01440764 ... n15075141, one per line);
#: the same list as timm's ``timm/data/_info/imagenet_synsets.txt``
WNIDS_SHA256 = "70002b0ff5de60a3a17a82dbfcff291931f96225ddf941ad2e182fc39e183d15"
LOC_SOLUTION = "LOC_val_solution.csv"
DEVKIT_TRUTH = "ILSVRC2012_validation_ground_truth.txt"
DEVKIT_FOLDER = "ILSVRC2012_devkit_t12"
DEVKIT_ARCHIVE = "ILSVRC2012_devkit_t12.tar.gz"
#: ground-truth files of the flat validation folder, in the order they are preferred
GROUND_TRUTH_FILES = (LOC_SOLUTION, "val_labels.txt", "val_labels.csv", DEVKIT_TRUTH)

INFO = DatasetInfo(name="imagenet", num_classes=1000, image_size=224, resolution="imagenet",
                   mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                   how_to_get="Download ILSVRC-2012 from https://image-net.org (registration needed) and put "
                              "train/ and val/ under ROOT/imagenet/: one folder per wnid, or val/ as the flat "
                              "folder of 50,000 images with LOC_val_solution.csv or the devkit "
                              "(ILSVRC2012_devkit_t12.tar.gz) beside it.")


@lru_cache(maxsize=1)
def wnids() -> tuple[str, ...]:
    """The 1,000 ILSVRC-2012 wnids, sorted: ``wnids()[i]`` is class ``i``."""
    data = resources.files("robust_attn.data").joinpath("imagenet_wnids.txt").read_bytes()
    if hashlib.sha256(data).hexdigest() != WNIDS_SHA256:
        raise RuntimeError("robust_attn/data/imagenet_wnids.txt does not match its sha256; reinstall robust-attn")
    return tuple(data.decode().split())


def wnid_index() -> dict[str, int]:
    """wnid -> class index (0..999)."""
    return {w: i for i, w in enumerate(wnids())}


def _candidates(root: Path) -> list[Path]:
    return [root / "imagenet", root]


def _usable(folder: Path) -> bool:
    """A split folder holding class folders or (the flat val layout) image files."""
    return folder.is_dir() and any(p.is_dir() or p.suffix.lower() in IMAGE_EXTENSIONS for p in folder.iterdir())


def locate(root: str | Path | None, split: str | None = None) -> Path:
    """The folder of ``split`` ("train" -> train/, "test" or None -> val/); FileNotFoundError if absent."""
    root = Path(root) if root is not None else default_data_root()
    sub = FOLDERS[split or "test"]
    for folder in _candidates(root):
        if _usable(folder / sub):
            return folder / sub
    hint = INFO.how_to_get
    others = [n for n in class_folders(root) if n not in ("imagenet", "train", "val")] if root.is_dir() else []
    if others:
        hint += (f" ({root} holds the folders {', '.join(others[:3])}...; for your own classes use "
                 f"--dataset imagefolder --root {root})")
    raise missing_dataset_error("imagenet", [c / sub for c in _candidates(root)], hint)


def _class_folder_samples(folder: Path) -> tuple[list[tuple[Path, int]], list[str]]:
    index = wnid_index()
    present = class_folders(folder)
    foreign = [name for name in present if name not in index]
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(f"dataset 'imagenet': {folder} holds folders that are not ImageNet-1k wnids: {shown}. "
                         f"ImageNet class folders are named by wnid (n01440764 ... n15075141); for your own "
                         f"classes use --dataset imagefolder --root DIR")
    samples = []
    for name in present:
        samples += [(p, index[name]) for p in list_images(folder / name)]
    return samples, present


def _read_meta_mat(source) -> dict[int, str]:
    """ILSVRC2012_ID -> wnid of the 1,000 leaf synsets in a devkit ``meta.mat`` (path or file object)."""
    try:
        from scipy.io import loadmat
    except ImportError:  # pragma: no cover - scipy comes with foolbox
        raise ValueError("reading the devkit's meta.mat needs scipy (pip install scipy)") from None
    synsets = loadmat(source, squeeze_me=True)["synsets"]
    mapping = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets if int(s["ILSVRC2012_ID"]) <= 1000}
    if sorted(mapping) != list(range(1, 1001)):
        raise ValueError(f"meta.mat: expected ILSVRC2012_IDs 1..1000, got {len(mapping)} of them")
    return mapping


def _devkit_truth(path: Path | None, archive: Path | None) -> dict[str, str]:
    """file stem -> wnid from the devkit's ground truth and its meta.mat (folder or archive)."""
    if path is not None:
        lines = path.read_text().split()
        meta = path.parent / "meta.mat"
        if not meta.is_file():
            raise FileNotFoundError(
                f"{path} lists ILSVRC2012_IDs in the devkit's meta.mat order (not the sorted wnid order) and "
                f"{meta} is missing: put the devkit's data/meta.mat next to it, or {DEVKIT_ARCHIVE} in the "
                f"data root, or give LOC_val_solution.csv (or val_labels.txt: filename,wnid) instead")
        mapping = _read_meta_mat(str(meta))
        where = str(path)
    else:
        with tarfile.open(archive) as tar:
            members = {m.name.split("/", 1)[-1]: m for m in tar.getmembers() if m.isfile()}
            truth, meta = members.get(f"data/{DEVKIT_TRUTH}"), members.get("data/meta.mat")
            if truth is None or meta is None:
                raise ValueError(f"{archive} lacks data/{DEVKIT_TRUTH} or data/meta.mat; is it the ILSVRC-2012 "
                                 f"devkit (task 1 & 2)?")
            lines = tar.extractfile(truth).read().decode().split()
            mapping = _read_meta_mat(io.BytesIO(tar.extractfile(meta).read()))
        where = f"{archive}:data/{DEVKIT_TRUTH}"
    try:
        return {f"ILSVRC2012_val_{k:08d}": mapping[int(v)] for k, v in enumerate(lines, start=1)}
    except (KeyError, ValueError) as err:
        raise ValueError(f"{where}: every line must be an ILSVRC2012_ID in 1..1000 ({err})") from None


def _table_truth(path: Path) -> dict[str, str]:
    """file stem -> wnid from ``LOC_val_solution.csv`` or a ``filename,wnid`` table."""
    out = {}
    with open(path, newline="") as f:
        for number, row in enumerate(csv.reader(f)):
            if len(row) == 1:
                row = row[0].split()
            if not row or not row[0].strip():
                continue
            if len(row) < 2:
                raise ValueError(f"{path}: expected 'filename,wnid' rows, got {','.join(row)!r}")
            name, label = row[0].strip(), row[1].strip().split(" ", 1)[0]
            if number == 0 and not (label[:1] == "n" and label[1:].isdigit()):
                continue  # a header (ImageId,PredictionString / filename,wnid / ...)
            out[Path(name).stem if Path(name).suffix.lower() in (".jpeg", ".jpg", ".png") else name] = label
    return out


def read_ground_truth(folder: Path, root: Path | None = None) -> tuple[dict[str, str], str]:
    """The ground truth of the flat validation folder ``folder``: file stem -> wnid, and where it was read.

    Searched in ``folder``, its parent and ``root`` (see the module docstring)."""
    places = list(dict.fromkeys([folder, folder.parent] + ([Path(root)] if root is not None else [])))
    for place in places:
        for name in GROUND_TRUTH_FILES:
            path = place / name
            if path.is_file():
                return (_devkit_truth(path, None) if name == DEVKIT_TRUTH else _table_truth(path)), str(path)
        devkit = place / DEVKIT_FOLDER / "data" / DEVKIT_TRUTH
        if devkit.is_file():
            return _devkit_truth(devkit, None), str(devkit)
        if (place / DEVKIT_ARCHIVE).is_file():
            return _devkit_truth(None, place / DEVKIT_ARCHIVE), str(place / DEVKIT_ARCHIVE)
    names = ", ".join(GROUND_TRUTH_FILES + (f"{DEVKIT_FOLDER}/data/{DEVKIT_TRUTH}", DEVKIT_ARCHIVE))
    raise FileNotFoundError(f"dataset 'imagenet': {folder} holds the images directly (the flat validation folder) "
                            f"but no ground truth was found in {', '.join(map(str, places))}; put one of {names} "
                            f"there, or arrange {folder} as one folder per wnid")


def _flat_samples(folder: Path, root) -> tuple[list[tuple[Path, int]], list[str], str]:
    truth, where = read_ground_truth(folder, root)
    index = wnid_index()
    unknown = sorted({w for w in truth.values() if w not in index})
    if unknown:
        raise ValueError(f"{where} names {len(unknown)} labels that are not ImageNet-1k wnids, e.g. {unknown[:3]}")
    images = list_images(folder)
    missing = [p.name for p in images if p.stem not in truth]
    if missing:
        raise ValueError(f"{len(missing)} images in {folder} have no entry in {where}, e.g. {missing[:3]}; "
                         f"remove them or give a ground-truth file that covers them")
    samples = [(p, index[truth[p.stem]]) for p in images]
    return samples, sorted({truth[p.stem] for p in images}), where


def build(root, split: str, augment: bool, download: bool = False, verify: bool = False,
          transform: Callable | None = None) -> ImageListDataset:
    if download:
        raise ValueError("ImageNet cannot be downloaded automatically: " + INFO.how_to_get)
    folder = locate(root, split)
    index = wnid_index()
    flat = bool(list_images(folder)) and not any(name in index for name in class_folders(folder))
    if not flat:
        samples, present = _class_folder_samples(folder)
        truth = None
    elif split == "test":
        samples, present, truth = _flat_samples(folder, root)
    else:
        raise FileNotFoundError(f"dataset 'imagenet': the training images in {folder} must be in one folder per wnid")
    if not samples:
        raise FileNotFoundError(f"dataset 'imagenet': no images in {folder}")
    if transform is None:
        transform = imagenet_train_transform(INFO.image_size) if augment else imagenet_eval_transform(INFO.image_size)
    dataset = ImageListDataset(samples, transform, present, num_classes=INFO.num_classes)
    dataset.class_to_idx = {w: index[w] for w in present}
    dataset.variant, dataset.source = ("imagenet-val-original" if split == "test" else "imagenet"), str(folder)
    dataset.ground_truth = truth
    return dataset


register_dataset(__name__)
