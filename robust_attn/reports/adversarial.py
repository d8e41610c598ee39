"""The report's section on adversarial training: each family trained adversarially beside its
standard counterpart, compared image by image.

Which runs: every run records how its model was trained (``adversarial`` in run.json: the zoo
entry's record, :attr:`robust_attn.models.manifest.ZooEntry.adversarial`; ``{}`` for standard
training; a run without it is looked up in the zoo manifest by its ``zoo_entry``, and left out
when neither says). A model is its architecture (run.json's ``arch.name``, whose family the
model registry names) and its training.

Pairing: an adversarially trained model pairs with the standard model of the same architecture
among the report's runs (the study config lists one standard model per architecture, so the
config is the explicit choice); two standard models of one architecture are a pairing the
section refuses to guess, and it says so. A pair whose architecture arguments differ (run.json's
``arch``: another width, say) is paired, with a note that its gains mix the two differences.

The answers, each from per-image hits on the same images (the study's seeded subset), with
percentile bootstrap intervals over images, paired (one resample serves both models):

* **Which family is most robust under the same adversarial training** (models grouped by
  :func:`~robust_attn.models.manifest.training_label`): top-1 under AutoAttack at the training
  radius (L-inf, untargeted), and each model's difference from the best.
* **Does SAN10 pairwise's weakness under gradient attacks survive**: SAN10 pairwise minus the
  convolutional baseline's architecture (the report's baseline) in robust top-1, under every
  gradient attack (APGD-CE, AutoAttack) both standard models ran and at the training radius
  for both adversarial ones: a weakness that is resolved under standard training survives
  when the adversarial difference is resolved negative too, flips when it is resolved positive.
* **What adversarial training gains and costs per family**: adversarial minus standard, per
  image, in robust top-1 (AutoAttack at the training radius), clean top-1 (the AutoAttack
  run's clean condition, same images), top-1 under Table 9's four rotations (mean) and under
  the common corruptions (mean over every corrupted condition).

Beside them, Bai et al. (NeurIPS 2021; ``reports/reference/bai2021_adversarial.csv``) on
ImageNet: a model a gradient-masking check flagged carries the masking mark
(:mod:`robust_attn.reports.masking_marks`) in every row and sentence.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd

from robust_attn.protocols.report_section import ReportContext, report_section
from robust_attn.reports.comparison import ROTATED
from robust_attn.reports.runs import model_names
from robust_attn.reports.stats import bootstrap_mean_ci

__all__ = ["WEAK_ARCH", "training_of", "adversarial_measures", "robust_key", "pair_models", "adversarial_findings",
           "bai_comparison"]

#: the architecture whose weakness under gradient attacks the section follows into adversarial training
WEAK_ARCH = "san10_pairwise"
GRADIENT_ATTACKS = ("apgd-ce", "autoattack")
DEFAULT_EPS = 8 / 255


def training_of(run) -> dict | None:
    """How the run's model was trained: its ``adversarial`` record (``{}``: standard), from
    run.json or else the zoo manifest's entry; None when neither says."""
    if "adversarial" in run.description:
        return dict(run.description["adversarial"] or {})
    entry = run.description.get("zoo_entry")
    if not entry:
        return None
    from robust_attn.models.manifest import Manifest

    try:
        found = Manifest().entries.get((entry, run.dataset))
    except ValueError:
        return None
    return dict(found.adversarial) if found is not None else None


def _arch(run) -> str:
    return (run.description.get("arch") or {}).get("name") or run.model


def _family(arch: str) -> str:
    from robust_attn.models.registry import model_info

    try:
        return model_info(arch).family
    except (KeyError, ValueError):
        return arch


def _hits(records: pd.DataFrame) -> pd.DataFrame:
    return records.pivot_table(index="index", columns="condition", values="top1", aggfunc="first")


def _autoattack_condition(run, eps: float) -> str | None:
    for c in run.description["conditions"]:
        if c.get("attack") == "autoattack" and c.get("norm", "linf") == "linf" and not c.get("targeted", False) \
                and abs(c["eps"] - eps) < 1e-9:
            return c["name"]
    return None


def _gradient_conditions(run) -> dict[str, str]:
    """``{label: condition}`` of the run's untargeted L-inf gradient attacks (``AutoAttack 8/255``)."""
    from robust_attn.reports.attacks import eps_label

    return {eps_label(c): c["name"] for c in run.description["conditions"]
            if c.get("attack") in GRADIENT_ATTACKS and c.get("norm", "linf") == "linf" and not c.get("targeted")}


def adversarial_measures(runs) -> dict[str, dict[str, pd.Series]]:
    """``{model: {measure: per-image top-1 indexed by (image set, index)}}``: ``grad:<attack label>``
    (each untargeted L-inf gradient attack, e.g. ``grad:AutoAttack 8/255``), ``clean`` (the clean
    condition of the run holding AutoAttack), ``rotation`` and ``corruption`` (module docstring)."""
    names = model_names(runs)
    out: dict[str, dict[str, pd.Series]] = {}

    def put(run, key: str, values: pd.Series) -> None:
        images = json.dumps(run.description["dataset"], sort_keys=True)
        values = values.astype(float)
        values.index = pd.MultiIndex.from_arrays([[images] * len(values), values.index], names=["images", "index"])
        out.setdefault(names[id(run)], {}).setdefault(key, values)

    for run in runs:
        if run.protocol not in ("attack", "rotation", "corruption") or not len(run.records):
            continue  # e.g. the masking checks' records: success per check, no top-1
        hits = _hits(run.records)
        if run.protocol == "attack":
            conditions = _gradient_conditions(run)
            for label, condition in conditions.items():
                if condition in hits:
                    put(run, f"grad:{label}", hits[condition])
            if "clean" in hits and any(label.startswith("AutoAttack") for label in conditions):
                put(run, "clean", hits["clean"])
        elif run.protocol == "rotation" and all(c in hits for c in ROTATED):
            put(run, "rotation", hits[list(ROTATED)].mean(axis=1))
        elif run.protocol == "corruption" and "clean" in hits and len(hits.columns) > 1:
            put(run, "corruption", hits.drop(columns="clean").mean(axis=1))
    return out


def robust_key(training: dict) -> str:
    """The measure of robust top-1: AutoAttack at the training radius (8/255 where unrecorded)."""
    return f"grad:AutoAttack {_eps_255(training):.3g}/255"


def pair_models(runs) -> tuple[list[dict], list[str]]:
    """The models of the runs with their training, and notes on what could not be paired.
    Each model: ``{"model", "arch", "family", "training" (dict), "standard" (the paired standard
    model or None)}``; models of unknown training are left out (named in the notes)."""
    names = model_names(runs)
    models: dict[str, dict] = {}
    notes = []
    for run in runs:
        name = names[id(run)]
        if name in models:
            continue
        training = training_of(run)
        if training is None:
            notes.append(f"{name}: its runs do not say how it was trained (no `adversarial` in run.json, no zoo entry); "
                         "left out")
            models[name] = {}
            continue
        models[name] = {"model": name, "arch": _arch(run), "family": _family(_arch(run)), "training": training,
                        "standard": None, "arguments": run.description.get("arch") or {}}
    models = {k: v for k, v in models.items() if v}
    standard: dict[str, list[str]] = {}
    for m in models.values():
        if not m["training"]:
            standard.setdefault(m["arch"], []).append(m["model"])
    for m in models.values():
        if m["training"]:
            have = standard.get(m["arch"], [])
            if len(have) == 1:
                m["standard"] = have[0]
                if m["arguments"] != models[have[0]]["arguments"]:
                    notes.append(f"{m['model']} and {have[0]} differ in their architecture arguments "
                                 f"({m['arguments']} against {models[have[0]]['arguments']}): its gains mix "
                                 "adversarial training with that difference")
            elif have:
                notes.append(f"{m['model']}: {len(have)} standard models of {m['arch']} ({', '.join(have)}); report one "
                             f"of them beside it to pair them")
            else:
                notes.append(f"{m['model']}: no standard {m['arch']} among the runs; its gains are not measured")
    return list(models.values()), notes


def _paired(a: pd.Series, b: pd.Series, ctx) -> tuple[float, float, float, int] | None:
    """Mean of ``a - b`` (points) over the images both have, with its paired bootstrap interval."""
    both = pd.concat([a, b], axis=1, join="inner").dropna()
    if both.empty:
        return None
    ci = bootstrap_mean_ci(both.iloc[:, 0] - both.iloc[:, 1], n_boot=ctx.n_boot, seed=ctx.seed, level=ctx.level)
    return ci.value, ci.low, ci.high, len(both)


def _resolved(d) -> bool:
    return d is not None and (d[1] > 0 or d[2] < 0)


def _cell(d) -> str:
    if d is None:
        return "-"
    return f"{d[0]:+.1f} [{d[1]:+.1f}, {d[2]:+.1f}]" + ("" if _resolved(d) else " (n.s.)")


def _eps_255(training: dict) -> float:
    if "eps_255" in training:
        return float(training["eps_255"])
    return round(float(training.get("eps", DEFAULT_EPS)) * 255, 6)


def adversarial_findings(runs, ctx: ReportContext) -> tuple[list[str], pd.DataFrame]:
    """The section's Markdown lines and its table (one row per comparison, long format)."""
    from robust_attn.models.manifest import training_label
    from robust_attn.reports.masking_marks import MARK

    models, notes = pair_models(runs)
    adversarial = [m for m in models if m["training"]]
    if not adversarial:
        return [], pd.DataFrame()
    measures = adversarial_measures(runs)
    rows: list[dict] = []
    lines = ["## Adversarial training: which family is most robust, and what it costs", "",
             f"Every number is top-1 (%) or a paired difference of top-1 (points) on the same images, with its "
             f"{ctx.level:.0%} percentile bootstrap interval over images ({ctx.n_boot} resamples, seed {ctx.seed}); "
             "(n.s.) marks a difference whose interval contains 0. An adversarially trained model is paired with the "
             "standard model of its architecture.", ""]
    lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    groups: dict[str, list[dict]] = {}
    for m in adversarial:
        groups.setdefault(training_label(m["training"]), []).append(m)
    for label, group in groups.items():
        eps, robust = _eps_255(group[0]["training"]), robust_key(group[0]["training"])
        ranked = sorted((m for m in group if robust in measures.get(m["model"], {})),
                        key=lambda m: -measures[m["model"]][robust].mean())
        lines += [f"### Under the same training ({label}): AutoAttack at {eps:g}/255", ""]
        if not ranked:
            lines += [f"No AutoAttack run at {eps:g}/255 of these models.", ""]
            continue
        best = ranked[0]
        lines += ["| model | family | robust top-1 [interval] | minus best |", "|:--|:--|--:|--:|"]
        tied = []
        for m in ranked:
            values = measures[m["model"]][robust]
            own = bootstrap_mean_ci(values, n_boot=ctx.n_boot, seed=ctx.seed, level=ctx.level)
            diff = None if m is best else _paired(values, measures[best["model"]][robust], ctx)
            if m is not best and not _resolved(diff):
                tied.append(m["model"])
            rows.append({"training": label, "question": "most_robust", "model": m["model"], "family": m["family"],
                         "value": own.value, "low": own.low, "high": own.high,
                         "minus_best": diff[0] if diff else np.nan, "minus_best_low": diff[1] if diff else np.nan,
                         "minus_best_high": diff[2] if diff else np.nan, "n": len(values)})
            lines.append(f"| {m['model']} | {m['family']} | {own} | {_cell(diff)} |")
        text = f"**Most robust under {label}:** {best['model']} ({best['family']})"
        if len(ranked) > 1:
            text += (f"; not resolved from {', '.join(tied)}, so its lead is not established on these images." if tied
                     else "; its lead over every other family is resolved.")
        if best["model"].endswith(MARK):
            text += (" A gradient-masking check flagged it: its robust accuracy may only say that the attack "
                     "failed.")
        lines += ["", text, ""]
        lines += _weakness_lines(group, models, measures, ctx, rows, label)
        lines += _gain_lines(group, measures, ctx, rows, label)
        lines += bai_comparison(ranked, measures, ctx, _baseline_arch(models, ctx.baseline), robust)
    return lines, pd.DataFrame(rows)


def _baseline_arch(models: list[dict], baseline: str) -> str:
    found = [m["arch"] for m in models if m["model"].split(" [")[0] == baseline]
    return found[0] if found else baseline


def _weakness_lines(group, models, measures, ctx, rows, label) -> list[str]:
    """Does SAN10 pairwise's weakness under gradient attacks (against the baseline's architecture)
    survive adversarial training? (module docstring)"""
    base_arch = _baseline_arch(models, ctx.baseline)
    weak = [m for m in group if m["arch"] == WEAK_ARCH]
    base = [m for m in group if m["arch"] == base_arch]
    if not weak or not base:
        return []
    weak, base = weak[0], base[0]
    lines = [f"**Does {WEAK_ARCH}'s weakness under gradient attacks survive adversarial training?** "
             f"{WEAK_ARCH} minus {base_arch} in robust top-1 (points; negative: weaker):", "",
             "| attack | standard training | adversarial training |", "|:--|--:|--:|"]
    weak_std, base_std = weak["standard"], base["standard"]
    std_keys = [k for k in measures.get(weak_std, {}) if k.startswith("grad:") and k in measures.get(base_std, {})]
    adv_keys = [k for k in measures.get(weak["model"], {}) if k.startswith("grad:") and k in measures[base["model"]]]
    weak_under: list[str] = []
    adv_at_eps = None
    eps_key = robust_key(weak["training"])
    for key in sorted(set(std_keys) | set(adv_keys)):
        std = _paired(measures[weak_std][key], measures[base_std][key], ctx) if key in std_keys else None
        adv = _paired(measures[weak["model"]][key], measures[base["model"]][key], ctx) if key in adv_keys else None
        if std is not None and std[2] < 0:
            weak_under.append(key[5:])
        if key == eps_key:
            adv_at_eps = adv
        for kind, d in (("standard", std), ("adversarial", adv)):
            if d is not None:
                rows.append({"training": label, "question": "weakness", "model": f"{WEAK_ARCH} minus {base_arch}",
                             "family": kind, "attack": key[5:], "value": d[0], "low": d[1], "high": d[2], "n": d[3]})
        lines.append(f"| {key[5:]} | {_cell(std)} | {_cell(adv)} |")
    missing = [f"{m['arch']}" for m in (weak, base) if not m["standard"]]
    if missing:
        verdict = (f"No standard {' or '.join(missing)} among the runs: the standard side of the question is not "
                   "measured.")
    elif not std_keys:
        verdict = (f"The standard {WEAK_ARCH} and {base_arch} ran no gradient attack in common: the standard side of "
                   "the question is not measured.")
    elif not weak_under:
        verdict = (f"Under standard training no gradient attack separates {WEAK_ARCH} from {base_arch} on these "
                   "images, so there is no weakness to follow.")
    elif adv_at_eps is None:
        verdict = f"Weaker under standard training ({', '.join(weak_under)}); no adversarial AutoAttack run to compare."
    elif adv_at_eps[2] < 0:
        verdict = (f"Yes: weaker under standard training ({', '.join(weak_under)}) and still weaker after adversarial "
                   f"training ({_cell(adv_at_eps)} at {eps_key[5:]}).")
    elif adv_at_eps[1] > 0:
        verdict = (f"No, the ranking flips: weaker under standard training ({', '.join(weak_under)}), stronger after "
                   f"adversarial training ({_cell(adv_at_eps)} at {eps_key[5:]}).")
    else:
        verdict = (f"Not established: weaker under standard training ({', '.join(weak_under)}), but after adversarial "
                   f"training the difference is not resolved ({_cell(adv_at_eps)} at {eps_key[5:]}).")
    return lines + ["", verdict, ""]


GAIN_COLUMNS = ((None, "robust top-1 (gain)"), ("clean", "clean top-1"), ("rotation", "rotated top-1"),
                ("corruption", "corrupted top-1"))


def _gain_lines(group, measures, ctx, rows, label) -> list[str]:
    """Per family: adversarial minus standard in each measure (module docstring)."""
    paired = [m for m in group if m["standard"]]
    if not paired:
        return []
    lines = ["**What adversarial training gains and costs, per family** (adversarial minus standard, points, paired "
             "per image; robust: AutoAttack at the training radius; rotated: mean over Table 9's four rotations; "
             "corrupted: mean over every corrupted condition):", "",
             "| family | adversarial | standard | " + " | ".join(t for _, t in GAIN_COLUMNS) + " |",
             "|:--|:--|:--|" + "--:|" * len(GAIN_COLUMNS)]
    for m in sorted(paired, key=lambda m: m["family"]):
        mine, theirs = measures.get(m["model"], {}), measures.get(m["standard"], {})
        cells = []
        for key, _ in GAIN_COLUMNS:
            key = key or robust_key(m["training"])
            d = _paired(mine[key], theirs[key], ctx) if key in mine and key in theirs else None
            cells.append(_cell(d))
            if d is not None:
                rows.append({"training": label, "question": "gain", "model": m["model"], "family": m["family"],
                             "standard": m["standard"], "measure": key.removeprefix("grad:"), "value": d[0], "low": d[1], "high": d[2],
                             "n": d[3]})
        lines.append(f"| {m['family']} | {m['model']} | {m['standard']} | " + " | ".join(cells) + " |")
    return lines + [""]


def bai_comparison(ranked, measures, ctx, base_arch: str, robust: str) -> list[str]:
    """Bai et al.'s finding beside ours: the best attention family minus the convolutional
    baseline's adversarial model, robust top-1, paired."""
    from robust_attn.models.reference import reference_table

    try:
        bai = reference_table("bai2021_adversarial")
    except FileNotFoundError:
        return []
    figures = " and ".join(f"{r['model']} {r['robust_top1']:.2f}%" for _, r in bai.iterrows())
    lines = [f"**Beside Bai et al.** ({bai['source'].iloc[0]}): adversarially trained with one recipe on ImageNet "
             f"({bai['notes'].iloc[0]}), AutoAttack leaves {figures}: the transformer's adversarial advantage over the "
             "convolution disappears."]
    conv = [m for m in ranked if m["arch"] == base_arch]
    attention = [m for m in ranked if m["arch"] != base_arch]
    if conv and attention:
        top = attention[0]
        d = _paired(measures[top["model"]][robust], measures[conv[0]["model"]][robust], ctx)
        verdict = ("agrees: no resolved difference" if not _resolved(d) else
                   "differs: the attention model is resolved ahead" if d[1] > 0 else
                   "differs: the convolution is resolved ahead")
        which = (f"the most robust of the {len(attention)} attention models" if len(attention) > 1
                 else "the attention model")
        after = " (chosen as the best after the fact, which favours it)" if len(attention) > 1 else ""
        lines[0] += (f" Here, on CIFAR-10 with local self-attention rather than a ViT: {which}, {top['model']}, "
                     f"minus {conv[0]['model']}: {_cell(d)} points, which {verdict}{after}.")
    return lines + [""]


@report_section("adversarial", order=50, protocols=("attack", "rotation", "corruption"))
def adversarial_section(ctx: ReportContext):
    from robust_attn.reports.formats import write_csv

    lines, table = adversarial_findings(ctx.runs, ctx)
    if not lines:
        return [], []
    files = [write_csv(table, ctx.out / "adversarial_training.csv")] if not table.empty else []
    return lines + (["Every number above, with its interval: `adversarial_training.csv`.", ""] if files else []), files
