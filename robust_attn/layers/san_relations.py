"""SAN's relation functions delta (section 3.1, Table 4) and the position encoding's coordinate
grid, shared by the reference and the lean pairwise/patchwise paths."""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["position_grid", "pair_relation", "positions"]


def position_grid(height: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """``(1, 2, H, W)``: x then y coordinate, each ``linspace(-1, 1)`` (section 3.1)."""
    ys = torch.linspace(-1, 1, height, device=like.device, dtype=like.dtype)
    xs = torch.linspace(-1, 1, width, device=like.device, dtype=like.dtype)
    return torch.stack([xs.expand(height, width), ys[:, None].expand(height, width)])[None]


def pair_relation(relation: str, center: torch.Tensor, neighbour: torch.Tensor) -> torch.Tensor:
    """delta(x_i, x_j) of section 3.1 on ``center (N, c, 1, ...)`` and ``neighbour (N, c, K, ...)``."""
    if relation == "summation":
        return center + neighbour
    if relation == "subtraction":
        return center - neighbour
    if relation == "hadamard":
        return center * neighbour
    if relation == "dot":
        return (center * neighbour).sum(1, keepdim=True)
    return torch.cat([center.expand_as(neighbour), neighbour], 1)  # concatenation


def positions(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m.pos(position_grid(x.shape[2], x.shape[3], x))
