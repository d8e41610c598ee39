"""ImageNet (ILSVRC-2012) in the standard ImageFolder layout.

``ROOT/imagenet/{train,val}/<wnid>/*.JPEG`` (or ``ROOT/{train,val}/...``): one folder per class
named by its WordNet id; the sorted folder order is the class index (0..999), as in every
public ImageNet loader. The test split is the original validation set (``val``: "val-original").

Transforms (SAN section 5.1): training uses a random-resized crop to 224 and horizontal flip;
evaluation resizes the short side to 256 and takes the central 224x224 crop.

Where it is looked for: an explicit ``root`` is searched alone (``ROOT/imagenet``, then ``ROOT``) and
a root without the split's folder is an error; without one, the default data root
(``$ROBUST_ATTN_DATA`` or ``./data``) is searched the same way. There is no other fallback. The
dataset built (a torchvision ``ImageFolder``) carries ``variant`` ("imagenet" for train,
"imagenet-val-original" for test) and ``source`` (the split's folder).
"""
from __future__ import annotations

from pathlib import Path

from robust_attn.data.base import DatasetInfo, default_data_root, missing_dataset_error
from robust_attn.data.transforms import imagenet_eval_transform, imagenet_train_transform

__all__ = ["INFO", "locate", "build"]

FOLDERS = {"train": "train", "test": "val"}

INFO = DatasetInfo(name="imagenet", num_classes=1000, image_size=224, resolution="imagenet",
                   mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                   how_to_get="Download ILSVRC-2012 from https://image-net.org (registration needed) and "
                              "arrange train/ and val/ as one folder per wnid (e.g. with the usual "
                              "valprep.sh), under ROOT/imagenet/.")


def _candidates(root: Path) -> list[Path]:
    return [root / "imagenet", root]


def locate(root: str | Path | None, split: str | None = None) -> Path:
    """The folder of ``split`` ("train" -> train/, "test" or None -> val/); FileNotFoundError if absent."""
    root = Path(root) if root is not None else default_data_root()
    sub = FOLDERS[split or "test"]
    for folder in _candidates(root):
        if (folder / sub).is_dir() and any(p.is_dir() for p in (folder / sub).iterdir()):
            return folder / sub
    raise missing_dataset_error("imagenet", [c / sub for c in _candidates(root)], INFO.how_to_get)


def build(root, split: str, augment: bool, download: bool = False, verify: bool = False):
    if download:
        raise ValueError("ImageNet cannot be downloaded automatically: " + INFO.how_to_get)
    from torchvision.datasets import ImageFolder

    folder = locate(root, split)
    transform = imagenet_train_transform(INFO.image_size) if augment else imagenet_eval_transform(INFO.image_size)
    dataset = ImageFolder(str(folder), transform=transform)
    dataset.variant, dataset.source = ("imagenet-val-original" if split == "test" else "imagenet"), str(folder)
    return dataset
