"""Check ``unbounded_attack``: a gradient attack at L-inf eps = 1, where the whole image may change,
must fool every image (Carlini et al. 2019, 5.3; Athalye et al. 2018, 3.1)."""
from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn as nn

from robust_attn.attacks.masking.evidence import MaskingCheck, _first, _verdict, success_by_index


def unbounded_success(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, attack: str = "pgd",
                      steps: int = 20, restarts: int = 1, seed: int = 0, indices: Sequence[int] | None = None,
                      **options) -> pd.DataFrame:
    """Records (``index``, ``success``) of an untargeted L-inf attack with eps = 1 (the whole
    [0, 1] cube), run through :func:`~robust_attn.attacks.base.make_attack`; ``options`` go to
    the attack's ``AttackConfig.options``. ``index`` is ``indices`` or the position in the batch."""
    from robust_attn.attacks.base import AttackConfig, list_attacks, make_attack

    if attack not in list_attacks():
        raise ValueError(f"attack {attack!r} is not registered (have {', '.join(list_attacks())}); "
                         f"the unbounded check needs a gradient attack such as 'pgd'")
    out = make_attack(AttackConfig(attack, norm="linf", eps=1.0, steps=steps, restarts=restarts, seed=seed,
                                   options=dict(options))).run(model, images, labels)
    with torch.no_grad():
        fooled = model(out.adv).argmax(1) != labels.to(images.device, torch.long)
    index = np.arange(len(images)) if indices is None else np.asarray(indices, dtype=int)
    if len(index) != len(images):
        raise ValueError(f"indices has {len(index)} entries for {len(images)} images")
    return pd.DataFrame({"index": index, "success": fooled.long().cpu().numpy()})


def check_unbounded(success: pd.DataFrame | float, condition: str | None = None) -> MaskingCheck:
    """Flag when an attack at L-inf eps = 1 fools fewer than 100% of the images: with the whole
    image free to change, a working gradient attack reaches any class (Carlini et al. 2019, 5.3;
    Athalye et al. 2018, 3.1 "unbounded attacks do not reach 100% success").

    ``success``: the eps = 1 records (see :func:`unbounded_success`; evidence lists the images
    not fooled) or a success rate in [0, 1]."""
    if isinstance(success, pd.DataFrame):
        s = success_by_index(success, condition, "unbounded-attack records")
        missed = s.index[~s.to_numpy()]
        rate, evidence = float(s.mean()), {"n": len(s), "fooled": int(s.sum()), "not_fooled": len(missed),
                                           "indices": _first(missed)}
    elif isinstance(success, numbers.Real) and not isinstance(success, bool):
        rate = float(success)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"success rate must be in [0, 1], got {rate} (divide percentages by 100)")
        evidence = {}
    else:
        raise TypeError(f"success must be per-image records or a rate in [0, 1], got {type(success).__name__}")
    evidence["success_rate"] = rate
    detail = f"success {rate:.2%} at eps = 1 (whole image)"
    if rate < 1.0:
        detail += f"; {evidence['not_fooled']} image(s) not fooled" if "not_fooled" in evidence else ""
    return MaskingCheck("unbounded_attack", _verdict(rate < 1.0), detail, evidence)
