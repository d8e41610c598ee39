"""The white-box follow-up of ``blackbox_beats_whitebox`` where the white-box attack at a
black-box source's radius is APGD-CE alone.

APGD-CE optimizes the cross-entropy only. AutoAttack adds APGD-T (the targeted DLR loss) and
FAB-T because such an attack misses points that others find, on undefended models too (Croce &
Hein, ICML 2020, section 4): on the efficient CIFAR-10 zoo's ResNet-26 at 8/255, AutoAttack
credits APGD-T with 15 of 1,000 images that its APGD-CE member missed, and Square alone fools 4
images APGD-CE missed and none that AutoAttack's white-box members missed. So where a study ran
APGD-CE alone at a black-box source's radius (e.g. AutoAttack at 2/255, Square and the transfer
attacks at 8/255), an image the source fools and APGD-CE does not is attacked again with
AutoAttack's other white-box members, APGD-T and then FAB-T on what APGD-T left, at that radius.
The check counts it against the white-box attack only where both fail too: what remains is
evidence of masking, not of the cross-entropy's known blind spots.
"""
from __future__ import annotations

from typing import Mapping

import pandas as pd
import torch
import torch.nn as nn

from robust_attn.attacks.masking.evidence import MaskingCheck

__all__ = ["FOLLOWUP_MEMBERS", "whitebox_followup", "contested", "apply_followup", "with_followup"]

FOLLOWUP_MEMBERS = ("apgd-t", "fab-t")   # AutoAttack's white-box members after APGD-CE, in its order


def whitebox_followup(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, indices, eps: float, *,
                      steps: int | None = None, seed: int = 0, batch_size: int = 64) -> pd.DataFrame:
    """Per image (``indices``: its index in the records), the first of :data:`FOLLOWUP_MEMBERS`
    that fools it at ``eps`` (untargeted L-inf, ``steps`` iterations, ``seed``), or "none":
    columns ``index``, ``eps``, ``by``. Each member runs on the images the ones before it left."""
    from robust_attn.attacks import AttackConfig, make_attack

    by = ["none"] * len(images)
    left = list(range(len(images)))
    for member in FOLLOWUP_MEMBERS:
        if not left:
            break
        attack = make_attack(AttackConfig(member, eps=eps, steps=steps, seed=seed))
        for start in range(0, len(left), batch_size):
            chunk = left[start:start + batch_size]
            x, y = images[chunk], labels[chunk]
            adv = attack.run(model, x, y).adv
            with torch.no_grad():
                fooled = (model(adv).argmax(1) != y).tolist()
            for i, hit in zip(chunk, fooled):
                if hit:
                    by[i] = member
        left = [i for i in left if by[i] == "none"]
    return pd.DataFrame({"index": [int(i) for i in indices], "eps": float(eps), "by": by})


def _success(records: pd.DataFrame) -> pd.Series:
    return records.set_index("index")["success"].astype(bool)


def contested(white: pd.DataFrame, black: pd.DataFrame) -> list[int]:
    """The indices (sorted) of the images ``black``'s attack fooled and ``white``'s did not."""
    w, b = _success(white), _success(black)
    common = w.index.intersection(b.index)
    return sorted(int(i) for i in common[(b.loc[common] & ~w.loc[common]).to_numpy()])


def apply_followup(white: pd.DataFrame, followup: pd.DataFrame, eps: float) -> pd.DataFrame:
    """``white`` with ``success`` set on the images the follow-up at ``eps`` fooled."""
    at = followup[(followup["eps"] - eps).abs() < 1e-9]
    fooled = set(at.loc[at["by"] != "none", "index"].astype(int))
    out = white.copy()
    out["success"] = (out["success"].astype(bool) | out["index"].isin(fooled)).astype(int)
    return out


def with_followup(check: MaskingCheck, followed: Mapping[str, tuple[list[int], pd.DataFrame]],
                  reference: str = "APGD-CE") -> MaskingCheck:
    """``check`` (``blackbox_beats_whitebox``, computed against the white-box records with the
    follow-up applied) with each followed source's evidence saying what the follow-up did:
    ``followup``: the images the source fooled and the white-box attack (``reference``, alone)
    did not, and how many each member fooled (``followed``: source -> (those indices, the
    follow-up's records at its radius))."""
    evidence = {k: dict(v) for k, v in check.evidence.items()}
    notes = []
    for source, (indices, records) in followed.items():
        mine = records[records["index"].isin(indices)]
        counts = {m: int((mine["by"] == m).sum()) for m in FOLLOWUP_MEMBERS}
        evidence[source]["followup"] = {"beat_white_box": len(indices), **counts}
        notes.append(f"{source}: {len(indices)} image(s) beyond {reference}, of which APGD-T fooled "
                     f"{counts['apgd-t']} and FAB-T {counts['fab-t']}")
    detail = check.detail + (f"; the white-box follow-up (AutoAttack's APGD-T and FAB-T where {reference} alone "
                             "ran): " + "; ".join(notes) if notes else "")
    return MaskingCheck(check.name, check.verdict, detail, evidence)
