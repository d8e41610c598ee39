"""Near misses of a working gradient, which ``blackbox_beats_whitebox`` does not count.

Masked gradients do not lead toward the decision boundary (Athalye et al., ICML 2018, section
3): on the images a black-box attack fools and the white-box attack misses, a gradient attack
leaves the margin where it was. A sound model meets a black-box attack's rare extra point
differently: on the adversarially trained SAN10 patchwise of the CIFAR-10 zoo at 8/255, Square
fools one of 1,000 images that AutoAttack's white-box members miss (image 816), crossing the
boundary by 3e-5 in logits, while PGD (100 steps from the clean image) brings the margin from
1.55 to 0.21, APGD-T to 0.14, and APGD-T with 1,000 steps toward the class Square found to
0.05: the gradient leads to the boundary and stops short of it.

So each image a black-box attack still wins is attacked once more with untargeted PGD from the
clean image, without a random start (what moves the margin is then the gradient alone: on a
model whose gradient is zero, APGD-T's random start closes up to 45% of the margin by itself,
PGD from the clean image none), and its margin (the label's logit minus the largest other) is
measured before and after: where PGD closes at least :data:`NEAR_MISS` of the clean margin, the
image is a near miss, reported, and not counted as evidence of masking.

Only while near misses are rare (:func:`excused`: the images that are a near miss of any source,
at most :data:`RARE` of the images compared, one at least). A black-box attack's edge over a
working gradient is chance at the boundary, one image in a thousand on that model; a gradient
that stops short of the boundary on many images while a black-box attack crosses it there is
what partly masked gradients look like (a gradient that leads toward the boundary but not across
a step or a plateau near it), so past the bound every near miss counts as evidence again.
"""
from __future__ import annotations

import pandas as pd
import torch
import torch.nn as nn

__all__ = ["NEAR_MISS", "RARE", "STEPS", "margins", "near_misses", "excused", "rule", "rule_changed"]

#: the share of its clean margin the white-box attack must close for an image to be a near miss
NEAR_MISS = 0.5
#: the share of the compared images the model's near misses (of any source) may reach and still not count
RARE = 0.01
#: PGD's iterations where the caller gives none (AutoAttack's APGD members run 100)
STEPS = 100


def _margin(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    own = logits.gather(1, labels[:, None])[:, 0]
    other = logits.scatter(1, labels[:, None], float("-inf")).amax(1)
    return own - other


def margins(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, indices, eps: float, *,
            steps: int | None = None, seed: int = 0, batch_size: int = 64) -> pd.DataFrame:
    """Per image (``indices``: its index in the records): the margin of the clean image and of the
    point untargeted L-inf PGD leaves (``eps``, ``steps`` iterations, :data:`STEPS` by default,
    from the clean image); columns ``index``, ``eps``, ``clean_margin``, ``margin`` (negative:
    PGD fooled it)."""
    from robust_attn.attacks import AttackConfig, make_attack

    attack = make_attack(AttackConfig("pgd", eps=eps, steps=steps or STEPS, seed=seed,
                                      options={"random_start": False}))
    clean, after = [], []
    for start in range(0, len(images), batch_size):
        x, y = images[start:start + batch_size], labels[start:start + batch_size]
        adv = attack.run(model, x, y).adv
        with torch.no_grad():
            clean += _margin(model(x).double(), y).tolist()
            after += _margin(model(adv).double(), y).tolist()
    return pd.DataFrame({"index": [int(i) for i in indices], "eps": float(eps), "clean_margin": clean,
                         "margin": after})


def near_misses(records: pd.DataFrame, eps: float, share: float = NEAR_MISS) -> set[int]:
    """The indices among ``records`` (of :func:`margins`) at ``eps`` whose margin the attack
    closed by at least ``share`` of the clean margin (or crossed)."""
    at = records[(records["eps"] - eps).abs() < 1e-9]
    close = (at["clean_margin"] > 0) & (at["margin"] <= (1 - share) * at["clean_margin"])
    return set(at.loc[close, "index"].astype(int))


def excused(count: int, compared: int, rare: float | None = None) -> bool:
    """Whether ``count`` near misses among ``compared`` images are rare enough not to count: at
    most ``rare`` (:data:`RARE` by default) of them, and one image always is."""
    return count <= max(1, int((RARE if rare is None else rare) * compared))


def rule() -> dict:
    """The rule near misses were decided by, recorded beside them in the check's evidence."""
    return {"near_miss": NEAR_MISS, "rare": RARE}


def rule_changed(checks: list[dict]) -> str | None:
    """Why a saved ``checks.json`` (its list of checks) decided its near misses under another rule
    than today's (:func:`rule`; none recorded: before near misses were bounded), or None where it
    has no near misses or decided them under this one."""
    for check in checks:
        if check.get("name") != "blackbox_beats_whitebox":
            continue
        for evidence in (check.get("evidence") or {}).values():
            if isinstance(evidence, dict) and evidence.get("near_misses") and evidence.get("near_miss_rule") != rule():
                was = evidence.get("near_miss_rule")
                return (f"decided its near misses under {'the rule ' + str(was) if was else 'an earlier rule'}, "
                        f"not today's {rule()}")
    return None
