"""Array operations the corruptions share, batched over a leading image axis.

Every function takes float arrays ``(N, H, W)`` or ``(N, H, W, C)`` (values in [0, 1] unless
said otherwise) and reproduces the operation Hendrycks & Dietterich's code (as packaged in
``imagecorruptions``) calls from scikit-image, SciPy or OpenCV, with the same border rules:

* :func:`gaussian`: ``skimage.filters.gaussian`` (``scipy.ndimage.gaussian_filter``, mode
  ``nearest`` by default, truncated at 4 sigma), spatial axes only;
* :func:`clipped_zoom`: the reference ``clipped_zoom`` (centre crop of ``ceil(H / z)`` rows, then
  ``scipy.ndimage.zoom(order=1)``), written as two small interpolation matrices, so a batch zooms
  with two matrix products instead of one spline evaluation per pixel;
* :func:`motion_blur`: the reference ``_motion_blur`` (a one-sided Gaussian kernel along a line
  at ``angle``, edge pixels replicated, and the reference's early stop once a shift leaves the
  image), with one angle per image;
* :func:`rgb_to_hsv` / :func:`hsv_to_rgb`: ``skimage.color.rgb2hsv`` / ``hsv2rgb``;
* :func:`reflect_index`: the half-sample symmetric boundary of ``scipy.ndimage`` mode
  ``reflect``.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

import numpy as np
from scipy import ndimage

__all__ = ["draw", "gaussian", "clipped_zoom", "zoom_matrix", "motion_blur", "rgb_to_hsv", "hsv_to_rgb",
           "reflect_index", "rgb_to_gray"]


def draw(rngs: Sequence[np.random.Generator], method: str, *args, size=None) -> np.ndarray:
    """One draw of ``method`` (``normal``, ``uniform``, ``integers``, ``random``, ...) per image's
    generator, stacked: the images of a batch never share random numbers, so an image gets the
    same corruption in any batch."""
    return np.stack([np.asarray(getattr(rng, method)(*args, size=size)) for rng in rngs])


def gaussian(x: np.ndarray, sigma, mode: str = "nearest", truncate: float = 4.0) -> np.ndarray:
    """Gaussian filter over the two spatial axes (1 and 2) of a batch; ``sigma`` a number or
    a (row, column) pair."""
    s = (sigma, sigma) if np.isscalar(sigma) else tuple(sigma)
    sigmas = (0.0, *s) + (0.0,) * (x.ndim - 3)
    return ndimage.gaussian_filter(x, sigmas, mode=mode, truncate=truncate)


@lru_cache(maxsize=512)
def zoom_matrix(size: int, factor: float, keep: int | None = None) -> np.ndarray:
    """``(out, size)`` matrix of ``scipy.ndimage.zoom(order=1)`` along one axis of length
    ``size``: output sample ``o`` of ``round(size * factor)`` sits at input coordinate
    ``o * (size - 1) / (out - 1)``, linearly interpolated. ``keep``: only the first rows."""
    out = int(round(size * factor))
    rows = out if keep is None else min(keep, out)
    matrix = np.zeros((rows, size))
    if size == 1 or out == 1:
        matrix[:, 0] = 1.0
        return matrix
    coord = np.arange(rows) * ((size - 1) / (out - 1))
    low = np.minimum(np.floor(coord).astype(int), size - 2)
    t = coord - low
    matrix[np.arange(rows), low] = 1.0 - t
    matrix[np.arange(rows), low + 1] += t
    return matrix


def clipped_zoom(x: np.ndarray, factor: float, crop_to_input: bool = False) -> np.ndarray:
    """Zoom into the centre of every image of ``x`` (N, H, W[, C]) by ``factor``: crop
    ``ceil(H / factor)`` x ``ceil(W / factor)`` about the centre, scale back up bilinearly. The
    result has ``round(ceil(H / factor) * factor)`` rows (at least H), as in the reference;
    ``crop_to_input`` keeps the first H rows and W columns, as ``zoom_blur`` does."""
    h, w = x.shape[1:3]
    ch, cw = int(np.ceil(h / float(factor))), int(np.ceil(w / float(factor)))
    top, left = (h - ch) // 2, (w - cw) // 2
    crop = x[:, top:top + ch, left:left + cw]
    rows = zoom_matrix(ch, float(factor), h if crop_to_input else None)
    cols = zoom_matrix(cw, float(factor), w if crop_to_input else None)
    if x.ndim == 3:
        return np.einsum("ij,njk,lk->nil", rows, crop, cols, optimize=True).astype(x.dtype, copy=False)
    return np.einsum("ij,njkc,lk->nilc", rows, crop, cols, optimize=True).astype(x.dtype, copy=False)


def motion_blur(x: np.ndarray, radius: int, sigma: float, angles: np.ndarray) -> np.ndarray:
    """The reference motion blur of every image of ``x`` (N, H, W[, C]) along its angle
    (degrees): the sum over ``i < 2 * radius + 1`` of ``k[i]`` times the image shifted by ``i``
    pixels along the line (rounded as the reference does, edge rows and columns replicated),
    ``k`` the normalised Gaussian ``exp(-i^2 / (2 sigma^2))``. As in the reference, the sum stops
    at the first shift of H rows or W columns or more, so on small images with a long kernel the
    weights do not add up to 1 (the image darkens); that is kept, for fidelity."""
    n, h, w = x.shape[:3]
    width = 2 * radius + 1
    kernel = np.exp(-np.arange(width) ** 2 / (2 * sigma ** 2)) / (math.sqrt(2 * math.pi) * sigma)
    kernel = kernel / kernel.sum()
    rad = np.deg2rad(np.asarray(angles, dtype=float))
    point_y, point_x = width * np.sin(rad), width * np.cos(rad)
    hypot = np.hypot(point_y, point_x)
    out = np.zeros(x.shape, dtype=np.float64)
    alive = np.ones(n, dtype=bool)
    batch = np.arange(n)[:, None, None]
    for i in range(width):
        dy = -np.ceil(i * point_y / hypot - 0.5).astype(int)
        dx = -np.ceil(i * point_x / hypot - 0.5).astype(int)
        alive &= (np.abs(dy) < h) & (np.abs(dx) < w)
        if not alive.any():
            break
        rows = np.clip(np.arange(h)[None, :] - dy[:, None], 0, h - 1)
        cols = np.clip(np.arange(w)[None, :] - dx[:, None], 0, w - 1)
        shifted = x[batch, rows[:, :, None], cols[:, None, :]]
        weight = kernel[i] * alive
        out += weight.reshape((n,) + (1,) * (x.ndim - 1)) * shifted
    return out


def rgb_to_gray(x: np.ndarray) -> np.ndarray:
    """OpenCV's RGB2GRAY weights (0.299, 0.587, 0.114) over the last axis."""
    return x[..., 0] * 0.299 + x[..., 1] * 0.587 + x[..., 2] * 0.114


def rgb_to_hsv(rgb: np.ndarray) -> np.ndarray:
    """``skimage.color.rgb2hsv`` over the last axis (hue in [0, 1); gray pixels get hue and
    saturation 0)."""
    value = rgb.max(-1)
    delta = np.ptp(rgb, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        sat = np.where(delta == 0, 0.0, delta / value)
        hue = np.zeros_like(value)
        r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
        # later assignments win where two channels share the maximum, as in scikit-image
        hue = np.where(r == value, (g - b) / delta, hue)
        hue = np.where(g == value, 2.0 + (b - r) / delta, hue)
        hue = np.where(b == value, 4.0 + (r - g) / delta, hue)
    hue = np.where(delta == 0, 0.0, (hue / 6.0) % 1.0)
    out = np.stack([hue, sat, value], axis=-1)
    out[np.isnan(out)] = 0
    return out


def hsv_to_rgb(hsv: np.ndarray) -> np.ndarray:
    """``skimage.color.hsv2rgb`` over the last axis."""
    h, s, v = hsv[..., 0], hsv[..., 1], hsv[..., 2]
    sector = np.floor(h * 6)
    f = h * 6 - sector
    p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
    sector = sector.astype(np.uint8) % 6
    choices = np.stack([np.stack(c, axis=-1) for c in
                        ((v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q))])
    index = np.broadcast_to(sector[..., None], hsv.shape)
    return np.take_along_axis(choices, index[None].astype(np.intp), axis=0)[0]


def reflect_index(index: np.ndarray, size: int) -> np.ndarray:
    """Indices folded into ``[0, size)`` by half-sample symmetric reflection
    (``... 1 0 | 0 1 ... size-1 | size-1 ...``), SciPy's ``reflect`` mode."""
    period = np.mod(index, 2 * size)
    return np.where(period >= size, 2 * size - 1 - period, period)
