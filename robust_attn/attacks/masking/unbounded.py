"""Check ``unbounded_attack``: a gradient attack at L-inf eps = 1, where the whole image may change,
must fool every image (Carlini et al. 2019, 5.3; Athalye et al. 2018, 3.1).

At eps = 1 a random start is already most of the way to any image: uniform noise over the whole
cube is classified as one class by most models, so the start alone "fools" every image of the
other classes and a model whose input gradient is zero would pass on an image subset that holds
none of that class. The attack therefore starts from the clean image and moves it off the
model's own prediction (what it achieves is the gradient steps' work, on any subset, whether the
model is right or not), and the records also hold the zero-step baseline: what the random start
alone achieves (``start_success``), so the report can tell the two apart."""
from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn as nn

from robust_attn.attacks.masking.evidence import MaskingCheck, first_indices, verdict_word, success_by_index


def _chunks(n: int, batch_size: int | None):
    size = n if batch_size is None else int(batch_size)
    if size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def unbounded_success(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, attack: str = "pgd",
                      steps: int = 20, restarts: int = 1, seed: int = 0, indices: Sequence[int] | None = None,
                      batch_size: int | None = None, **options) -> pd.DataFrame:
    """Records of an untargeted L-inf attack with eps = 1 (the whole [0, 1] cube), run through
    :func:`~robust_attn.attacks.base.make_attack` on at most ``batch_size`` images at a time
    (None: all at once); ``options`` go to the attack's ``AttackConfig.options``. PGD starts at
    the clean image unless ``options`` say ``random_start=True`` (module docstring).

    The attack moves each image away from the model's own prediction on it (the label where the
    model is right), so an image misclassified already is evidence too: a working gradient reaches
    another class from any image, a zero one from none, whatever the subset.

    Columns: ``index`` (``indices`` or the position in the batch), ``success`` (the attack changed
    the model's prediction), ``clean_success`` (the clean image is misclassified; ``labels`` are
    used for this only) and ``start_success`` (PGD's random start at eps = 1 alone, zero steps,
    changes the prediction)."""
    from robust_attn.attacks.base import AttackConfig, list_attacks, make_attack

    if attack not in list_attacks():
        raise ValueError(f"attack {attack!r} is not registered (have {', '.join(list_attacks())}); "
                         f"the unbounded check needs a gradient attack such as 'pgd'")
    index = np.arange(len(images)) if indices is None else np.asarray(indices, dtype=int)
    if len(index) != len(images):
        raise ValueError(f"indices has {len(index)} entries for {len(images)} images")
    if attack == "pgd":
        options.setdefault("random_start", False)
    labels = labels.to(images.device, torch.long)
    success, clean, start = [], [], []
    for a, b in _chunks(len(images), batch_size):
        x, y = images[a:b], labels[a:b]
        with torch.no_grad():
            own = model(x).argmax(1)   # the attack moves the model off its own prediction
        config = AttackConfig(attack, norm="linf", eps=1.0, steps=steps, restarts=restarts, seed=seed + a,
                              options=dict(options))
        adv = make_attack(config).run(model, x, own).adv
        gen = torch.Generator(device=x.device).manual_seed(int(seed) + a)
        noise = ((x + (torch.rand(x.shape, generator=gen, device=x.device, dtype=x.dtype) * 2 - 1)).clamp(0, 1))
        with torch.no_grad():
            success.append(model(adv).argmax(1) != own)
            clean.append(own != y)
            start.append(model(noise).argmax(1) != own)
    cat = (lambda parts: torch.cat(parts).long().cpu().numpy() if parts else np.zeros(0, dtype=int))
    return pd.DataFrame({"index": index, "success": cat(success), "clean_success": cat(clean),
                         "start_success": cat(start)})


def check_unbounded(success: pd.DataFrame | float, condition: str | None = None) -> MaskingCheck:
    """Flag when an attack at L-inf eps = 1 fools fewer than 100% of the images: with the whole
    image free to change, a working gradient attack reaches any class (Carlini et al. 2019, 5.3;
    Athalye et al. 2018, 3.1 "unbounded attacks do not reach 100% success").

    ``success``: the eps = 1 records (see :func:`unbounded_success`; evidence lists the images
    not fooled and, where the records have them, ``misclassified_clean``, ``by_steps`` (the
    images whose prediction the gradient steps changed) and ``fooled_by_random_start`` (those the
    random start alone changes: what a random-start attack's success would have hidden)) or a
    success rate in [0, 1]."""
    if isinstance(success, pd.DataFrame):
        s = success_by_index(success, condition, "unbounded-attack records")
        missed = s.index[~s.to_numpy()]
        rate, evidence = float(s.mean()), {"n": len(s), "fooled": int(s.sum()), "not_fooled": len(missed),
                                           "indices": first_indices(missed)}
        frame = success if condition is None else success[success["condition"] == condition]
        for column, key in (("clean_success", "misclassified_clean"), ("start_success", "fooled_by_random_start")):
            if column in frame.columns:
                evidence[key] = int(pd.to_numeric(frame[column]).sum())
        if "start_success" in frame.columns:
            evidence["by_steps"] = int(s.sum())
    elif isinstance(success, numbers.Real) and not isinstance(success, bool):
        rate = float(success)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"success rate must be in [0, 1], got {rate} (divide percentages by 100)")
        evidence = {}
    else:
        raise TypeError(f"success must be per-image records or a rate in [0, 1], got {type(success).__name__}")
    evidence["success_rate"] = rate
    detail = f"success {rate:.2%} at eps = 1 (whole image, from the clean image)"
    if rate < 1.0:
        detail += f"; {evidence['not_fooled']} image(s) not fooled" if "not_fooled" in evidence else ""
    if "by_steps" in evidence:
        detail += (f"; the gradient steps changed the prediction of {evidence['by_steps']} of {evidence['n']} "
                   f"image(s), the random start alone {evidence['fooled_by_random_start']} of {evidence['n']}")
    return MaskingCheck("unbounded_attack", verdict_word(rate < 1.0), detail, evidence)
