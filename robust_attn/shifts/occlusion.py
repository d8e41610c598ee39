"""Occlusion (Naseer et al., "Intriguing Properties of Vision Transformers", NeurIPS 2021,
section 3.1): hide part of every test image and see what accuracy survives.

* :func:`occlude_square`: one square covering ``k`` percent of the image (side
  ``round(sqrt(k / 100 * H * W))``, so the covered fraction is k up to that rounding), at a
  uniformly random position fully inside the image;
* :func:`drop_patches`: Naseer et al.'s "PatchDrop": the image cut into a ``g x g`` grid of
  equal cells and ``round(f / 100 * g^2)`` cells, drawn without replacement, blanked.

Both fill with zeros (black, as Naseer et al.) or with a given colour (``fill``: a per-channel
value in [0, 1]; the protocol passes the dataset's mean, the colour the model's normalisation
maps to 0). Positions and cells come from each image's own generator
(:func:`robust_attn.shifts.seeds.image_rngs`), so every model sees the same occluded images.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from robust_attn.shifts.seeds import image_rngs

__all__ = ["square_side", "occlude_square", "drop_patches", "check_area", "check_grid", "fill_value"]


def check_area(percent: float, what: str = "occluded area") -> float:
    if not 0 < float(percent) <= 100:
        raise ValueError(f"{what} must be a percentage in (0, 100], got {percent:g}")
    return float(percent)


def check_grid(grid: int, height: int | None = None, width: int | None = None) -> int:
    """``grid`` if it is a positive whole number and (given the image size) cuts an ``height``
    x ``width`` image into equal cells, else ValueError."""
    if isinstance(grid, bool) or int(grid) != grid or grid < 1:
        raise ValueError(f"a grid must be a positive whole number of cells per side, got {grid!r}")
    grid = int(grid)
    if height is None or width is None:
        return grid
    if height % grid or width % grid:
        divisors = [g for g in range(1, min(height, width) + 1) if height % g == 0 and width % g == 0]
        raise ValueError(f"a {grid}x{grid} grid does not divide the {height}x{width} image into equal cells; "
                         f"use one of {divisors}")
    return grid


def square_side(percent: float, height: int, width: int) -> int:
    """Side of the square covering ``percent`` of an ``height`` x ``width`` image (at least 1)."""
    check_area(percent)
    side = max(1, round(math.sqrt(percent / 100 * height * width)))
    if side > min(height, width):
        raise ValueError(f"a square covering {percent:g}% of a {height}x{width} image does not fit in it")
    return side


def fill_value(fill: str | Sequence[float], channels: int, like: torch.Tensor) -> torch.Tensor:
    """``"zeros"`` or a per-channel colour, as a (1, C, 1, 1) tensor."""
    if isinstance(fill, str):
        if fill != "zeros":
            raise ValueError(f"fill must be 'zeros' or a per-channel colour, got {fill!r}")
        return like.new_zeros(1, channels, 1, 1)
    value = torch.as_tensor(list(fill), dtype=like.dtype, device=like.device)
    if value.numel() != channels:
        raise ValueError(f"the fill colour has {value.numel()} values for {channels} channels")
    return value.view(1, channels, 1, 1)


def occlude_square(images: torch.Tensor, percent: float, indices: Sequence[int], seed: int = 0,
                   fill="zeros") -> torch.Tensor:
    """(N, C, H, W) images with one random square covering ``percent`` of each filled."""
    n, c, h, w = images.shape
    side = square_side(percent, h, w)
    out = images.clone()
    colour = fill_value(fill, c, images)[0]
    for k, rng in enumerate(image_rngs(f"occlusion{percent:g}", indices, seed)):
        top, left = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        out[k, :, top:top + side, left:left + side] = colour
    return out


def drop_patches(images: torch.Tensor, grid: int, percent: float, indices: Sequence[int], seed: int = 0,
                 fill="zeros") -> torch.Tensor:
    """(N, C, H, W) images with ``round(percent / 100 * grid^2)`` random cells of a ``grid x
    grid`` grid filled."""
    n, c, h, w = images.shape
    grid = check_grid(grid, h, w)
    check_area(percent, "dropped fraction")
    count = round(percent / 100 * grid * grid)
    ph, pw = h // grid, w // grid
    colour = fill_value(fill, c, images)[0]
    out = images.clone()
    for k, rng in enumerate(image_rngs(f"patchdrop{grid}", indices, seed)):
        for cell in rng.permutation(grid * grid)[:count]:
            row, col = divmod(int(cell), grid)
            out[k, :, row * ph:(row + 1) * ph, col * pw:(col + 1) * pw] = colour
    return out
