"""Bootstrap confidence intervals over images for the headline numbers.

Every headline number of Tables 9 and 10 is a mean over images of a per-image value (a 0/1 hit,
or for a drop the paired difference of two hits on the same image), so one percentile bootstrap
of a mean covers them all. Resampling is over images with replacement, seeded, so a report is
reproducible. Paired differences keep the correlation between conditions on the same image,
which makes the interval of a drop much narrower than the two accuracies' intervals suggest.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Interval", "bootstrap_mean_ci"]


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float
    level: float
    n_boot: int

    def __str__(self) -> str:
        return f"{self.value:.1f} [{self.low:.1f}, {self.high:.1f}]"


def bootstrap_mean_ci(values, n_boot: int = 1000, seed: int = 0, level: float = 0.95,
                      scale: float = 100.0, chunk: int = 64) -> Interval:
    """Percentile bootstrap interval of ``scale * mean(values)`` resampling the images.

    ``values``: one number per image (e.g. top-1 hits, or baseline hit minus rotated hit).
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        raise ValueError("cannot bootstrap an empty set of images")
    if not 0 < level < 1:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be positive, got {n_boot}")
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    for start in range(0, n_boot, chunk):  # bounded memory for large image counts
        stop = min(start + chunk, n_boot)
        idx = rng.integers(0, x.size, size=(stop - start, x.size))
        means[start:stop] = x[idx].mean(axis=1)
    alpha = (1 - level) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return Interval(scale * x.mean(), scale * low, scale * high, level, n_boot)
