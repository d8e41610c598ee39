"""Check ``input_gradients``: the fraction of input-gradient entries that are exactly zero or
non-finite and the per-image gradient norms, against a ResNet baseline (Athalye et al. 2018,
3.1-3.2). The loss is the label's cross-entropy in float64 (the package docstring says why)."""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from robust_attn.attacks.masking.evidence import MaskingCheck, first_indices

QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


def per_image_loss(model: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the label per image, in float64 (module docstring)."""
    return F.cross_entropy(model(x).double(), labels, reduction="none")


def loss_input_gradient(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                    batch_size: int | None = None) -> torch.Tensor:
    """d CE(x_i, y_i) / d x_i for every image (the gradient of the summed loss: images are
    independent), computed on at most ``batch_size`` images at a time (None: all at once)."""
    from robust_attn.attacks.inputs import frozen_parameters, validate_attack_inputs

    labels = labels.to(images.device, torch.long)
    if batch_size is not None and len(images) > batch_size:
        if batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        return torch.cat([loss_input_gradient(model, images[a:a + batch_size], labels[a:a + batch_size])
                          for a in range(0, len(images), batch_size)])
    validate_attack_inputs(model, images, labels)
    x = images.detach().clone().requires_grad_(True)
    with torch.enable_grad(), frozen_parameters(model):
        loss = per_image_loss(model, x, labels).sum()
        if not loss.requires_grad:
            return torch.zeros_like(images)   # the loss does not depend on the input through autograd
        (grad,) = torch.autograd.grad(loss, x, allow_unused=True)
    return torch.zeros_like(images) if grad is None else grad.detach()


def input_gradient_stats(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                         batch_size: int | None = None) -> dict:
    """Input gradients of the label's cross-entropy: ``zero_fraction`` and ``nonfinite_fraction``
    (over all gradient entries), ``zero_images`` (images whose whole gradient is 0, with
    ``zero_indices``), and the quantiles :data:`QUANTILES` of the per-image L1 and L2 norms over
    the images with a finite gradient (``l1_quantiles``/``l2_quantiles``: q -> value). The model
    sees at most ``batch_size`` images at a time (None: all at once)."""
    grad = loss_input_gradient(model, images, labels, batch_size).flatten(1).double()
    finite = torch.isfinite(grad)
    zero_image = (grad == 0).all(1)
    ok = finite.all(1)
    norms = {}
    for p, key in ((1, "l1"), (2, "l2")):
        values = grad[ok].norm(p=p, dim=1).cpu().numpy()
        norms[f"{key}_quantiles"] = {str(q): (float(np.quantile(values, q)) if len(values) else float("nan"))
                                     for q in QUANTILES}
    return {"n_images": len(images), "n_values": grad.numel(),
            "zero_fraction": float((grad == 0).double().mean()),
            "nonfinite_fraction": float((~finite).double().mean()),
            "zero_images": int(zero_image.sum()), "zero_indices": first_indices(torch.nonzero(zero_image).flatten().tolist()),
            "nonfinite_images": int((~ok).sum()), **norms}


def check_input_gradients(stats: Mapping, baseline_stats: Mapping | None = None, max_zero_fraction: float = 0.5,
                          min_norm_ratio: float = 1e-3) -> MaskingCheck:
    """Flag when more than ``max_zero_fraction`` of the gradient entries are exactly 0, when
    any image's gradient is all zero or any entry is non-finite (shattered or masked gradients,
    Athalye et al. 2018, 3.1-3.2), or when the median per-image L2 norm is below
    ``min_norm_ratio`` times the baseline's (a ResNet's, from :func:`input_gradient_stats`):
    vanishing gradients, e.g. from a saturated softmax."""
    reasons = []
    if stats["zero_fraction"] > max_zero_fraction:
        reasons.append(f"{stats['zero_fraction']:.1%} of gradient entries are exactly 0")
    if stats["zero_images"]:
        reasons.append(f"{stats['zero_images']} of {stats['n_images']} image(s) have an all-zero gradient")
    if stats["nonfinite_fraction"] > 0:
        reasons.append(f"{stats['nonfinite_fraction']:.1%} of gradient entries are NaN or inf")
    median = stats["l2_quantiles"]["0.5"]
    evidence = {k: stats[k] for k in ("n_images", "zero_fraction", "nonfinite_fraction", "zero_images",
                                      "zero_indices", "nonfinite_images")}
    evidence["median_l2"] = median
    if baseline_stats is not None:
        base = baseline_stats["l2_quantiles"]["0.5"]
        evidence["baseline_median_l2"] = base
        ratio = median / base if base > 0 else float("nan")
        evidence["median_ratio"] = ratio
        if not (median >= min_norm_ratio * base):   # also flags a NaN median
            reasons.append(f"median gradient L2 norm {median:.3g} is below {min_norm_ratio:g} x the baseline's "
                           f"{base:.3g}")
    if reasons:
        return MaskingCheck("input_gradients", "flag", "; ".join(reasons), evidence)
    detail = (f"{stats['zero_fraction']:.2%} zero, no non-finite entries; median gradient L2 norm {median:.3g}"
              + (f" ({evidence['median_ratio']:.3g} x the baseline's)" if baseline_stats is not None else ""))
    return MaskingCheck("input_gradients", "pass", detail, evidence)
