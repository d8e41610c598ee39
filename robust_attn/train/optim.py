"""SGD with parameter groups and the per-step learning-rate schedule.

* Linear scaling (Goyal et al. 2017): the peak rate is ``lr * global_batch / base_batch``.
* Warm-up: linear from ``peak / warmup_steps`` to the peak over ``warmup_epochs`` (per step).
* ``cosine`` (Loshchilov & Hutter 2017; SAN section 5.1, GSA section 4, SASA appendix A.2): after
  warm-up, ``min + (1 - min) * (1 + cos(pi * t)) / 2`` with ``t`` going 0 -> 1 over the remaining
  steps (``min`` = ``min_lr`` as a fraction of the peak).
* ``step`` (AA appendix, ImageNet): multiply by ``gamma`` at each milestone epoch.
* ``linear``: after warm-up, a straight line from the peak down to ``min`` at the last step (the
  warm-up-then-linear-decay shape of airbench, Jordan 2024, "94% on CIFAR-10 in 3.29 seconds").
* ``bias_lr_scale`` multiplies the learning rate of the biases (1-d parameters named ``bias``,
  which are those of the normalization layers, the classifier and any conv with a bias):
  airbench trains BatchNorm biases at 64 times the rate of the weights.
* Weight decay optionally skips biases and normalization weights: every parameter with fewer
  than two dimensions (our choice of rule: it also covers learned scalars and 1-d embeddings
  of the attention layers; relative-position tables, being 2-d or more, are decayed).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn

__all__ = ["param_groups", "build_optimizer", "lr_factor", "build_scheduler"]


def param_groups(model: nn.Module, weight_decay: float, no_decay_norm_bias: bool,
                 bias_lr_scale: float = 1.0) -> list[dict]:
    """One group with ``weight_decay``; with ``no_decay_norm_bias`` a second one of all <2-d
    parameters without it. With ``bias_lr_scale != 1`` the biases form a group of their own whose
    ``lr_scale`` the optimizer applies (:func:`build_optimizer`). Order within a group is the
    model's parameter order (deterministic)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    is_bias = [bias_lr_scale != 1.0 and p.ndim == 1 and n.rsplit(".", 1)[-1] == "bias" for n, p in named]
    plain = [p for (_, p), b in zip(named, is_bias) if not b]
    biases = [p for (_, p), b in zip(named, is_bias) if b]
    if not no_decay_norm_bias:
        groups = [{"params": plain, "weight_decay": weight_decay}]
    else:
        groups = [{"params": [p for p in plain if p.ndim >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in plain if p.ndim < 2], "weight_decay": 0.0}]
    if biases:
        groups.append({"params": biases, "weight_decay": 0.0 if no_decay_norm_bias else weight_decay,
                       "lr_scale": bias_lr_scale})
    return groups


def build_optimizer(model: nn.Module, lr: float, momentum: float, nesterov: bool, weight_decay: float,
                    no_decay_norm_bias: bool = False, bias_lr_scale: float = 1.0) -> torch.optim.SGD:
    groups = param_groups(model, weight_decay, no_decay_norm_bias, bias_lr_scale)
    for group in groups:  # LambdaLR scales each group's initial lr, so a scaled group stays scaled
        group["lr"] = lr * group.pop("lr_scale", 1.0)
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov)


def lr_factor(step: int, total_steps: int, warmup_steps: int = 0, schedule: str = "cosine",
              min_factor: float = 0.0, milestone_steps: Sequence[int] = (), gamma: float = 0.1) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "step":
        return gamma ** sum(step >= m for m in milestone_steps)
    if schedule not in ("cosine", "linear"):
        raise ValueError(f"unknown schedule {schedule!r}; choose 'cosine', 'linear' or 'step'")
    span = max(1, total_steps - warmup_steps)
    t = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        return min_factor + (1.0 - min_factor) * (1.0 - t)
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * t))


def build_scheduler(optimizer: torch.optim.Optimizer, steps_per_epoch: int, epochs: int, warmup_epochs: float,
                    schedule: str = "cosine", min_factor: float = 0.0, milestones: Sequence[float] = (),
                    gamma: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` stepped once per optimizer step."""
    total = steps_per_epoch * epochs
    warmup = int(round(warmup_epochs * steps_per_epoch))
    milestone_steps = [int(round(m * steps_per_epoch)) for m in milestones]

    def factor(step: int) -> float:
        return lr_factor(step, total, warmup, schedule, min_factor, milestone_steps, gamma)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
