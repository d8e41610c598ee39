"""Weather corruptions (Hendrycks & Dietterich 2019, section 3, "weather"; brightness, the fourth,
lives in :mod:`.digital` with the other colour changes). Parameters per severity 1-5 as in
ImageNet-C / ``imagecorruptions``:

* snow: a Gaussian field zoomed, thresholded and motion-blurred at an angle in [-135, -45]
  degrees, added to a brightened image together with its 180-degree rotation;
* frost: the image scaled by 1 ... 0.6 plus a random crop of one of Hendrycks' frost
  photographs scaled by 0.4 ... 0.75;
* fog: a diamond-square plasma fractal (``wibbledecay`` 2 ... 1.4) added with weight 1.5 ... 3,
  the result rescaled by ``max / (max + weight)``.

Frost photographs. They are not shipped with robust-attn; :func:`frost_dir` finds them in an
installed ``imagecorruptions`` (``pip install imagecorruptions``; only its ``frost/`` files are
read, nothing of it is imported) or in ``$ROBUST_ATTN_FROST_DIR`` (a folder with Hendrycks'
``frost1.png`` ... ``frost6.jpg``). As in the reference, only the first five are ever drawn
(``randint(5)``), each scaled by 1.1 (more when the image is larger than the photograph) with
bicubic interpolation (a = -0.75, OpenCV's ``INTER_CUBIC``; we interpolate in floating point
where OpenCV uses fixed point, so values can differ by one grey level).
"""
from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from robust_attn.shifts.corruptions import register
from robust_attn.shifts.corruptions.ops import clipped_zoom, draw, motion_blur, rgb_to_gray

SNOW = ((0.1, 0.3, 3, 0.5, 10, 4, 0.8), (0.2, 0.3, 2, 0.5, 12, 4, 0.7), (0.55, 0.3, 4, 0.9, 12, 8, 0.7),
        (0.55, 0.3, 4.5, 0.85, 12, 8, 0.65), (0.55, 0.3, 2.5, 0.85, 12, 12, 0.55))
FROST = ((1, 0.4), (0.8, 0.6), (0.7, 0.7), (0.65, 0.7), (0.6, 0.75))
FOG = ((1.5, 2), (2.0, 2), (2.5, 1.7), (2.5, 1.5), (3.0, 1.4))
FROST_FILES = ("frost1.png", "frost2.png", "frost3.png", "frost4.jpg", "frost5.jpg", "frost6.jpg")
FROST_ENV = "ROBUST_ATTN_FROST_DIR"


@register("snow")
def snow(x, severity, rngs):
    loc, scale, zoom, threshold, radius, sigma, blend = SNOW[severity - 1]
    n, h, w, _ = x.shape
    layer = clipped_zoom(draw(rngs, "normal", loc, scale, size=(h, w)), zoom)
    layer[layer < threshold] = 0
    layer = motion_blur(np.clip(layer, 0, 1), radius, sigma, draw(rngs, "uniform", -135, -45))
    layer = (np.round(layer * 255).astype(np.uint8) / 255.0)[:, :h, :w, None]
    x = x.astype(np.float32)
    x = blend * x + (1 - blend) * np.maximum(x, rgb_to_gray(x)[..., None] * 1.5 + 0.5)
    return x + layer + layer[:, ::-1, ::-1]


def frost_dir() -> Path:
    """The folder of Hendrycks' frost photographs: ``$ROBUST_ATTN_FROST_DIR``, else the
    ``frost/`` folder of an installed ``imagecorruptions``; FileNotFoundError saying how to get
    them otherwise."""
    candidates = []
    if os.environ.get(FROST_ENV):
        candidates.append(Path(os.environ[FROST_ENV]))
    spec = importlib.util.find_spec("imagecorruptions")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "frost" for p in spec.submodule_search_locations]
    for folder in candidates:
        if all((folder / f).is_file() for f in FROST_FILES[:5]):
            return folder
    looked = ", ".join(str(c) for c in candidates) or "nowhere (no imagecorruptions installed, $" + FROST_ENV + " unset)"
    raise FileNotFoundError(
        "the frost corruption needs Hendrycks & Dietterich's frost photographs (frost1.png ... frost5.jpg), "
        f"which robust-attn does not ship; looked in {looked}. Install them with `pip install imagecorruptions` "
        f"(only its frost/ folder is read), or set ${FROST_ENV} to a folder holding them, or leave frost out "
        "(e.g. --corruptions noise,blur,digital,snow,fog,brightness: the 14 others).")


def bicubic_resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 (H, W, C) resized with a = -0.75 bicubic, pixel centres aligned (OpenCV's
    ``INTER_CUBIC`` geometry), rounded to uint8."""
    t = torch.from_numpy(image.astype(np.float32)).permute(2, 0, 1)[None]
    out = F.interpolate(t, size=(height, width), mode="bicubic", align_corners=False)
    return out[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()


@lru_cache(maxsize=16)
def frost_image(index: int, height: int, width: int) -> np.ndarray:
    """Frost photograph ``index`` (0-4) as RGB uint8, scaled as the reference does for an
    ``height`` x ``width`` image: by 1.1 times the factor (at least 1) that makes it cover it."""
    from PIL import Image

    with Image.open(frost_dir() / FROST_FILES[index]) as im:
        photo = np.asarray(im.convert("RGB"))
    fh, fw = photo.shape[:2]
    factor = 1.0
    if fh < height or fw < width:
        factor = max(height / fh if fh < height else 0.0, width / fw if fw < width else 0.0)
    factor *= 1.1
    return bicubic_resize(photo, int(np.ceil(fh * factor)), int(np.ceil(fw * factor)))


@register("frost")
def frost(x, severity, rngs):
    keep, weight = FROST[severity - 1]
    n, h, w, _ = x.shape
    out = np.empty_like(x)
    for k, rng in enumerate(rngs):
        photo = frost_image(int(rng.integers(5)), h, w)
        top = int(rng.integers(0, photo.shape[0] - h))
        left = int(rng.integers(0, photo.shape[1] - w))
        out[k] = keep * x[k] + weight * photo[top:top + h, left:left + w] / 255.0
    return out


def plasma_fractal(rngs, mapsize: int, decay: float) -> np.ndarray:
    """The reference's diamond-square height map, one per generator: (N, mapsize, mapsize) in
    [0, 1]; ``mapsize`` a power of two. Each square and diamond step draws one uniform field
    per image, in the reference's order, so an image's map is the same in any batch."""
    if mapsize & (mapsize - 1):
        raise ValueError(f"the plasma map size must be a power of two, got {mapsize}")
    n = len(rngs)
    grid = np.zeros((n, mapsize, mapsize))
    step, wibble = mapsize, 100.0

    def wibbled_mean(total):
        return total / 4 + wibble * draw(rngs, "uniform", -wibble, wibble, size=total.shape[1:])

    while step >= 2:
        half = step // 2
        corners = grid[:, 0::step, 0::step]
        squares = corners + np.roll(corners, -1, axis=1)
        squares = squares + np.roll(squares, -1, axis=2)
        grid[:, half::step, half::step] = wibbled_mean(squares)
        centres, corners = grid[:, half::step, half::step], grid[:, 0::step, 0::step]
        left = (centres + np.roll(centres, 1, axis=1)) + (corners + np.roll(corners, -1, axis=2))
        grid[:, 0::step, half::step] = wibbled_mean(left)
        top = (centres + np.roll(centres, 1, axis=2)) + (corners + np.roll(corners, -1, axis=1))
        grid[:, half::step, 0::step] = wibbled_mean(top)
        step //= 2
        wibble /= decay
    grid -= grid.min(axis=(1, 2), keepdims=True)
    return grid / grid.max(axis=(1, 2), keepdims=True)


@register("fog")
def fog(x, severity, rngs):
    weight, decay = FOG[severity - 1]
    n, h, w, c = x.shape
    mapsize = 1 << (max(h, w, c) - 1).bit_length()
    peak = x.max(axis=(1, 2, 3), keepdims=True)
    x = x + weight * plasma_fractal(rngs, mapsize, decay)[:, :h, :w, None]
    return x * peak / (peak + weight)
