"""Spatter, one of the four extra corruptions of Hendrycks & Dietterich (2019, appendix), as in
ImageNet-C / ``imagecorruptions``: a smoothed Gaussian "liquid" field, thresholded, becomes

* severities 1-3, water: pale turquoise (175, 238, 238) drops whose brightness follows the
  distance to the drop edges (Canny edges, chamfer distance truncated at 20, blurred, histogram
  equalised, embossed with ``[[-2, -1, 0], [-1, 1, 1], [0, 1, 2]]``, blurred), added to the image
  with weight 0.6, 0.6, 0.5 after normalising by the layer's maximum;
* severities 4-5, mud: brown (63, 42, 20) blotches (mask blurred with sigma 1.5, kept where it
  is at least 0.8) replacing the image where they lie.

Parameters per severity: (mean, std, smoothing sigma, threshold, intensity, mud?). The OpenCV
steps are :mod:`.cv`. Deviation: when an image draws no water at all (likely on small images),
the reference divides 0 by 0 and returns a black image; we return the image unchanged.
"""
from __future__ import annotations

import numpy as np

from robust_attn.shifts.corruptions import register
from robust_attn.shifts.corruptions.cv import box_blur, canny, distance_transform, equalize_hist, filter2d_u8
from robust_attn.shifts.corruptions.ops import draw, gaussian

SPATTER = ((0.65, 0.3, 4, 0.69, 0.6, 0), (0.65, 0.3, 3, 0.68, 0.6, 0), (0.65, 0.3, 2, 0.68, 0.5, 0),
           (0.65, 0.3, 1, 0.65, 1.5, 1), (0.67, 0.4, 1, 0.65, 1.5, 1))
WATER = np.array([175, 238, 238]) / 255.0
MUD = np.array([63, 42, 20]) / 255.0
EMBOSS = np.array([[-2, -1, 0], [-1, 1, 1], [0, 1, 2]])


def water_layer(liquid: np.ndarray) -> np.ndarray:
    """The water brightness (N, H, W), before normalisation, of thresholded liquid fields."""
    liquid = (liquid * 255).astype(np.uint8)
    edges = canny(liquid, 50, 150)
    dist = np.minimum(distance_transform(np.where(edges, 0, 255).astype(np.uint8)), np.float32(20))
    dist = box_blur(dist).astype(np.uint8)
    dist = box_blur(filter2d_u8(equalize_hist(dist), EMBOSS)).astype(np.float32)
    return liquid * dist


@register("spatter")
def spatter(x, severity, rngs):
    loc, scale, sigma, threshold, intensity, mud = SPATTER[severity - 1]
    x = x.astype(np.float32)
    liquid = gaussian(draw(rngs, "normal", loc, scale, size=x.shape[1:3]), sigma)
    liquid[liquid < threshold] = 0
    if not mud:
        layer = water_layer(liquid)
        peak = layer.max(axis=(1, 2), keepdims=True)
        layer = np.divide(layer, peak, out=np.zeros_like(layer), where=peak > 0) * intensity
        return x + layer[..., None] * WATER
    mask = gaussian(np.where(liquid > threshold, 1, 0).astype(np.float32), intensity)
    mask[mask < 0.8] = 0
    return x * (1 - mask[..., None]) + MUD * mask[..., None]
