"""Gradient-masking checks, run with every attack and reported per model.

Not an attack (no ``@register_attack`` here): the five checks of the issue, one per module of this
package (:mod:`.blackbox`, :mod:`.unbounded`, :mod:`.strength`, :mod:`.gradients`,
:mod:`.saturation`; what they return in :mod:`.evidence`), each returning a
:class:`MaskingCheck` (name, verdict "pass" or "flag", a one-line detail, and the evidence:
counts and image indices), saved in ``checks.json`` via :meth:`MaskingCheck.to_dict`. The signs of
masked or obfuscated gradients follow Athalye et al. 2018 (section 3.1) and Carlini et al. 2019
("On evaluating adversarial robustness", section 5.2/5.3):

* ``blackbox_beats_whitebox``: images a black-box (Square) or transfer attack fools that the
  white-box attack at the same eps did not (:func:`check_blackbox_beats_whitebox`), less the
  near misses of a working gradient (:mod:`.near_miss`) and, where the white-box attack was
  APGD-CE alone, what AutoAttack's other white-box members find (:mod:`.followup`).
* ``unbounded_attack``: a gradient attack at L-inf eps = 1, where the whole image may change, must
  move every image off the model's prediction, starting from the clean image so that the random
  start alone cannot pass the check (:func:`unbounded_success`, :func:`check_unbounded`).
* ``gain_with_strength``: success must not fall, and must grow, with steps, restarts or eps
  (:func:`check_gain_with_strength`).
* ``input_gradients``: the fraction of input-gradient entries that are exactly zero or
  non-finite and the per-image gradient norms, against a ResNet baseline
  (:func:`input_gradient_stats`, :func:`check_input_gradients`).
* ``loss_saturation``: a 1-D sweep of the loss along the gradient sign and along random sign
  directions (:func:`loss_along_directions`, :func:`check_loss_saturation`,
  :func:`plot_loss_along_directions`).

Per-image records are DataFrames with at least ``index`` (image index) and ``success`` (1 = the
attack succeeded), as written by :mod:`robust_attn.protocols.attack`; a frame holding several
conditions must be filtered to one (or pass ``condition=``). Losses are the cross-entropy of the
label, computed in float64 from the model's logits, so a confident but healthy model's loss (and
its gradient) does not round to exactly 0 in float32: what remains exactly 0 is genuine saturation.

Our choices where the issue is silent: the thresholds are arguments with the defaults documented
on each function; the checks flag (they never raise) so a run keeps every verdict; a check that
has nothing to compare (no common images) is an error, not a pass.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd
import torch
import torch.nn as nn

from robust_attn.attacks.masking.blackbox import check_blackbox_beats_whitebox
from robust_attn.attacks.masking.evidence import MAX_INDICES, VERDICTS, MaskingCheck, success_by_index
from robust_attn.attacks.masking.gradients import QUANTILES, check_input_gradients, input_gradient_stats
from robust_attn.attacks.masking.plot import plot_loss_along_directions
from robust_attn.attacks.masking.saturation import check_loss_saturation, loss_along_directions
from robust_attn.attacks.masking.strength import check_gain_with_strength
from robust_attn.attacks.masking.unbounded import check_unbounded, unbounded_success

__all__ = ["MaskingCheck", "VERDICTS", "MAX_INDICES", "QUANTILES", "success_by_index",
           "check_blackbox_beats_whitebox", "unbounded_success", "check_unbounded", "check_gain_with_strength",
           "input_gradient_stats", "check_input_gradients", "loss_along_directions", "check_loss_saturation",
           "plot_loss_along_directions", "run_masking_checks"]


def run_masking_checks(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, eps: float, *,
                       white: pd.DataFrame | None = None, black: Mapping[str, pd.DataFrame] | None = None,
                       rates: Mapping | None = None, order: Sequence | None = None,
                       baseline: nn.Module | Mapping | None = None, unbounded_steps: int = 20,
                       sweep_images: int = 4, seed: int = 0, plot_path: str | Path | None = None,
                       indices: Sequence[int] | None = None, batch_size: int | None = None) -> list[MaskingCheck]:
    """Every check the inputs allow, in the issue's order.

    Always: ``unbounded_attack`` (PGD, eps = 1, ``unbounded_steps`` steps, on ``images``),
    ``input_gradients`` (against ``baseline``: a baseline model run on the same images, or its
    :func:`input_gradient_stats`) and ``loss_saturation`` (sweep to ``eps`` on the first
    ``sweep_images`` images; plotted to ``plot_path`` when given). With ``white`` and ``black``:
    ``blackbox_beats_whitebox``; with ``rates``: ``gain_with_strength``. Every probe runs the model
    on at most ``batch_size`` images at a time (None: all of ``images`` at once)."""
    results = []
    if white is not None and black:
        results.append(check_blackbox_beats_whitebox(white, black))
    results.append(check_unbounded(unbounded_success(model, images, labels, steps=unbounded_steps, seed=seed,
                                                     indices=indices, batch_size=batch_size)))
    if rates is not None:
        results.append(check_gain_with_strength(rates, order))
    if isinstance(baseline, nn.Module):
        baseline = input_gradient_stats(baseline, images, labels, batch_size)
    results.append(check_input_gradients(input_gradient_stats(model, images, labels, batch_size), baseline))
    k = min(sweep_images, len(images))
    sweep = loss_along_directions(model, images[:k], labels[:k], eps, seed=seed,
                                  indices=None if indices is None else list(indices)[:k],
                                  **({} if batch_size is None else {"batch_size": batch_size}))
    if plot_path is not None:
        plot_loss_along_directions(sweep, plot_path)
    results.append(check_loss_saturation(sweep))
    return results
