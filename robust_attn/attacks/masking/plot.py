"""The plot of a loss sweep (:func:`~robust_attn.attacks.masking.saturation.loss_along_directions`)."""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import pandas as pd


def plot_loss_along_directions(frame: pd.DataFrame, path: str | Path, title: str = "") -> Path | None:
    """One panel per image: loss against t along the gradient sign (bold) and the random
    directions (thin). Returns the PNG path, or None (with a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: the loss-along-directions plot is skipped "
                      "(pip install matplotlib)", stacklevel=2)
        return None
    images = sorted(frame["image"].unique())
    if not images:
        raise ValueError("frame is empty; pass loss_along_directions' output")
    cols = min(4, len(images))
    rows = math.ceil(len(images) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax, image in zip(axes.flat, images):
        sub = frame[frame["image"] == image]
        for direction, g in sub.groupby("direction", sort=True):
            g = g.sort_values("t")
            grad = direction == "grad_sign"
            ax.plot(g["t"] * 255, g["loss"], color="C3" if grad else "0.6", lw=2 if grad else 0.8,
                    label="gradient sign" if grad else ("random sign" if direction == "random_0" else None))
        ax.set_title(f"image {image}", fontsize=8)
        ax.set_xlabel("t (L-inf, 1/255)", fontsize=7)
        ax.set_ylabel("cross-entropy", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(images):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.suptitle(title or "loss along the gradient sign and random directions", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
