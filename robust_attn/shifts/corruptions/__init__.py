"""Common corruptions (Hendrycks & Dietterich, "Benchmarking Neural Network Robustness to Common
Corruptions and Perturbations", ICLR 2019): the 15 of ImageNet-C and CIFAR-10-C plus the 4 extra
("validation") ones, at severities 1-5, with one entry point.

    >>> from robust_attn.shifts.corruptions import corrupt, corrupt_batch, CORRUPTIONS
    >>> out = corrupt(image_uint8_hwc, "gaussian_noise", severity=3, seed=0)

Parameters are those of the size-agnostic ``imagecorruptions`` package (Michaelis et al. 2019,
Hendrycks' ImageNet-C functions made to work at any image size), the reference the tests compare
with; the code is our own and batched over images (NumPy/SciPy/PIL only, no OpenCV,
scikit-image or ImageMagick). Families, one file each: :mod:`.noise`, :mod:`.blur`,
:mod:`.weather` (snow, frost, fog), :mod:`.spatter`, :mod:`.digital`.

Randomness and seeds. Each image draws from its own generator,
``numpy.random.default_rng([seed, crc32(name), index])``: the same image (dataset position
``index``) gets the same corruption in any batch, any process and for every model. The
generator does not depend on the severity, so the severities of one image share their random
field (common random numbers; the reference draws each severity afresh, which gives each
severity the same distribution but noisier severity curves).

Output. Images go in as uint8 (N, H, W, 3) and come out as uint8: the corrupted float image in
[0, 255] is truncated to an integer (``np.uint8``), as in the reference and the published
CIFAR-10-C / ImageNet-C files.

Where we deviate from the reference (each also said in its function's docstring):

* ``frost`` needs the frost photographs of Hendrycks' repository; they are read from an
  installed ``imagecorruptions`` package (or ``$ROBUST_ATTN_FROST_DIR``) and are not shipped here.
  The crops are resized with our bicubic (a = -0.75, as OpenCV's ``INTER_CUBIC``) in floating
  point, where OpenCV uses fixed point (differences of one grey level).
* ``spatter`` at severities 1-3 normalises its water layer by its maximum; when a small image
  draws no water at all the reference divides 0 by 0 and returns a black image (NaN cast to
  uint8); we return the image without water.
* ``motion_blur`` and ``snow`` stop adding kernel taps once a shift leaves the image, as the
  reference does, which darkens images smaller than the kernel (32 px at severity 5).
* Hendrycks' CIFAR-10-C used smaller, CIFAR-specific parameters (e.g. Gaussian noise sigma
  0.04-0.10, frost textures scaled by 0.2); we use the size-agnostic ImageNet-C parameters at
  every size, as ``imagecorruptions`` does. Evaluate on the published CIFAR-10-C files
  (:mod:`robust_attn.shifts.published`) to reproduce CIFAR-10-C numbers.
"""
from __future__ import annotations

import difflib
from typing import Callable, Sequence

import numpy as np

from robust_attn.shifts.seeds import image_rngs
from robust_attn.utils.plugins import Registry

__all__ = ["CORRUPTIONS", "COMMON", "EXTRA", "FAMILIES", "SEVERITIES", "register", "corrupt", "corrupt_batch",
           "corruption_names", "check_corruption", "check_severity", "image_rngs"]

SEVERITIES = (1, 2, 3, 4, 5)
#: The 15 corruptions of ImageNet-C / CIFAR-10-C (Hendrycks & Dietterich 2019, Figure 1), by family.
FAMILIES = {"noise": ("gaussian_noise", "shot_noise", "impulse_noise"),
            "blur": ("defocus_blur", "glass_blur", "motion_blur", "zoom_blur"),
            "weather": ("snow", "frost", "fog", "brightness"),
            "digital": ("contrast", "elastic_transform", "pixelate", "jpeg_compression")}
COMMON = tuple(name for names in FAMILIES.values() for name in names)
#: The four held-out corruptions of the paper's appendix (ImageNet-C's "extra" folder).
EXTRA = ("speckle_noise", "gaussian_blur", "spatter", "saturate")

#: name -> ``fn(x, severity, rngs)``: x float64 (N, H, W, 3) in [0, 1], one generator per image;
#: returns the corrupted images as floats in [0, 1] (clipped by :func:`corrupt_batch`). The family
#: modules of this package register theirs with ``@register(name)``.
CORRUPTIONS: Registry[Callable] = Registry("corruption", package="robust_attn.shifts.corruptions", error=ValueError)


def register(name: str):
    return CORRUPTIONS.add(name)


def corruption_names(subset: str = "common") -> list[str]:
    """``common`` (the 15), ``extra`` (the 4), ``all`` (19), a family (``noise``, ``blur``,
    ``weather``, ``digital``), a corruption's name, or a comma list of any of these (in order,
    without repeats); an unknown name is a ValueError with the closest name."""
    if subset == "common":
        return list(COMMON)
    if subset == "extra":
        return list(EXTRA)
    if subset == "all":
        return list(COMMON + EXTRA)
    if subset in FAMILIES:
        return list(FAMILIES[subset])
    parts = [n.strip() for n in subset.split(",") if n.strip()]
    if not parts:
        raise ValueError("no corruption named; give common, extra, all, a family or corruption names")
    if len(parts) > 1:
        return list(dict.fromkeys(name for part in parts for name in corruption_names(part)))
    return [check_corruption(parts[0])]


def check_corruption(name: str) -> str:
    """``name`` if it is a corruption (the paper's 19 or one registered besides), else ValueError
    with the closest name."""
    if name not in CORRUPTIONS:
        known = list(COMMON + EXTRA) + [n for n in CORRUPTIONS.names() if n not in COMMON + EXTRA]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown corruption {name!r}.{hint} Choose from {', '.join(known)} "
                         f"(or common, extra, all, noise, blur, weather, digital).")
    return name


def check_severity(severity) -> int:
    if isinstance(severity, bool) or int(severity) != severity or int(severity) not in SEVERITIES:
        raise ValueError(f"severity must be an integer from 1 to 5, got {severity!r}")
    return int(severity)


def _as_batch(images: np.ndarray) -> np.ndarray:
    images = np.asarray(images)
    if images.dtype != np.uint8:
        raise TypeError(f"corruptions take uint8 images in [0, 255], got {images.dtype}")
    if images.ndim == 3 and images.shape[-1] not in (1, 3):   # (N, H, W) gray
        images = images[..., None]
    if images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(f"corruptions take (N, H, W, 3) or gray (N, H, W) images, got shape {images.shape}")
    if images.shape[-1] == 1:
        images = np.repeat(images, 3, axis=-1)
    return images


def corrupt_batch(images: np.ndarray, name: str, severity: int, indices: Sequence[int] | None = None,
                  seed: int = 0, rngs: Sequence[np.random.Generator] | None = None) -> np.ndarray:
    """Corrupt uint8 images (N, H, W, 3) (gray (N, H, W) is repeated to 3 channels) with
    corruption ``name`` at ``severity``; image ``k`` draws from the generator of
    ``indices[k]`` (default ``0..N-1``) and ``seed`` (or from ``rngs[k]``). Returns uint8
    (N, H, W, 3)."""
    check_corruption(name)
    severity = check_severity(severity)
    batch = _as_batch(images)
    if rngs is None:
        rngs = image_rngs(name, range(len(batch)) if indices is None else indices, seed)
    if len(rngs) != len(batch):
        raise ValueError(f"{len(batch)} images but {len(rngs)} indices")
    if len(batch) == 0:
        return batch.copy()
    x = batch.astype(np.float64) / 255.0
    out = CORRUPTIONS.get(name)(x, severity, list(rngs))
    return (np.clip(out, 0, 1) * 255).astype(np.uint8)


def corrupt(image: np.ndarray, name: str, severity: int, seed: int = 0, index: int = 0) -> np.ndarray:
    """One uint8 image (H, W, 3) or (H, W) corrupted: :func:`corrupt_batch` of one image with
    dataset position ``index``. Returns uint8 (H, W, 3)."""
    image = np.asarray(image)
    if image.ndim not in (2, 3):
        raise ValueError(f"corrupt takes one (H, W, 3) or (H, W) image, got shape {image.shape}")
    return corrupt_batch(image[None], name, severity, indices=[index], seed=seed)[0]

