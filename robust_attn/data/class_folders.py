"""Test sets published as one folder of images per class (ImageNet-A, -R, -Sketch, ImageNetV2):
finding the folder under a data root and reading it with a dataset's own class names.

A dataset module of this kind says where its folder may be (names under the data root, e.g.
``imagenet-r``) and how a folder name maps to a label (``labels``: folder name -> label), and
gets its ``INFO``, ``locate`` and ``build`` from :func:`folder_test_set`::

    INFO, locate, build = folder_test_set("imagenet_sketch", wnid_index(), wnids(), ("sketch",), how_to_get)
    TAKES_TRANSFORM = True
    register_dataset(__name__)

Only the ``test`` split exists: these sets are for evaluation. Images are decoded with the
ImageNet single-crop evaluation transform (resize 256, centre 224), or a model's own eval
transform. ``logit_subset``: the set's classes among the 1,000 ImageNet logits, where it has
fewer (:class:`~robust_attn.data.base.DatasetInfo`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Sequence

from robust_attn.data.base import DatasetInfo, default_data_root, missing_dataset_error
from robust_attn.data.imagefolder import ImageListDataset, class_folders, list_images
from robust_attn.data.transforms import imagenet_eval_transform

__all__ = ["folder_test_set", "imagenet_subset_test_set", "locate_class_folders", "build_class_folders"]

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _usable(folder: Path) -> bool:
    return folder.is_dir() and any(p.is_dir() and not p.name.startswith(".") for p in folder.iterdir())


def locate_class_folders(info: DatasetInfo, root, split: str | None, names: Sequence[str]) -> Path:
    """The first of ``root/<name>`` (``names`` in order; ``root`` itself when a name is ``""``)
    that holds class folders; ``FileNotFoundError`` naming each folder searched and how to get
    the data. Only the ``test`` split exists."""
    if split not in (None, "test"):
        raise FileNotFoundError(f"dataset {info.name!r} is a test set: it has no {split!r} split; evaluate it with "
                                f"--split test")
    root = Path(root).expanduser() if root is not None else default_data_root()
    candidates = [root / name if name else root for name in names]
    for folder in candidates:
        if _usable(folder):
            return folder
    raise missing_dataset_error(info.name, candidates, info.how_to_get)


def build_class_folders(info: DatasetInfo, folder: Path, labels: Mapping[str, int], classes: Sequence[str],
                        augment: bool, transform: Callable | None, variant: str) -> ImageListDataset:
    """The images of ``folder``'s class folders, labelled by ``labels`` (folder name -> label);
    ``classes[label]`` names a label. A folder ``labels`` does not know is an error naming it."""
    if augment:
        raise ValueError(f"dataset {info.name!r} is a test set; it is not augmented")
    present = class_folders(folder)
    foreign = [name for name in present if name not in labels]
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(f"dataset {info.name!r}: {folder} holds folders that are not its classes: {shown}. "
                         f"{info.how_to_get}")
    samples = [(path, labels[name]) for name in present for path in list_images(folder / name)]
    if not samples:
        raise FileNotFoundError(f"dataset {info.name!r}: no images in the class folders of {folder}")
    dataset = ImageListDataset(samples, transform or imagenet_eval_transform(info.image_size), classes,
                               num_classes=info.num_classes)
    dataset.class_to_idx = {name: labels[name] for name in present}
    dataset.variant, dataset.source = variant, str(folder)
    return dataset


def folder_test_set(name: str, labels: Mapping[str, int], classes: Sequence[str], folders: Sequence[str],
                    how_to_get: str, logit_subset: Sequence[int] = ()):
    """``(INFO, locate, build)`` of a test set named ``name`` whose images are in
    ``ROOT/<folder>/<class folder>/`` for the first of ``folders`` present; ``labels`` maps a class
    folder's name to its label, ``classes[label]`` names it; ``logit_subset``: the index of each
    class among ImageNet's 1,000 logits where the set has fewer classes."""
    info = DatasetInfo(name=name, num_classes=len(classes), image_size=224, resolution="imagenet",
                       mean=IMAGENET_MEAN, std=IMAGENET_STD, splits=("test",), how_to_get=how_to_get,
                       logit_subset=tuple(logit_subset), model_classes=1000 if logit_subset else 0)

    def locate(root, split: str | None = None) -> Path:
        return locate_class_folders(info, root, split, folders)

    def build(root, split: str, augment: bool, download: bool = False, verify: bool = False,
              transform: Callable | None = None) -> ImageListDataset:
        if download:
            raise ValueError(f"dataset {name!r} is not downloaded automatically: {how_to_get}")
        return build_class_folders(info, locate(root, split), labels, classes, augment, transform, name)

    return info, locate, build


def imagenet_subset_test_set(name: str, wnids: Sequence[str], folders: Sequence[str], how_to_get: str):
    """:func:`folder_test_set` of a set of some ImageNet classes in wnid folders (ImageNet-A, -R):
    labels index the sorted ``wnids``, and a model's 1,000 logits are restricted to them."""
    from robust_attn.data.imagenet import wnid_index

    index = wnid_index()
    return folder_test_set(name, {w: i for i, w in enumerate(wnids)}, wnids, folders, how_to_get,
                           logit_subset=[index[w] for w in wnids])
