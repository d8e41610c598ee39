"""Blur corruptions (Hendrycks & Dietterich 2019, section 3, "blur"; Gaussian blur is one of the
four extra ones). Parameters per severity 1-5 as in ImageNet-C / ``imagecorruptions``:

* defocus: convolution with an anti-aliased disk of radius 3 ... 10 pixels;
* glass: Gaussian blur, then each pixel (scanned bottom-right to top-left, ``iterations``
  times) replaced by a random neighbour at most ``delta`` away, then blurred again. The
  reference's "swap" ``x[h, w], x[h', w'] = x[h', w'], x[h, w]`` on NumPy views copies the
  neighbour into ``x[h, w]`` and leaves the neighbour unchanged; that is what the published
  datasets contain, and what we do;
* motion: the reference's line blur (:func:`robust_attn.shifts.corruptions.ops.motion_blur`)
  at a uniform random angle in [-45, 45] degrees;
* zoom: the mean of the image and its centre zooms by factors 1 ... 1.11 up to 1 ... 1.31;
* Gaussian: ``sigma`` = 1, 2, 3, 4, 6 pixels.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from robust_attn.shifts.corruptions import register
from robust_attn.shifts.corruptions.ops import clipped_zoom, draw, gaussian, motion_blur

DEFOCUS = ((3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5))          # disk radius, anti-alias sigma
GLASS = ((0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2))   # sigma, max delta, iterations
MOTION = ((10, 3), (15, 5), (15, 8), (15, 12), (20, 15))                # radius, sigma
ZOOM = (np.arange(1, 1.11, 0.01), np.arange(1, 1.16, 0.01), np.arange(1, 1.21, 0.02),
        np.arange(1, 1.26, 0.02), np.arange(1, 1.31, 0.03))
GAUSSIAN_BLUR = (1, 2, 3, 4, 6)


def _gaussian_kernel_1d(size: int, sigma: float) -> np.ndarray:
    """OpenCV's ``getGaussianKernel`` for sigma > 0: normalised samples at ``i - (size - 1) / 2``."""
    t = np.arange(size) - (size - 1) / 2
    k = np.exp(-t ** 2 / (2 * sigma ** 2))
    return k / k.sum()


def disk_kernel(radius: int, alias_blur: float) -> np.ndarray:
    """The reference's anti-aliased disk: the 0/1 disk ``x^2 + y^2 <= r^2`` on a 17 x 17 grid
    (radius up to 8, else 2r + 1), normalised, then Gaussian-blurred (3 x 3, or 5 x 5 beyond
    radius 8; borders reflected without repeating the edge, as OpenCV's default), float32."""
    half = 8 if radius <= 8 else radius
    ksize = 3 if radius <= 8 else 5
    grid = np.arange(-half, half + 1)
    yy, xx = np.meshgrid(grid, grid)
    disk = ((xx ** 2 + yy ** 2) <= radius ** 2).astype(np.float32)
    disk /= disk.sum()
    g = _gaussian_kernel_1d(ksize, alias_blur)
    padded = np.pad(disk.astype(np.float64), ksize // 2, mode="reflect")
    rows = sum(g[i] * padded[i:i + disk.shape[0], :] for i in range(ksize))
    out = sum(g[j] * rows[:, j:j + disk.shape[1]] for j in range(ksize))
    return out.astype(np.float32)


def filter2d(x: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """Correlate every channel of ``x`` (N, H, W, C) with ``kernel`` (odd, centred), borders
    reflected without repeating the edge (OpenCV's ``BORDER_REFLECT_101``), in float32 (a
    float64 convolution is several times slower and changes nothing after rounding to uint8
    but rare one-level ties)."""
    n, h, w, c = x.shape
    kh, kw = kernel.shape
    padded = np.pad(x, ((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)), mode="reflect")
    planes = torch.from_numpy(np.ascontiguousarray(padded.transpose(0, 3, 1, 2), dtype=np.float32))
    out = F.conv2d(planes.reshape(n * c, 1, *padded.shape[1:3]), torch.from_numpy(kernel.astype(np.float32))[None, None])
    return out.reshape(n, c, h, w).permute(0, 2, 3, 1).numpy()


@register("defocus_blur")
def defocus_blur(x, severity, rngs):
    return filter2d(x, disk_kernel(*DEFOCUS[severity - 1]))


@register("glass_blur")
def glass_blur(x, severity, rngs):
    sigma, delta, iterations = GLASS[severity - 1]
    n, h, w, c = x.shape
    blurred = (gaussian(x, sigma) * 255).astype(np.uint8).reshape(n, h * w, c)
    rows, cols = np.arange(h - delta, delta, -1), np.arange(w - delta, delta, -1)
    if len(rows) and len(cols):
        # per image, in scan order: (iteration, row, column, [dx, dy]) with dx, dy in [-delta, delta)
        moves = draw(rngs, "integers", -delta, delta, size=(iterations, len(rows), len(cols), 2))
        targets = (rows[:, None] * w + cols[None, :]).ravel()
        sources = targets[None, None, :] + (moves[..., 1] * w + moves[..., 0]).reshape(n, iterations, -1)
        batch = np.arange(n)
        for it in range(iterations):
            for k, target in enumerate(targets):
                blurred[batch, target] = blurred[batch, sources[:, it, k]]
    return gaussian(blurred.reshape(n, h, w, c) / 255.0, sigma)


@register("motion_blur")
def motion_blur_(x, severity, rngs):
    radius, sigma = MOTION[severity - 1]
    return motion_blur(x, radius, sigma, draw(rngs, "uniform", -45, 45))


@register("zoom_blur")
def zoom_blur(x, severity, rngs):
    factors = ZOOM[severity - 1]
    x = x.astype(np.float32)
    out = np.zeros_like(x)
    for factor in factors:
        out += clipped_zoom(x, factor, crop_to_input=True)
    return (x + out) / (len(factors) + 1)


@register("gaussian_blur")
def gaussian_blur(x, severity, rngs):
    return gaussian(x, GAUSSIAN_BLUR[severity - 1])
