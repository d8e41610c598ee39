"""Input resolutions the zoo is built for, and the shared width multiplier rule.

``imagenet``: 224x224 input and the papers' stems, which shrink the image 4x before the first
residual stage (ResNet: 7x7/2 conv + 3x3/2 max pool; SAN: two 2x2 max pools).

``cifar``: 32x32 input. The stem keeps full resolution (``stem_downsample=1``), so the residual
stages see 32/16/8/4 and the last stage still has a 4x4 map. A recipe can pass
``stem_downsample=2`` for a cheaper model whose last stage sees 2x2.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Resolution", "RESOLUTIONS", "resolve", "scaled_width"]


@dataclass(frozen=True)
class Resolution:
    image_size: int
    stem_downsample: int

    def __post_init__(self):
        if self.stem_downsample not in (1, 2, 4):
            raise ValueError(f"stem_downsample must be 1, 2 or 4, got {self.stem_downsample}")
        if self.image_size % (self.stem_downsample * 8):
            raise ValueError(f"image_size {self.image_size} must be divisible by "
                             f"{self.stem_downsample * 8} (stem downsampling x three stride-2 stages)")


RESOLUTIONS = {"imagenet": Resolution(224, 4), "cifar": Resolution(32, 1)}


def resolve(resolution: str, image_size: int | None = None, stem_downsample: int | None = None) -> Resolution:
    """The named resolution with optional overrides of its image size and stem downsampling."""
    base = RESOLUTIONS[resolution]
    return Resolution(image_size or base.image_size, stem_downsample or base.stem_downsample)


def scaled_width(channels: int, width: float, divisor: int = 16) -> int:
    """``channels * width`` rounded to a multiple of ``divisor`` (at least ``divisor``).

    The divisor 16 keeps every family's head and reduction arithmetic exact
    (SAN's C/16 and C/8, eight attention heads).
    """
    if width <= 0:
        raise ValueError(f"width multiplier must be positive, got {width}")
    return max(divisor, int(round(channels * width / divisor)) * divisor)
