"""The OpenCV primitives of the water spatter (:mod:`.spatter`), batched, in NumPy/SciPy, with
OpenCV's arithmetic and border rules, so no OpenCV install is needed:

* :func:`canny`: ``cv2.Canny(img, low, high)`` (3 x 3 Sobel with replicated borders, L1 gradient
  magnitude, non-maximum suppression with OpenCV's fixed-point tan(22.5) sector test and its
  strict/non-strict comparisons, hysteresis over 8-connected weak edges);
* :func:`distance_transform`: ``cv2.distanceTransform(img, DIST_L2, 5)``, the 5 x 5 chamfer
  distance (Borgefors 1986) with OpenCV's weights 1, 1.4 and 2.1969 in 16-bit fixed point; each
  raster pass is vectorised along the row (the left-to-right recursion is a running minimum);
* :func:`box_blur`: ``cv2.blur(img, (3, 3))`` (reflect-101 borders; uint8 results rounded);
* :func:`equalize_hist`: ``cv2.equalizeHist``;
* :func:`filter2d_u8`: ``cv2.filter2D(img, CV_8U, kernel)`` for an integer kernel.
"""
from __future__ import annotations

import numpy as np
from scipy import ndimage

__all__ = ["canny", "distance_transform", "box_blur", "equalize_hist", "filter2d_u8"]

_TG22 = int(0.4142135623730950488016887242097 * (1 << 15) + 0.5)   # tan(22.5 deg) in Q15
_HV, _DIAG, _LONG = 65536, 91750, 143976                            # round(w * 2^16), w = 1, 1.4, 2.1969


def _correlate3(x: np.ndarray, kernel: np.ndarray, mode: str) -> np.ndarray:
    """3 x 3 correlation of every image of ``x`` (N, H, W)."""
    return ndimage.correlate(x, kernel[None], mode=mode)


def canny(image: np.ndarray, low: float, high: float) -> np.ndarray:
    """Edges (bool, N x H x W) of uint8 images (N, H, W) as ``cv2.Canny(image, low, high)``."""
    img = image.astype(np.int32)
    sobel_x = np.array([[-1, 0, 1], [-2, 0, 2], [-1, 0, 1]])
    dx = _correlate3(img, sobel_x, "nearest")
    dy = _correlate3(img, sobel_x.T, "nearest")
    mag = np.abs(dx) + np.abs(dy)
    low, high = int(np.floor(low)), int(np.floor(high))
    padded = np.pad(mag, ((0, 0), (1, 1), (1, 1)))   # zero magnitude outside the image

    def neighbour(dr, dc):
        h, w = mag.shape[1:]
        return padded[:, 1 + dr:1 + dr + h, 1 + dc:1 + dc + w]

    ax = np.abs(dx).astype(np.int64)
    ay = np.abs(dy).astype(np.int64) << 15
    tg22x = ax * _TG22
    tg67x = tg22x + (ax << 16)
    horizontal = ay < tg22x
    vertical = ~horizontal & (ay > tg67x)
    diagonal = ~horizontal & ~vertical
    s = np.where((dx ^ dy) < 0, -1, 1)
    keep = np.zeros(mag.shape, dtype=bool)
    keep |= horizontal & (mag > neighbour(0, -1)) & (mag >= neighbour(0, 1))
    keep |= vertical & (mag > neighbour(-1, 0)) & (mag >= neighbour(1, 0))
    # diagonal: previous row at column j - s, next row at column j + s
    prev_minus, prev_plus = neighbour(-1, -1), neighbour(-1, 1)
    next_minus, next_plus = neighbour(1, -1), neighbour(1, 1)
    prev_diag = np.where(s == 1, prev_minus, prev_plus)
    next_diag = np.where(s == 1, next_plus, next_minus)
    keep |= diagonal & (mag > prev_diag) & (mag > next_diag)
    candidate = keep & (mag > low)
    strong = candidate & (mag > high)
    structure = np.zeros((3, 3, 3), dtype=bool)
    structure[1] = True   # 8-connected within an image, never across images
    labels, count = ndimage.label(candidate, structure=structure)
    if count == 0:
        return np.zeros(mag.shape, dtype=bool)
    linked = np.zeros(count + 1, dtype=bool)
    linked[np.unique(labels[strong])] = True
    linked[0] = False
    return linked[labels]


def distance_transform(image: np.ndarray) -> np.ndarray:
    """``cv2.distanceTransform(image, DIST_L2, 5)`` of (N, H, W) images: float32 chamfer distance
    of every pixel to the nearest zero pixel (infinite in an image without one)."""
    n, h, w = image.shape
    inf = np.iinfo(np.int64).max // 4
    pad = 2
    d = np.full((n, h + 2 * pad, w + 2 * pad), inf, dtype=np.int64)
    d[:, pad:pad + h, pad:pad + w] = np.where(image == 0, 0, inf)
    cols = np.arange(w)
    forward = ((-2, -1, _LONG), (-2, 1, _LONG), (-1, -2, _LONG), (-1, -1, _DIAG), (-1, 0, _HV), (-1, 1, _DIAG),
               (-1, 2, _LONG))
    for r in range(pad, pad + h):
        row = d[:, r, pad:pad + w]
        for dr, dc, cost in forward:
            row = np.minimum(row, d[:, r + dr, pad + dc:pad + dc + w] + cost)
        # left neighbour of the same row: d[j] = min(v[j], d[j - 1] + a) = min_k (v[k] - a k) + a j
        row = np.minimum.accumulate(row - _HV * cols, axis=1) + _HV * cols
        d[:, r, pad:pad + w] = np.minimum(row, inf)
    backward = ((2, 1, _LONG), (2, -1, _LONG), (1, 2, _LONG), (1, 1, _DIAG), (1, 0, _HV), (1, -1, _DIAG),
                (1, -2, _LONG))
    rev = cols[::-1]
    for r in range(pad + h - 1, pad - 1, -1):
        row = d[:, r, pad:pad + w]
        for dr, dc, cost in backward:
            row = np.minimum(row, d[:, r + dr, pad + dc:pad + dc + w] + cost)
        row = (np.minimum.accumulate((row - _HV * rev)[:, ::-1], axis=1)[:, ::-1]) + _HV * rev
        d[:, r, pad:pad + w] = np.minimum(row, inf)
    out = d[:, pad:pad + h, pad:pad + w]
    return np.where(out >= inf, np.inf, out / 65536.0).astype(np.float32)


def box_blur(x: np.ndarray) -> np.ndarray:
    """``cv2.blur(x, (3, 3))`` of (N, H, W) images; uint8 in, uint8 out (rounded)."""
    total = ndimage.correlate(x.astype(np.float64), np.ones((1, 3, 3)), mode="mirror")
    if x.dtype == np.uint8:
        return np.clip(np.rint(total / 9.0), 0, 255).astype(np.uint8)
    return (total * (1.0 / 9.0)).astype(x.dtype)


def equalize_hist(image: np.ndarray) -> np.ndarray:
    """``cv2.equalizeHist`` of each uint8 image (N, H, W)."""
    out = np.empty_like(image)
    for k, img in enumerate(image):
        hist = np.bincount(img.ravel(), minlength=256)
        first = int(np.flatnonzero(hist)[0])
        total = img.size
        if hist[first] == total:
            out[k] = first
            continue
        scale = np.float32(255.0) / np.float32(total - hist[first])
        cumulative = np.cumsum(hist)
        lut = np.rint(np.float32(1) * (cumulative - hist[first]).astype(np.float32) * scale)
        lut = np.clip(lut, 0, 255).astype(np.uint8)
        lut[:first + 1] = 0
        out[k] = lut[img]
    return out


def filter2d_u8(image: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """``cv2.filter2D(image, CV_8U, kernel)`` for uint8 (N, H, W) and a small integer kernel:
    correlation, reflect-101 borders, saturated to [0, 255]."""
    total = ndimage.correlate(image.astype(np.int64), kernel[None].astype(np.int64), mode="mirror")
    return np.clip(total, 0, 255).astype(np.uint8)
