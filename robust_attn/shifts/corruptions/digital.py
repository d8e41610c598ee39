"""Digital and colour corruptions (Hendrycks & Dietterich 2019, section 3, "digital", plus
brightness from "weather" and saturate from the extra four). Parameters per severity 1-5 as in
ImageNet-C / ``imagecorruptions``:

* brightness: HSV value + 0.1 ... 0.5 (clipped to 1);
* contrast: ``(x - mean) c + mean`` per image and channel, c = 0.4 ... 0.05;
* elastic transform: ``imagecorruptions``' size-agnostic version: a uniform displacement field
  of at most 0.5% of the height, Gaussian-smoothed (sigma 1% of the size, reflected borders,
  truncated at 3 sigma) and scaled by alpha = 12.5 ... 30, applied with bilinear sampling and
  reflected borders. (Hendrycks' ImageNet-C code also applied a random affine warp with
  224-pixel parameters; ``imagecorruptions`` dropped it and so do we.)
* pixelate: box downscale to 0.6 ... 0.25 of the size, nearest-neighbour upscale (PIL);
* JPEG: quality 25, 18, 15, 10, 7 (PIL's encoder and decoder);
* saturate: HSV saturation ``s * a + b`` with (a, b) = (0.3, 0), (0.1, 0), (2, 0), (5, 0.1),
  (20, 0.2): severities 1-2 desaturate, 3-5 oversaturate, so the distance from the clean image
  is not monotone in the severity.
"""
from __future__ import annotations

import io

import numpy as np

from robust_attn.shifts.corruptions import register
from robust_attn.shifts.corruptions.ops import gaussian, hsv_to_rgb, reflect_index, rgb_to_hsv

BRIGHTNESS = (0.1, 0.2, 0.3, 0.4, 0.5)
CONTRAST = (0.4, 0.3, 0.2, 0.1, 0.05)
ELASTIC = (250 * 0.05, 250 * 0.065, 250 * 0.085, 250 * 0.1, 250 * 0.12)
PIXELATE = (0.6, 0.5, 0.4, 0.3, 0.25)
JPEG_QUALITY = (25, 18, 15, 10, 7)
SATURATE = ((0.3, 0), (0.1, 0), (2, 0), (5, 0.1), (20, 0.2))


@register("brightness")
def brightness(x, severity, rngs):
    hsv = rgb_to_hsv(x)
    hsv[..., 2] = np.clip(hsv[..., 2] + BRIGHTNESS[severity - 1], 0, 1)
    return hsv_to_rgb(hsv)


@register("saturate")
def saturate(x, severity, rngs):
    scale, shift = SATURATE[severity - 1]
    hsv = rgb_to_hsv(x)
    hsv[..., 1] = np.clip(hsv[..., 1] * scale + shift, 0, 1)
    return hsv_to_rgb(hsv)


@register("contrast")
def contrast(x, severity, rngs):
    means = x.mean(axis=(1, 2), keepdims=True)
    return (x - means) * CONTRAST[severity - 1] + means


def bilinear_reflect(x: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Sample every image of ``x`` (N, H, W, C) at float coordinates ``rows``, ``cols``
    (N, H, W), bilinearly, with half-sample symmetric borders (``scipy.ndimage.map_coordinates``
    with ``order=1, mode="reflect"``)."""
    n, h, w, _ = x.shape
    r0, c0 = np.floor(rows), np.floor(cols)
    tr, tc = (rows - r0)[..., None], (cols - c0)[..., None]
    r0, c0 = r0.astype(np.intp), c0.astype(np.intp)
    ra, rb = reflect_index(r0, h), reflect_index(r0 + 1, h)
    ca, cb = reflect_index(c0, w), reflect_index(c0 + 1, w)
    b = np.arange(n)[:, None, None]
    top = x[b, ra, ca] * (1 - tc) + x[b, ra, cb] * tc
    bottom = x[b, rb, ca] * (1 - tc) + x[b, rb, cb] * tc
    return top * (1 - tr) + bottom * tr


@register("elastic_transform")
def elastic_transform(x, severity, rngs):
    n, h, w, _ = x.shape
    x = x.astype(np.float32)
    sigma = (h * 0.01, w * 0.01)
    limit = h * 0.005
    alpha = ELASTIC[severity - 1]
    fields = []
    for rng in rngs:   # per image: the column displacement field first, then the row one
        fields.append((rng.uniform(-limit, limit, size=(h, w)), rng.uniform(-limit, limit, size=(h, w))))
    dx = (gaussian(np.stack([f[0] for f in fields]), sigma, mode="reflect", truncate=3) * alpha).astype(np.float32)
    dy = (gaussian(np.stack([f[1] for f in fields]), sigma, mode="reflect", truncate=3) * alpha).astype(np.float32)
    yy, xx = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return bilinear_reflect(x, yy[None] + dy, xx[None] + dx)


def _pil_each(x: np.ndarray, fn) -> np.ndarray:
    from PIL import Image

    images = (x * 255).round().astype(np.uint8)
    return np.stack([np.asarray(fn(Image.fromarray(image))) for image in images]) / 255.0


@register("pixelate")
def pixelate(x, severity, rngs):
    from PIL import Image

    c = PIXELATE[severity - 1]
    h, w = x.shape[1:3]
    small = (max(1, int(w * c)), max(1, int(h * c)))
    return _pil_each(x, lambda im: im.resize(small, Image.BOX).resize((w, h), Image.NEAREST))


@register("jpeg_compression")
def jpeg_compression(x, severity, rngs):
    from PIL import Image

    def roundtrip(im):
        buffer = io.BytesIO()
        im.save(buffer, "JPEG", quality=JPEG_QUALITY[severity - 1])
        return Image.open(buffer).convert("RGB")

    return _pil_each(x, roundtrip)
