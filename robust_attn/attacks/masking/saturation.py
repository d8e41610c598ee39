"""Check ``loss_saturation``: a 1-D sweep of the loss along the gradient sign and along random sign
directions, on a few images; a flat or beaten gradient direction shows saturation (Athalye et al.
2018, 3.1). The plot of the sweep is :mod:`.plot`."""
from __future__ import annotations

import math
import numbers
from typing import Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn as nn

from robust_attn.attacks.masking.evidence import MaskingCheck, first_indices
from robust_attn.attacks.masking.gradients import loss_input_gradient, per_image_loss


def loss_along_directions(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, eps: float,
                          points: int = 21, random_directions: int = 4, seed: int = 0,
                          indices: Sequence[int] | None = None, batch_size: int = 64) -> pd.DataFrame:
    """The label's cross-entropy at ``clip_[0,1](x + t * d)`` for ``t`` in ``linspace(-eps, eps,
    points)`` (``points`` odd, so t = 0 is a point) along ``d = sign(grad_x CE)`` ("grad_sign") and
    ``random_directions`` random sign vectors ("random_0", ...; Rademacher, drawn from a generator
    seeded with ``seed``, so every direction has the same L-inf size 1 and ``t`` is an L-inf
    distance before clipping). The model sees at most ``batch_size`` images at a time. Returns a
    long frame: image, direction, t, loss (float64)."""
    if isinstance(points, bool) or not isinstance(points, numbers.Integral) or points < 3 or points % 2 == 0:
        raise ValueError(f"points must be an odd int >= 3 (so t = 0 is swept), got {points!r}")
    if not isinstance(eps, numbers.Real) or not 0 < eps <= 1:
        raise ValueError(f"eps must be in (0, 1] image units (e.g. 8/255), got {eps!r}")
    if isinstance(random_directions, bool) or not isinstance(random_directions, numbers.Integral) \
            or random_directions < 0:
        raise ValueError(f"random_directions must be an int >= 0, got {random_directions!r}")
    labels = labels.to(images.device, torch.long)
    grad = loss_input_gradient(model, images, labels, batch_size)
    gen = torch.Generator(device=images.device).manual_seed(int(seed))
    directions = {"grad_sign": grad.sign().nan_to_num(0.0)}
    for k in range(random_directions):
        directions[f"random_{k}"] = torch.randint(0, 2, images.shape, generator=gen, device=images.device,
                                                  dtype=images.dtype) * 2 - 1
    ts = torch.linspace(-eps, eps, points, dtype=torch.float64)
    ts[points // 2] = 0.0
    index = np.arange(len(images)) if indices is None else np.asarray(indices, dtype=int)
    if len(index) != len(images):
        raise ValueError(f"indices has {len(index)} entries for {len(images)} images")
    # every (direction, t, image) point, evaluated in batches
    names = list(directions)
    stacked = torch.stack([directions[n] for n in names])                        # D, N, C, H, W
    grid = [(d, j, i) for d in range(len(names)) for j in range(points) for i in range(len(images))]
    losses = np.empty(len(grid))
    with torch.no_grad():
        for start in range(0, len(grid), batch_size):
            part = grid[start:start + batch_size]
            d_idx = torch.tensor([g[0] for g in part])
            t = torch.tensor([float(ts[g[1]]) for g in part], dtype=images.dtype, device=images.device)
            i_idx = torch.tensor([g[2] for g in part])
            x = (images[i_idx] + t.view(-1, 1, 1, 1) * stacked[d_idx, i_idx]).clamp(0, 1)
            losses[start:start + len(part)] = per_image_loss(model, x, labels[i_idx]).cpu().numpy()
    return pd.DataFrame({"image": [int(index[g[2]]) for g in grid], "direction": [names[g[0]] for g in grid],
                         "t": [float(ts[g[1]]) for g in grid], "loss": losses})


def check_loss_saturation(frame: pd.DataFrame, rtol: float = 1e-6) -> MaskingCheck:
    """Flag saturation in a sweep of :func:`loss_along_directions`, per image:

    * ``flat``: along the gradient sign the loss never rises above its value at t = 0 by more
      than ``rtol * |L(0)|`` for t in (0, eps] (a zero or useless gradient, a loss stuck at 0 by
      a saturated softmax, a quantized input);
    * ``random_wins``: some random direction reaches a loss above the gradient sign's maximum
      (by more than ``rtol`` relative): the first-order direction is worse than chance, the
      gradient is not informative (Athalye et al. 2018, 3.1).

    Either on any image flags the check; the evidence lists counts, indices and each image's
    gains (max loss minus L(0)) along the gradient sign and the best random direction."""
    missing = {"image", "direction", "t", "loss"} - set(frame.columns)
    if missing:
        raise ValueError(f"frame lacks column(s) {', '.join(sorted(missing))}; pass loss_along_directions' output")
    grad = frame[frame["direction"] == "grad_sign"]
    if grad.empty or not (grad["t"] == 0).any():
        raise ValueError("frame has no grad_sign sweep through t = 0; pass loss_along_directions' output")
    rand = frame[frame["direction"] != "grad_sign"]
    flat, wins, per_image = [], [], {}
    for image, g in _by_image(grad):
        base = float(g.loc[g["t"] == 0, "loss"].iloc[0])
        up = float(g.loc[g["t"] > 0, "loss"].max()) - base
        best_grad = float(g["loss"].max())
        r = rand[rand["image"] == image]
        best_rand = float(r["loss"].max()) if len(r) else -math.inf
        per_image[int(image)] = {"loss0": base, "grad_gain": up,
                                 "random_gain": (best_rand - base) if len(r) else None}
        if not up > rtol * abs(base):
            flat.append(image)
        if best_rand > best_grad + rtol * abs(best_grad):
            wins.append(image)
    n = len(per_image)
    evidence = {"n_images": n, "flat": len(flat), "flat_indices": first_indices(flat), "random_wins": len(wins),
                "random_wins_indices": first_indices(wins), "per_image": per_image}
    if flat or wins:
        detail = (f"loss flat along the gradient sign on {len(flat)} of {n} image(s); a random direction beats "
                  f"the gradient sign on {len(wins)} of {n}")
        return MaskingCheck("loss_saturation", "flag", detail, evidence)
    gains = [v["grad_gain"] for v in per_image.values()]
    return MaskingCheck("loss_saturation", "pass",
                        f"the loss rises along the gradient sign on all {n} image(s) (smallest gain {min(gains):.3g}) "
                        f"and no random direction beats it", evidence)


def _by_image(frame: pd.DataFrame):
    """(image, its rows sorted by t), in image order."""
    for image, group in frame.groupby("image", sort=True):
        yield image, group.sort_values("t")
