"""An exponential moving average (EMA) of a model's weights, evaluated and saved in its place.

Polyak averaging of the iterates with a constant decay (as SASA's appendix A.2, "exponential
moving average with weight 0.9999", and airbench's Lookahead-style average of the weights). Every
``every`` optimizer steps the average moves towards the live weights::

    avg <- d * avg + (1 - d) * w,    d = min(decay ** every, (1 + n) / (10 + n))

where ``n`` counts the updates so far: the second term (the ``num_updates`` warm-up of
TensorFlow's ``ExponentialMovingAverage``) keeps the average from clinging to the random
initialization in the first steps. Floating-point buffers (BatchNorm's running statistics) are
averaged the same way; integer buffers (``num_batches_tracked``) are copied.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

__all__ = ["WeightAverage"]


class WeightAverage:
    """The averaged copy of ``model`` (``self.module``, always in eval mode, no gradients)."""

    def __init__(self, model: nn.Module, decay: float, every: int = 1):
        if not 0.0 < decay < 1.0 or every < 1:
            raise ValueError(f"EMA decay must be in (0, 1) and every >= 1; got decay {decay}, every {every}")
        self.decay = float(decay)
        self.every = int(every)
        self.updates = 0
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)

    def current_decay(self) -> float:
        return min(self.decay ** self.every, (1.0 + self.updates) / (10.0 + self.updates))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the average towards ``model``'s weights (call every ``every`` optimizer steps)."""
        d = self.current_decay()
        live = model.state_dict()
        for name, avg in self.module.state_dict().items():
            value = live[name].detach()
            if avg.is_floating_point():
                avg.lerp_(value.to(avg.dtype), 1.0 - d)
            else:
                avg.copy_(value)
        self.updates += 1

    def maybe_update(self, model: nn.Module, step: int) -> None:
        """``update`` after optimizer step ``step`` (0-based) when ``step + 1`` is a multiple of ``every``."""
        if (step + 1) % self.every == 0:
            self.update(model)

    def state_dict(self) -> dict:
        return {"updates": self.updates, "weights": {k: v.detach().clone() for k, v in
                                                     self.module.state_dict().items()}}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["weights"], strict=True)
        self.updates = int(state["updates"])
