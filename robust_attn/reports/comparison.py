"""Which model loses least? Paired bootstrap comparisons of robustness across models.

SAN section 5.4 reads Tables 9 and 10 as "which architecture loses least". Here that reading
is made explicit and given an uncertainty. Every measure is a mean over images of a per-image
loss, so two models evaluated on the same images can be compared image by image:

* ``rotation_drop``: top-1 hit on the unrotated image minus the mean hit over the four rotated
  conditions of Table 9 (90°, 180°, 270° clockwise and upside-down), in points.
* ``pgd_drop:<setting>``: top-1 hit on the clean image minus the hit under that targeted PGD
  setting (every setting the runs share: Table 10's two and any eps sweep), in points.
* ``pgd_success:<setting>``: targeted attack success (prediction equals the target), in %.
* ``attack_drop:<condition>``: top-1 hit on the clean image minus the hit under an evaluation
  attack of the ``attack`` protocol (AutoAttack, Square, ...), in points.
* ``shift_drop:<protocol>``: top-1 hit on the clean image minus the mean hit over every
  shifted condition of a shift protocol (corruption, occlusion, shuffle), in points.

Lower is better for all four. For each measure the model with the lowest mean is "best"; the
difference of every other model to it, and to the convolutional baseline, is bootstrapped over
images *paired* (one resample of image indices serves both models), which is what makes a
difference of a few tenths of a point resolvable on 10,000 images when the separate intervals
overlap. A difference whose interval contains 0 is reported as not resolved.

A drop starts from the model's own clean top-1, so a model with less to lose can lose least
and still keep less (an adversarially trained one beside standard ones): for every drop the
rows also carry the clean top-1 and the top-1 under the condition, and the finding says when
the model that loses least keeps a resolved lower top-1 than the model that keeps most.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pandas as pd

from robust_attn.protocols.pgd import CLEAN, PAPER_SETTINGS
from robust_attn.reports.attacks import ATTACK_LABELS
from robust_attn.reports.runs import model_names
from robust_attn.protocols.report_section import shift_protocols
from robust_attn.reports.stats import bootstrap_mean_ci

__all__ = ["per_image_losses", "compare_models", "findings_text", "agreement_findings", "ROTATED",
           "DEFAULT_BASELINE", "HEADLINE_MEASURES", "AGREEMENT_REFERENCES"]

ROTATED = ("cw90", "cw180", "cw270", "flip_ud")  # Table 9's four rotated conditions
DEFAULT_BASELINE = "resnet26"
_HEADLINE_PGD = PAPER_SETTINGS[1].name           # {8, 2, 4}: the stronger of Table 10's two settings
HEADLINE_MEASURES = ["rotation_drop", f"pgd_drop:{_HEADLINE_PGD}", f"pgd_success:{_HEADLINE_PGD}"]
#: which measures each SAN measure is checked against (:func:`agreement_findings`): Table 10's
#: {8, 2, 4} against every evaluation attack, rotation against every other shift (measure key
#: prefixes; a shift protocol names its measures ``shift_drop:<condition>``)
AGREEMENT_REFERENCES = {f"pgd_drop:{_HEADLINE_PGD}": ("attack_drop:",), "rotation_drop": ("shift_drop:",)}


@dataclass(frozen=True)
class Measure:
    key: str
    title: str
    unit: str


def _measure(key: str) -> Measure:
    kind, _, setting = key.partition(":")
    if kind == "rotation_drop":
        return Measure(key, "rotation: mean top-1 drop over 90°, 180°, 270° and upside-down", "points")
    if kind == "attack_drop":
        return Measure(key, f"{_attack_label(setting)}: top-1 drop (clean minus attacked)", "points")
    if kind == "shift_drop":
        return Measure(key, f"{setting}: mean top-1 drop over every shifted condition", "points")
    label = _setting_label(key)
    if kind == "pgd_drop":
        return Measure(key, f"targeted PGD ({label}): top-1 drop (clean minus attacked)", "points")
    return Measure(key, f"targeted PGD ({label}): attack success rate", "%")


def _hits(records: pd.DataFrame, column: str) -> pd.DataFrame:
    """image index x condition table of a 0/1 column."""
    return records.pivot_table(index="index", columns="condition", values=column, aggfunc="first")


def per_image_losses(runs) -> dict[tuple[str, str], pd.DataFrame]:
    """``{(image set, measure key): DataFrame (image index x model)}`` from finished runs.

    The image set is the run's dataset description (name, split, limit) as JSON: only runs on
    the same images are compared. A model with several runs of a protocol contributes each
    condition once (the first run that has it). Models are named by
    :func:`~robust_attn.reports.runs.model_names` (two checkpoints of one model stay apart)."""
    return _per_image(runs)[0]


def _per_image(runs) -> tuple[dict, dict]:
    """:func:`per_image_losses`, and beside it for every drop measure the clean top-1 hits its
    losses start from (same keys, same images and models; a measure that is no drop has none)."""
    columns: dict[tuple[str, str], dict[str, pd.Series]] = {}
    cleans: dict[tuple[str, str], dict[str, pd.Series]] = {}
    names = model_names(runs)

    def put(run, key: str, values: pd.Series, clean: pd.Series | None = None) -> None:
        images = json.dumps(run.description["dataset"], sort_keys=True)
        if names[id(run)] in columns.get((images, key), {}):
            return
        columns.setdefault((images, key), {})[names[id(run)]] = values.astype(float)
        if clean is not None:
            cleans.setdefault((images, key), {})[names[id(run)]] = clean.astype(float)

    shift_kinds = shift_protocols()
    for run in runs:
        if run.protocol == "rotation":
            top1 = _hits(run.records, "top1")
            if "none" in top1 and all(c in top1 for c in ROTATED):
                put(run, "rotation_drop", top1["none"] - top1[list(ROTATED)].mean(axis=1), top1["none"])
        elif run.protocol == "attack":
            top1 = _hits(run.records, "top1")
            for condition in (c for c in top1.columns if c != CLEAN and CLEAN in top1):
                put(run, f"attack_drop:{condition}", top1[CLEAN] - top1[condition], top1[CLEAN])
        elif run.protocol in shift_kinds:
            top1 = _hits(run.records, "top1")
            shifted = [c for c in top1.columns if c != CLEAN]
            if CLEAN in top1 and shifted:
                put(run, f"shift_drop:{run.protocol}", top1[CLEAN] - top1[shifted].mean(axis=1), top1[CLEAN])
        elif run.protocol == "pgd":
            top1, success = _hits(run.records, "top1"), _hits(run.records, "success")
            for setting in (c for c in top1.columns if c != CLEAN):
                if CLEAN in top1:
                    put(run, f"pgd_drop:{setting}", top1[CLEAN] - top1[setting], top1[CLEAN])
                put(run, f"pgd_success:{setting}", success[setting])
    ordered = sorted(columns, key=lambda k: (k[0], _measure_order(k[1])))   # independent of the runs' order
    losses = {key: pd.DataFrame(columns[key]).sort_index(axis=1).dropna() for key in ordered}
    clean = {key: pd.DataFrame(cleans[key]).reindex(index=losses[key].index, columns=losses[key].columns)
             for key in ordered if key in cleans}
    return losses, clean


def _measure_order(key: str) -> tuple:
    kind, _, setting = key.partition(":")
    if kind == "rotation_drop":
        return (0,)
    if kind in ("attack_drop", "shift_drop"):
        return (3 if kind == "attack_drop" else 4, setting)
    return (1 if kind == "pgd_drop" else 2, *_setting_order(key))


def _attack_label(condition: str) -> str:
    """``"autoattack_linf_eps8"`` -> ``"AutoAttack 8/255"`` (a condition name of the attack
    protocol, :meth:`robust_attn.attacks.base.AttackConfig.name`); other names as they are."""
    parts = condition.split("_")
    if len(parts) < 3 or parts[1] not in ("linf", "l2") or not parts[2].startswith("eps"):
        return condition
    name = ATTACK_LABELS.get(parts[0], parts[0])
    size = parts[2][3:]
    extra = f" ({', '.join(parts[3:])})" if len(parts) > 3 else ""
    return (f"{name} {size}/255" if parts[1] == "linf" else f"{name} L2 {size.replace('p', '.')}") + extra


def _families(runs) -> dict[str, str]:
    """``{model name: family}`` from the architecture each run records (a label such as
    ``resnet26-adv`` names no architecture; its run's ``arch`` does), else from the name."""
    from robust_attn.models.registry import model_info

    families, names = {}, model_names(runs)
    for run in runs:
        name = names[id(run)]
        arch = (run.description.get("arch") or {}).get("name") or name.split(" (")[0]
        try:
            families.setdefault(name, model_info(arch).family)
        except (KeyError, ValueError):
            families.setdefault(name, "")
    return families


def compare_models(runs, n_boot: int = 1000, seed: int = 0, level: float = 0.95,
                   baseline: str = DEFAULT_BASELINE) -> pd.DataFrame:
    """One row per (image set, measure, model): the mean loss with its interval, and the paired
    differences to the best model and to ``baseline`` with theirs (``nan`` where not defined).
    Rows of a measure are sorted best first (``rank`` 1)."""
    rows, families = [], _families(runs)
    all_losses, all_clean = _per_image(runs)
    for (images, key), losses in all_losses.items():
        if losses.empty:
            continue
        means = losses.mean().sort_values(kind="stable")
        best, measure = means.index[0], _measure(key)
        clean = all_clean.get((images, key))
        top = None if clean is None else (clean - losses).mean().sort_values(ascending=False, kind="stable").index[0]
        for rank, model in enumerate(means.index, start=1):
            own = bootstrap_mean_ci(losses[model], n_boot=n_boot, seed=seed, level=level)
            row = {"images": images, "measure": key, "title": measure.title, "unit": measure.unit,
                   "rank": rank, "model": model, "family": families.get(model, ""), "value": own.value,
                   "low": own.low, "high": own.high, "n": len(losses), "level": level, "n_boot": n_boot}
            for name, other in (("best", best), ("baseline", baseline)):
                if other in losses and other != model:
                    diff = bootstrap_mean_ci(losses[model] - losses[other], n_boot=n_boot, seed=seed, level=level)
                    row.update({f"minus_{name}": diff.value, f"minus_{name}_low": diff.low,
                                f"minus_{name}_high": diff.high})
                else:
                    row.update({f"minus_{name}": np.nan, f"minus_{name}_low": np.nan, f"minus_{name}_high": np.nan})
            row.update(_kept(clean, losses, model, top, n_boot, seed, level))
            rows.append(row)
    return pd.DataFrame(rows)


def _kept(clean: pd.DataFrame | None, losses: pd.DataFrame, model: str, top: str | None, n_boot: int, seed: int,
          level: float) -> dict:
    """For a drop measure: the model's clean top-1 and its top-1 under the measure's conditions
    (clean minus drop, %), the model with the highest such top-1 (``kept_top``), and the paired
    difference of the model's from it (points; nan for that model itself and for a measure that
    is no drop)."""
    row = {"clean": np.nan, "kept": np.nan, "kept_top": "", "kept_minus_top": np.nan,
           "kept_minus_top_low": np.nan, "kept_minus_top_high": np.nan}
    if clean is None:
        return row
    kept = clean - losses
    row.update(clean=100 * clean[model].mean(), kept=100 * kept[model].mean(), kept_top=top)
    if model != top:
        diff = bootstrap_mean_ci(kept[model] - kept[top], n_boot=n_boot, seed=seed, level=level)
        row.update(kept_minus_top=diff.value, kept_minus_top_low=diff.low, kept_minus_top_high=diff.high)
    return row


_KEPT = {"rotation_drop": "rotated top-1 (mean over the four rotations)", "pgd_drop": "top-1 under the attack",
         "attack_drop": "top-1 under the attack", "shift_drop": "top-1 under the shift"}


def _resolved(low: float, high: float) -> bool:
    return low > 0 or high < 0


def _diff(value: float, low: float, high: float) -> str:
    if np.isnan(value):
        return "-"
    return f"{value:+.2f} [{low:+.2f}, {high:+.2f}]" + ("" if _resolved(low, high) else " (n.s.)")


def _sentence(group: pd.DataFrame) -> str:
    first = group.iloc[0]
    text = (f"**{first['title']}**: {first['model']} loses least ({first['value']:.2f} {first['unit']}, "
            f"{first['level']:.0%} interval [{first['low']:.2f}, {first['high']:.2f}]).")
    from robust_attn.reports.masking_marks import MARK

    if str(first["model"]).endswith(MARK):
        text += (" Its lead is not evidence of robustness: a gradient-masking check flagged it, so its attacked "
                 "numbers may only say that the attack failed.")
    if len(group) > 1:
        second = group.iloc[1]
        if _resolved(second["minus_best_low"], second["minus_best_high"]):
            text += (f" The runner-up, {second['model']}, loses {second['minus_best']:.2f} {first['unit']} more "
                     f"[{second['minus_best_low']:.2f}, {second['minus_best_high']:.2f}]: the lead is resolved.")
        else:
            tied = [r["model"] for _, r in group.iloc[1:].iterrows()
                    if not _resolved(r["minus_best_low"], r["minus_best_high"])]
            text += (f" Not resolved from {', '.join(tied)} (paired differences whose interval contains 0), "
                     f"so the lead is not established on these {int(first['n'])} images.")
        if len(group) > 2:
            worst = group.iloc[-1]
            text += f" Last: {worst['model']} ({worst['value']:.2f} {first['unit']})."
    if first.get("kept_top", "") not in ("", first["model"]) and first["kept_minus_top_high"] < 0:
        top = group[group["model"] == first["kept_top"]].iloc[0]
        text += (f" A drop counts what a model loses from its own clean top-1 ({first['clean']:.2f}%): "
                 f"{first['model']}'s {_KEPT.get(first['measure'].partition(':')[0], 'top-1')} itself, "
                 f"{first['kept']:.2f}%, is {-first['kept_minus_top']:.2f} points "
                 f"[{-first['kept_minus_top_high']:.2f}, {-first['kept_minus_top_low']:.2f}] below "
                 f"{first['kept_top']}'s {top['kept']:.2f}%, the highest.")
    return text


def findings_text(comparison: pd.DataFrame, baseline: str = DEFAULT_BASELINE) -> list[str]:
    """Markdown lines: a sentence and a table per headline measure (rotation; Table 10's
    {8, 2, 4} setting), a compact table of the top-1 drop for every shared PGD setting, then the
    evaluation attacks' drops and their paired differences from ``baseline``."""
    if comparison.empty:
        return []
    lines = []
    for images, frame in comparison.groupby("images", sort=False):
        described = json.loads(images)
        lines += [f"Image set: {described.get('name')} / {described.get('split')}"
                  + (f" (limit {described['limit']})" if described.get("limit") else "")
                  + f", {int(frame['n'].iloc[0])} images. Lower is better everywhere; intervals are "
                  f"{frame['level'].iloc[0]:.0%} percentile bootstrap over images ({int(frame['n_boot'].iloc[0])} "
                  "resamples), differences paired image by image; (n.s.) marks a difference whose interval "
                  "contains 0.", ""]
        for key in HEADLINE_MEASURES:
            group = frame[frame["measure"] == key].sort_values("rank")
            if group.empty:
                continue
            lines += [_sentence(group), "",
                      f"| model | family | {group['unit'].iloc[0]} [interval] | minus best | minus {baseline} |",
                      "|:--|:--|--:|--:|--:|"]
            for _, r in group.iterrows():
                lines.append(f"| {r['model']} | {r['family']} | {r['value']:.2f} [{r['low']:.2f}, {r['high']:.2f}] | "
                             f"{_diff(r['minus_best'], r['minus_best_low'], r['minus_best_high'])} | "
                             f"{_diff(r['minus_baseline'], r['minus_baseline_low'], r['minus_baseline_high'])} |")
            lines.append("")
        drops = frame[frame["measure"].str.startswith("pgd_drop:")]
        if drops["measure"].nunique() > 1:
            table = drops.pivot_table(index="model", columns="measure", values="value", sort=False)
            order = sorted(table.columns, key=_setting_order)
            table = table[order].sort_values(order[-1])
            lines += ["Top-1 drop (points) under every PGD setting the runs share (eps and step in 1/255):", "",
                      "| model | " + " | ".join(_setting_label(c) for c in order) + " |",
                      "|:--|" + "--:|" * len(order)]
            lines += [f"| {model} | " + " | ".join(f"{v:.1f}" for v in row) + " |" for model, row in table.iterrows()]
            lines.append("")
        lines += _attack_drop_tables(frame[frame["measure"].str.startswith("attack_drop:")], baseline)
    return lines


def _attack_drop_tables(drops: pd.DataFrame, baseline: str) -> list[str]:
    """The evaluation attacks (AutoAttack, Square, ...): the top-1 drop per model and
    attack with its interval, then its paired difference from ``baseline``; models in the order
    of the first attack's drop, attacks in the comparison's order."""
    if drops.empty:
        return []
    measures = list(drops["measure"].unique())
    label = {m: drops.loc[drops["measure"] == m, "title"].iloc[0].split(":")[0] for m in measures}
    counts = sorted({int(n) for n in drops["n"]})
    by = {(r["model"], r["measure"]): r for _, r in drops.iterrows()}
    models = list(drops[drops["measure"] == measures[0]].sort_values("rank")["model"])
    models += [m for m in dict.fromkeys(drops["model"]) if m not in models]
    head = ["| model | " + " | ".join(label[m] for m in measures) + " |", "|:--|" + "--:|" * len(measures)]

    def cell(model, measure, fmt) -> str:
        r = by.get((model, measure))
        return "-" if r is None else fmt(r)

    lines = [f"Top-1 drop (points, clean minus attacked) under each evaluation attack, on "
             f"{' or '.join(map(str, counts))} attacked images, with its interval; lower is better. The drop "
             "counts clean accuracy too: where an attack leaves every model near 0%, it ranks clean accuracy "
             "(robust top-1 itself: the Robust accuracy section):", "", *head]
    lines += [f"| {model} | " + " | ".join(cell(model, m, lambda r: f"{r['value']:.1f} [{r['low']:.1f}, {r['high']:.1f}]")
                                          for m in measures) + " |" for model in models]
    lines += ["", f"Paired difference from {baseline} (points; negative: loses less than {baseline}):", "", *head]
    lines += [f"| {model} | " + " | ".join(cell(model, m, lambda r: _diff(r["minus_baseline"], r["minus_baseline_low"],
                                                                       r["minus_baseline_high"]))
                                          for m in measures) + " |" for model in models]
    return lines + [""]


def _setting_order(measure: str) -> tuple:
    from robust_attn.protocols.pgd import parse_setting_name

    setting = parse_setting_name(measure.partition(":")[2])
    return (setting.steps, setting.eps, setting.step)


def _setting_label(measure: str) -> str:
    """``"pgd_drop:pgd_eps8_step2_n4"`` -> ``"eps 8, step 2, n 4"`` (1/255 units)."""
    from robust_attn.protocols.pgd import parse_setting_name

    s = parse_setting_name(measure.partition(":")[2])
    return f"eps {s.eps:g}, step {s.step:g}, n {s.steps}"


def agreement_findings(runs, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> list[str]:
    """Markdown lines: does each SAN measure rank the models as the stronger or other measures do
    (:data:`AGREEMENT_REFERENCES`; Kendall's tau and the flipped pairs, :mod:`robust_attn.reports.agreement`)?
    Measures on different image sets (e.g. Table 10 on the whole test set, AutoAttack on a seeded
    subset) are compared too, resampled separately. Empty when no pair of measures exists."""
    from robust_attn.reports.agreement import agreement_lines, rank_agreement

    losses = per_image_losses(runs)
    by_key: dict[str, list[pd.DataFrame]] = {}
    for (_, key), frame in losses.items():
        by_key.setdefault(key, []).append(frame)
    lines: list[str] = []
    for reference, prefixes in AGREEMENT_REFERENCES.items():
        for key in (k for k in by_key if k.startswith(prefixes)):
            for ref_frame in by_key.get(reference, []):
                for frame in by_key[key]:
                    if len(set(ref_frame.columns) & set(frame.columns)) < 3:
                        continue    # fewer than 3 models share both: no ranking to speak of
                    result = rank_agreement(ref_frame, frame, n_boot=n_boot, seed=seed, level=level)
                    lines += agreement_lines(_measure(reference).title, _measure(key).title, result)
    if lines:
        lines = ["## Do the measures rank the models alike?", "",
                 "Kendall's tau between the models' mean losses under a SAN measure and under a stronger or "
                 "different one; a pair of models that changes order counts as resolved only when both measures "
                 "separate the two (paired bootstrap interval of their difference excludes 0).", ""] + lines
    return lines
