"""Patch shuffling (Naseer et al., "Intriguing Properties of Vision Transformers", NeurIPS 2021,
section 3.3): cut every image into a ``g x g`` grid of equal patches and put them back in a
random order. A model that sees the image as a set of patches (self-attention without position
information) is unaffected; one that relies on spatial structure is not. ``g = 1`` is the
identity (one patch). Each image's permutation comes from its own generator
(:func:`robust_attn.shifts.seeds.image_rngs`, with the grid in the name), so every model sees
the same shuffled images.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from robust_attn.shifts.occlusion import check_grid
from robust_attn.shifts.seeds import image_rngs

__all__ = ["to_patches", "from_patches", "shuffle_patches", "patch_permutations"]


def to_patches(images: torch.Tensor, grid: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, g*g, C, H/g, W/g), patches in row-major order."""
    n, c, h, w = images.shape
    grid = check_grid(grid, h, w)
    ph, pw = h // grid, w // grid
    return images.reshape(n, c, grid, ph, grid, pw).permute(0, 2, 4, 1, 3, 5).reshape(n, grid * grid, c, ph, pw)


def from_patches(patches: torch.Tensor, grid: int) -> torch.Tensor:
    """The inverse of :func:`to_patches`."""
    n, _, c, ph, pw = patches.shape
    return patches.reshape(n, grid, grid, c, ph, pw).permute(0, 3, 1, 4, 2, 5).reshape(n, c, grid * ph, grid * pw)


def patch_permutations(grid: int, indices: Sequence[int], seed: int = 0) -> torch.Tensor:
    """(N, g*g): output patch ``j`` of image ``k`` is input patch ``perm[k, j]``."""
    perms = [rng.permutation(grid * grid) for rng in image_rngs(f"shuffle{grid}", indices, seed)]
    return torch.as_tensor(np.array(perms, dtype=np.int64).reshape(len(perms), grid * grid))


def shuffle_patches(images: torch.Tensor, grid: int, indices: Sequence[int], seed: int = 0) -> torch.Tensor:
    """(N, C, H, W) images with their ``grid x grid`` patches permuted, one permutation per image."""
    patches = to_patches(images, grid)
    perm = patch_permutations(grid, indices, seed).to(images.device)
    shuffled = patches[torch.arange(len(images), device=images.device)[:, None], perm]
    return from_patches(shuffled, grid)
