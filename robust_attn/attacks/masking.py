"""Gradient-masking checks (issue #14), run with every attack and reported per model.

Not an attack (no ``@register_attack`` here): the five checks of the issue, each returning a
:class:`MaskingCheck` (name, verdict "pass" or "flag", a one-line detail, and the evidence:
counts and image indices), saved in ``checks.json`` via :meth:`MaskingCheck.to_dict`. The signs of
masked or obfuscated gradients follow Athalye et al. 2018 (section 3.1) and Carlini et al. 2019
("On evaluating adversarial robustness", section 5.2/5.3):

* ``blackbox_beats_whitebox``: images a black-box (Square) or transfer attack fools that the
  white-box attack at the same eps did not (:func:`check_blackbox_beats_whitebox`).
* ``unbounded_attack``: a gradient attack at L-inf eps = 1, where the whole image may change, must
  fool every image (:func:`unbounded_success`, :func:`check_unbounded`).
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

import math
import numbers
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MaskingCheck", "VERDICTS", "success_by_index", "check_blackbox_beats_whitebox", "unbounded_success",
           "check_unbounded", "check_gain_with_strength", "input_gradient_stats", "check_input_gradients",
           "loss_along_directions", "check_loss_saturation", "plot_loss_along_directions", "run_masking_checks"]

VERDICTS = ("pass", "flag")
MAX_INDICES = 20           # image indices kept in the evidence (the first ones, sorted)
QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


def _plain(value):
    """JSON-safe copy: numpy scalars and arrays, tuples and tensors to Python types."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray, pd.Series)):
        return [_plain(v) for v in list(value)]
    if isinstance(value, torch.Tensor):
        return _plain(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


@dataclass(frozen=True)
class MaskingCheck:
    """One gradient-masking check: ``verdict`` "pass" or "flag"; ``evidence`` holds the counts
    and image indices behind it (JSON-safe after :meth:`to_dict`)."""

    name: str
    verdict: str
    detail: str
    evidence: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}, got {self.verdict!r}")

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_dict(self) -> dict:
        """For ``checks.json``: name, verdict, passed (as :class:`~robust_attn.attacks.checks.CheckResult`),
        detail and evidence."""
        return {"name": self.name, "verdict": self.verdict, "passed": self.passed, "detail": self.detail,
                "evidence": _plain(self.evidence)}


def _verdict(flag: bool) -> str:
    return "flag" if flag else "pass"


def _first(indices) -> list[int]:
    return sorted(int(i) for i in indices)[:MAX_INDICES]


# ------------------------------------------------------------------ records

def success_by_index(records: pd.DataFrame, condition: str | None = None, what: str = "records") -> pd.Series:
    """``success`` (bool) indexed by image ``index`` from per-image records of one condition."""
    if not isinstance(records, pd.DataFrame):
        raise TypeError(f"{what} must be a pandas DataFrame of per-image records, got {type(records).__name__}")
    missing = {"index", "success"} - set(records.columns)
    if missing:
        raise ValueError(f"{what} lack column(s) {', '.join(sorted(missing))}; per-image records need "
                         f"'index' (image) and 'success' (1 = fooled)")
    if condition is not None:
        if "condition" not in records.columns:
            raise ValueError(f"{what} have no 'condition' column to select {condition!r} from")
        records = records[records["condition"] == condition]
        if records.empty:
            raise ValueError(f"{what} have no rows of condition {condition!r}")
    if records["index"].duplicated().any():
        hint = (f" (conditions {sorted(records['condition'].unique())}: pass condition=...)"
                if "condition" in records.columns and records["condition"].nunique() > 1 else "")
        raise ValueError(f"{what} repeat image indices{hint}; give one condition's records")
    values = pd.to_numeric(records["success"], errors="coerce")
    if values.isna().any() or not values.isin([0, 1]).all():
        raise ValueError(f"{what}: 'success' must be 0/1 (or bool) per image")
    return pd.Series(values.astype(bool).to_numpy(), index=records["index"].astype(int).to_numpy())


def check_blackbox_beats_whitebox(white: pd.DataFrame, black: Mapping[str, pd.DataFrame],
                                  condition: str | None = None) -> MaskingCheck:
    """Flag when any image that a black-box or transfer attack fools was not fooled by the
    white-box attack at the same eps (Carlini et al. 2019, 5.2: a gradient-free or transfer
    attack beating the white-box one means the gradients mislead it).

    ``white``: the white-box attack's records; ``black``: source name -> records (Square, or a
    transfer attack evaluated on this model) at the same eps and the same meaning of success
    (both untargeted, or both toward the same targets). Images are matched by ``index``; only
    images in both are compared. ``condition`` selects the white-box condition in ``white``; each
    black-box frame must hold one condition. Evidence per source: compared, black-box and white-box successes,
    ``beats`` (the count) and the first :data:`MAX_INDICES` of their indices.
    """
    if not isinstance(black, Mapping) or not black:
        raise ValueError("black must map a source name (e.g. 'square', 'transfer:resnet26') to its records")
    white_success = success_by_index(white, condition, "white-box records")
    evidence: dict = {}
    total = 0
    for source, frame in black.items():
        black_success = success_by_index(frame, None, f"records of {source!r}")
        common = white_success.index.intersection(black_success.index)
        if len(common) == 0:
            raise ValueError(f"records of {source!r} share no image index with the white-box records; "
                             f"compare attacks run on the same images")
        w, b = white_success.loc[common], black_success.loc[common]
        beats = common[(b & ~w).to_numpy()]
        total += len(beats)
        evidence[source] = {"compared": len(common), "black_success": int(b.sum()), "white_success": int(w.sum()),
                            "beats": len(beats), "indices": _first(beats)}
    parts = [f"{s}: {e['beats']} of {e['compared']}" for s, e in evidence.items()]
    if total:
        detail = "images fooled by a black-box/transfer attack but not by the white-box one: " + "; ".join(parts)
    else:
        detail = "the white-box attack fools every image the black-box/transfer attacks fool (" + "; ".join(
            f"{s}: {e['compared']} compared" for s, e in evidence.items()) + ")"
    return MaskingCheck("blackbox_beats_whitebox", _verdict(total > 0), detail, evidence)


# ------------------------------------------------------------------ unbounded attack

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


# ------------------------------------------------------------------ strength sweep

def check_gain_with_strength(rates: Mapping, order: Sequence | None = None, tol: float = 0.0,
                             what: str = "strength") -> MaskingCheck:
    """Flag when success does not grow with the attack's strength (steps, restarts or eps).

    ``rates``: setting -> success rate in [0, 1]; ``order``: the settings from weakest to strongest
    (default: the mapping's order). Flags (our sharpening of the issue's "does not grow") when
    (a) a stronger setting's rate is below the previous one's by more than ``tol``, or (b) the
    strongest is not strictly above the weakest while the weakest is below 100% (an attack that
    gains nothing from 10x the effort is stuck, typically on a masked gradient).
    """
    order = list(rates) if order is None else list(order)
    if len(order) < 2:
        raise ValueError("give at least two settings (weakest to strongest) to compare")
    unknown = [k for k in order if k not in rates]
    if unknown:
        raise ValueError(f"order names setting(s) without a rate: {unknown}")
    values = []
    for key in order:
        rate = rates[key]
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= float(rate) <= 1.0:
            raise ValueError(f"success rate of {key!r} must be a number in [0, 1], got {rate!r} "
                             f"(divide percentages by 100)")
        values.append(float(rate))
    drops = [{"from": str(a), "to": str(b), "rate_from": ra, "rate_to": rb}
             for a, b, ra, rb in zip(order, order[1:], values, values[1:]) if rb < ra - tol]
    stuck = values[-1] <= values[0] and values[0] < 1.0
    evidence = {"order": [str(k) for k in order], "rates": values, "drops": drops, "gain": values[-1] - values[0]}
    shown = " -> ".join(f"{k}: {v:.2%}" for k, v in zip(order, values))
    if drops:
        detail = f"success falls as the {what} grows ({shown})"
    elif stuck:
        detail = f"success does not grow with the {what} ({shown})"
    elif values[0] >= 1.0:
        detail = f"already 100% at the weakest {what} ({shown})"
    else:
        detail = f"success grows with the {what} ({shown})"
    return MaskingCheck("gain_with_strength", _verdict(bool(drops) or stuck), detail, evidence)


# ------------------------------------------------------------------ input gradients

def _per_image_loss(model: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the label per image, in float64 (module docstring)."""
    return F.cross_entropy(model(x).double(), labels, reduction="none")


def _input_gradient(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """d CE(x_i, y_i) / d x_i for every image (the gradient of the summed loss: images are independent)."""
    from robust_attn.attacks.pgd import frozen_parameters, validate_attack_inputs

    labels = labels.to(images.device, torch.long)
    validate_attack_inputs(model, images, labels)
    x = images.detach().clone().requires_grad_(True)
    with torch.enable_grad(), frozen_parameters(model):
        loss = _per_image_loss(model, x, labels).sum()
        if not loss.requires_grad:
            return torch.zeros_like(images)   # the loss does not depend on the input through autograd
        (grad,) = torch.autograd.grad(loss, x, allow_unused=True)
    return torch.zeros_like(images) if grad is None else grad.detach()


def input_gradient_stats(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> dict:
    """Input gradients of the label's cross-entropy: ``zero_fraction`` and ``nonfinite_fraction``
    (over all gradient entries), ``zero_images`` (images whose whole gradient is 0, with
    ``zero_indices``), and the quantiles :data:`QUANTILES` of the per-image L1 and L2 norms over
    the images with a finite gradient (``l1_quantiles``/``l2_quantiles``: q -> value)."""
    grad = _input_gradient(model, images, labels).flatten(1).double()
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
            "zero_images": int(zero_image.sum()), "zero_indices": _first(torch.nonzero(zero_image).flatten().tolist()),
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


# ------------------------------------------------------------------ loss along directions

def loss_along_directions(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, eps: float,
                          points: int = 21, random_directions: int = 4, seed: int = 0,
                          indices: Sequence[int] | None = None, batch_size: int = 256) -> pd.DataFrame:
    """The label's cross-entropy at ``clip_[0,1](x + t * d)`` for ``t`` in ``linspace(-eps, eps,
    points)`` (``points`` odd, so t = 0 is a point) along ``d = sign(grad_x CE)`` ("grad_sign") and
    ``random_directions`` random sign vectors ("random_0", ...; Rademacher, drawn from a generator
    seeded with ``seed``, so every direction has the same L-inf size 1 and ``t`` is an L-inf
    distance before clipping). Returns a long frame: image, direction, t, loss (float64)."""
    if isinstance(points, bool) or not isinstance(points, numbers.Integral) or points < 3 or points % 2 == 0:
        raise ValueError(f"points must be an odd int >= 3 (so t = 0 is swept), got {points!r}")
    if not isinstance(eps, numbers.Real) or not 0 < eps <= 1:
        raise ValueError(f"eps must be in (0, 1] image units (e.g. 8/255), got {eps!r}")
    if isinstance(random_directions, bool) or not isinstance(random_directions, numbers.Integral) \
            or random_directions < 0:
        raise ValueError(f"random_directions must be an int >= 0, got {random_directions!r}")
    labels = labels.to(images.device, torch.long)
    grad = _input_gradient(model, images, labels)
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
            losses[start:start + len(part)] = _per_image_loss(model, x, labels[i_idx]).cpu().numpy()
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
    evidence = {"n_images": n, "flat": len(flat), "flat_indices": _first(flat), "random_wins": len(wins),
                "random_wins_indices": _first(wins), "per_image": per_image}
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


# ------------------------------------------------------------------ all together

def run_masking_checks(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, eps: float, *,
                       white: pd.DataFrame | None = None, black: Mapping[str, pd.DataFrame] | None = None,
                       rates: Mapping | None = None, order: Sequence | None = None,
                       baseline: nn.Module | Mapping | None = None, unbounded_steps: int = 20,
                       sweep_images: int = 4, seed: int = 0, plot_path: str | Path | None = None,
                       indices: Sequence[int] | None = None) -> list[MaskingCheck]:
    """Every check the inputs allow, in the issue's order.

    Always: ``unbounded_attack`` (PGD, eps = 1, ``unbounded_steps`` steps, on ``images``),
    ``input_gradients`` (against ``baseline``: a baseline model run on the same images, or its
    :func:`input_gradient_stats`) and ``loss_saturation`` (sweep to ``eps`` on the first
    ``sweep_images`` images; plotted to ``plot_path`` when given). With ``white`` and ``black``:
    ``blackbox_beats_whitebox``; with ``rates``: ``gain_with_strength``."""
    results = []
    if white is not None and black:
        results.append(check_blackbox_beats_whitebox(white, black))
    results.append(check_unbounded(unbounded_success(model, images, labels, steps=unbounded_steps, seed=seed,
                                                     indices=indices)))
    if rates is not None:
        results.append(check_gain_with_strength(rates, order))
    if isinstance(baseline, nn.Module):
        baseline = input_gradient_stats(baseline, images, labels)
    results.append(check_input_gradients(input_gradient_stats(model, images, labels), baseline))
    k = min(sweep_images, len(images))
    sweep = loss_along_directions(model, images[:k], labels[:k], eps, seed=seed,
                                  indices=None if indices is None else list(indices)[:k])
    if plot_path is not None:
        plot_loss_along_directions(sweep, plot_path)
    results.append(check_loss_saturation(sweep))
    return results
