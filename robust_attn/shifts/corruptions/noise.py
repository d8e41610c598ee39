"""Noise corruptions (Hendrycks & Dietterich 2019, section 3, "noise"; speckle is one of the four
extra corruptions of their appendix). Parameters per severity 1-5 as in ImageNet-C:

* Gaussian: ``x + N(0, c^2)``, c = 0.08 ... 0.38;
* shot (Poisson): ``Poisson(c x) / c``, c = 60 ... 3 photons per unit intensity;
* impulse (salt and pepper, scikit-image's ``random_noise(mode="s&p")``): each channel value is
  hit with probability c = 0.03 ... 0.27, and a hit is 1 or 0 with equal probability;
* speckle: ``x + x N(0, c^2)``, c = 0.15 ... 0.6.
"""
from __future__ import annotations

import numpy as np

from robust_attn.shifts.corruptions import register
from robust_attn.shifts.corruptions.ops import draw

GAUSSIAN = (0.08, 0.12, 0.18, 0.26, 0.38)
SHOT = (60, 25, 12, 5, 3)
IMPULSE = (0.03, 0.06, 0.09, 0.17, 0.27)
SPECKLE = (0.15, 0.2, 0.35, 0.45, 0.6)


@register("gaussian_noise")
def gaussian_noise(x, severity, rngs):
    return x + draw(rngs, "normal", 0.0, GAUSSIAN[severity - 1], size=x.shape[1:])


@register("shot_noise")
def shot_noise(x, severity, rngs):
    c = SHOT[severity - 1]
    return np.stack([rng.poisson(image * c) for rng, image in zip(rngs, x)]) / float(c)


@register("impulse_noise")
def impulse_noise(x, severity, rngs):
    """Two uniform fields per image in scikit-image's order: which values are hit, then which
    hits are salt (1) rather than pepper (0)."""
    hit = draw(rngs, "random", size=x.shape[1:]) <= IMPULSE[severity - 1]
    salt = draw(rngs, "random", size=x.shape[1:]) <= 0.5
    out = x.copy()
    out[hit & salt] = 1.0
    out[hit & ~salt] = 0.0
    return out


@register("speckle_noise")
def speckle_noise(x, severity, rngs):
    return x + x * draw(rngs, "normal", 0.0, SPECKLE[severity - 1], size=x.shape[1:])
