"""What survives across scale: the findings of one zoo's study, tested again in another zoo.

``robust-attn report NEW_RUNS... --compare-zoo REFERENCE_RUNS... --out DIR`` writes
``across_scale.csv`` and ``report.md``: one row per finding of the reference zoo's study (the
width-0.25 CIFAR-10 zoo's, :data:`FINDINGS`), its statistic in each zoo with a paired bootstrap
interval over that zoo's images, and whether it holds.

Each finding is a statistic over one zoo's per-image losses (points, lower is better: the top-1
drop from the clean image, or the error under an attack), positive where the finding's claim is
true:

* ``less``: the models of ``better`` lose less than those of ``worse``. The statistic is the
  paired difference (:func:`robust_attn.reports.stats.bootstrap_mean_ci` of the per-image
  differences, one resample of images for both models) between the closest pair by point
  estimate, the best of ``worse`` minus the worst of ``better``, as the study's findings compare a
  leader with its runner-up. ``*`` stands for every other model of the zoo. Where the groups
  make more than one pair, each pair is tested (a runner-up by point estimate need not be the
  pair with the widest interval): the claim is *yes* where every pair's interval lies above 0,
  *no* where some pair's lies below 0, and the statistic shown is then that pair's (the one
  with the lowest estimate among them), else *unresolved*, shown at a pair whose interval covers
  0 (the closest such); ``detail`` names the pair and how many of the pairs were resolved.
* ``chance``: every model keeps less top-1 than chance (one over the classes): the error of the
  most robust model minus the chance-level error. Its loss is the per-image worst case over the
  attacks the zoo ran at the radius (an image counts as robust only where every attack failed), so
  a weaker attack's number never stands where a stronger one overturns it.
* ``rank``: two measures rank the models unlike each other: Kendall's tau with its interval and
  the flipped pairs resolved under both measures (:func:`robust_attn.reports.agreement.rank_agreement`);
  the claim is true where a flip is resolved, false where every resample keeps the same order.

In each zoo a finding is *yes* (interval above 0), *no* (below 0) or *unresolved* (the interval
covers 0); across the two zoos it *holds* (both resolved, the same way), *flips* (both resolved,
opposite ways) or is *unresolved* (either covers 0). Models are matched across zoos by their
architecture (``run.json``'s ``arch.name``, else the model's label), so the two zoos' labels
need not agree. Within a zoo each measure is taken on the largest image set all its models share
(the whole test set where a study ran it there, e.g. ``reports/study-cifar10-full`` beside the
2,000 images of ``reports/study-cifar10``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from robust_attn.protocols.pgd import PAPER_SETTINGS
from robust_attn.reports.agreement import rank_agreement
from robust_attn.reports.comparison import ROTATED
from robust_attn.reports.formats import to_markdown, write_csv
from robust_attn.reports.runs import Run
from robust_attn.reports.stats import bootstrap_mean_ci
from robust_attn.runs.store import load_description, load_records
from robust_attn.shifts.corruptions import FAMILIES
from robust_attn.utils.io import atomic_write_text

__all__ = ["Measure", "Finding", "FINDINGS", "OTHERS", "zoo_run_dirs", "load_zoo", "measure_losses",
           "worst_case", "check_finding", "across_verdict", "compare_zoos", "write_across_scale"]

#: in a finding's model groups: every model of the zoo not in the other group
OTHERS = "*"


@dataclass(frozen=True)
class Measure:
    """A per-image loss of every model: the top-1 drop from condition ``base`` to the mean over
    the selected conditions, or (``base`` None) the error, one minus the mean top-1 over them.
    Conditions: ``conditions`` (each must be there), else those starting with one of
    ``prefixes``, else every condition but ``base``; of runs of ``protocol``."""

    title: str
    protocol: str
    conditions: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    base: str | None = None

    def select(self, available) -> list[str]:
        available = [c for c in available if c != self.base]
        if self.conditions:
            return list(self.conditions) if set(self.conditions) <= set(available) else []
        return [c for c in available if not self.prefixes or c.startswith(self.prefixes)]


def _attack(name: str, title: str, radius: int) -> Measure:
    return Measure(f"{title} {radius}/255: robust error", "attack", (f"{name}_linf_eps{radius}",))


ROTATION = Measure("rotation: top-1 drop over Table 9's four rotations", "rotation", ROTATED, base="none")
TABLE10 = Measure("Table 10's targeted PGD {8, 2, 4}: top-1 drop", "pgd", (PAPER_SETTINGS[1].name,), base="clean")
NOISE_JPEG = Measure("noise and JPEG corruptions, severities 1-5: top-1 drop", "corruption",
                     prefixes=(*FAMILIES["noise"], "jpeg_compression"), base="clean")
CORRUPTIONS = Measure("every corruption and severity: top-1 drop", "corruption", base="clean")
APGD1, APGD2 = _attack("apgd-ce", "APGD-CE", 1), _attack("apgd-ce", "APGD-CE", 2)
AUTOATTACK2 = _attack("autoattack", "AutoAttack", 2)
SQUARE8, AUTOATTACK8 = _attack("square", "Square", 8), _attack("autoattack", "AutoAttack", 8)
APGD8 = _attack("apgd-ce", "APGD-CE", 8)
CLEAN = (Measure("clean error", "rotation", ("none",)), Measure("clean error", "corruption", ("clean",)),
         Measure("clean error", "attack", ("clean",)))


@dataclass(frozen=True)
class Finding:
    """A claim about a zoo's models, tested by a statistic positive where it is true (module
    docstring): ``kind`` ``less`` (``better`` loses less than ``worse``), ``chance`` or ``rank``
    (``measures[0]`` against ``against``). ``measures``: the first one a zoo has is used, or with
    ``worst_case`` the per-image largest loss over it and every later one it has on images it
    shares with them (:func:`worst_case`; a measure on other images is left out)."""

    key: str
    claim: str
    measures: tuple[Measure, ...]
    kind: str = "less"
    better: tuple[str, ...] = ()
    worse: tuple[str, ...] = ()
    against: Measure | None = None
    worst_case: bool = False


SAN10P, RESNET, SASA = ("san10_pairwise",), ("resnet26",), ("sasa_resnet26",)

#: the findings of the width-0.25 CIFAR-10 zoo's study (reports/study-cifar10, reports/study-cifar10-full)
FINDINGS: tuple[Finding, ...] = (
    Finding("rotation_vs_resnet26", "SAN10 pairwise loses less top-1 to rotation than ResNet-26", (ROTATION,),
            better=SAN10P, worse=RESNET),
    Finding("rotation_least", "SAN10 pairwise loses the least top-1 to rotation of all the models", (ROTATION,),
            better=SAN10P, worse=(OTHERS,)),
    Finding("table10_vs_resnet26", "SAN10 pairwise loses more top-1 than ResNet-26 to Table 10's targeted PGD",
            (TABLE10,), better=RESNET, worse=SAN10P),
    Finding("apgd1_vs_resnet26", "SAN10 pairwise is less robust than ResNet-26 under APGD-CE at 1/255", (APGD1,),
            better=RESNET, worse=SAN10P),
    Finding("apgd2_vs_resnet26", "SAN10 pairwise is less robust than ResNet-26 under APGD-CE at 2/255", (APGD2,),
            better=RESNET, worse=SAN10P),
    Finding("autoattack2_vs_resnet26", "SAN10 pairwise is less robust than ResNet-26 under AutoAttack at 2/255",
            (AUTOATTACK2,), better=RESNET, worse=SAN10P),
    Finding("apgd1_least", "SAN10 pairwise is the least robust of all the models under APGD-CE at 1/255", (APGD1,),
            better=(OTHERS,), worse=SAN10P),
    Finding("apgd1_san10_least", "The two SAN10 models are the least robust under APGD-CE at 1/255", (APGD1,),
            better=(OTHERS,), worse=("san10_pairwise", "san10_patchwise")),
    Finding("noise_jpeg_most", "SAN10 pairwise loses the most top-1 under the noise and JPEG corruptions",
            (NOISE_JPEG,), better=(OTHERS,), worse=SAN10P),
    Finding("sasa_apgd1", "SASA leads at small radii: the most robust under APGD-CE at 1/255", (APGD1,),
            better=SASA, worse=(OTHERS,)),
    Finding("sasa_apgd2", "SASA leads at small radii: the most robust under APGD-CE at 2/255", (APGD2,),
            better=SASA, worse=(OTHERS,)),
    Finding("none_robust_at_8", "No family keeps more than chance-level top-1 at 8/255 (every attack the zoo ran "
            "there: AutoAttack, APGD-CE, Square; the worst case per image)", (AUTOATTACK8, APGD8, SQUARE8),
            kind="chance", worst_case=True),
    Finding("corruptions_unlike_rotation", "The corruptions rank the models unlike rotation", (ROTATION,),
            kind="rank", against=CORRUPTIONS),
)


# --- a zoo's runs -----------------------------------------------------------------------------
def zoo_run_dirs(paths) -> list[Path]:
    """The run directories of a zoo given as run directories, folders of runs (a study's
    ``--runs``) or report folders (their packed ``runs/``)."""
    found: list[Path] = []
    for path in map(Path, paths):
        if (path / "run.json").is_file():
            found.append(path)
            continue
        for folder in (path, path / "runs"):
            inside = sorted(p.parent for p in folder.glob("*/run.json"))
            if inside:
                found += inside
                break
        else:
            raise ValueError(f"{path} holds no runs: give run directories (with run.json), a folder of them (a "
                             f"study's --runs) or a report folder with its packed runs/")
    return list(dict.fromkeys(found))


def load_zoo(paths, protocols=None) -> list[Run]:
    """The finished runs of a zoo (:func:`zoo_run_dirs`) of ``protocols`` (default: those the
    findings read); the others' records are not read."""
    wanted = set(protocols or {m.protocol for f in FINDINGS for m in (*f.measures, f.against) if m} |
                 {m.protocol for m in CLEAN})
    runs = []
    for path in zoo_run_dirs(paths):
        description = load_description(path)
        if description["protocol"] in wanted:
            runs.append(Run(path, description, load_records(path)))
    return runs


def _architecture(run: Run) -> str:
    return (run.description.get("arch") or {}).get("name") or run.model


def measure_losses(runs: list[Run], measure: Measure, hits: dict | None = None) -> pd.DataFrame | None:
    """Image x model table of ``measure``'s per-image loss (0-1), on the largest image set that
    the most models share; None where no run holds it. Models are named by architecture; two
    runs of one architecture on one image set are an error. ``hits``: a dict to keep each run's
    image x condition top-1 table in, for the next measure."""
    by_set: dict[tuple, dict[str, pd.Series]] = {}
    hits = {} if hits is None else hits
    for run in runs:
        if run.protocol != measure.protocol or not len(run.records):
            continue
        if id(run) not in hits:
            hits[id(run)] = run.records.pivot_table(index="index", columns="condition", values="top1",
                                                    aggfunc="first")
        table = hits[id(run)]
        chosen = measure.select(table.columns)
        if not chosen or (measure.base is not None and measure.base not in table):
            continue
        loss = (table[measure.base] if measure.base is not None else 1.0) - table[chosen].mean(axis=1)
        images = (json.dumps(run.description.get("dataset"), sort_keys=True), len(table))
        held = by_set.setdefault(images, {})
        name = _architecture(run)
        if name in held:
            raise ValueError(f"two runs of {name} hold {measure.title} on the same images ({run.path} is one); "
                             f"give each zoo one model per architecture")
        held[name] = loss.astype(float)
    if not by_set:
        return None
    best = max(by_set, key=lambda k: (len(by_set[k]), k[1]))
    return pd.DataFrame(by_set[best]).sort_index(axis=1).dropna()


# --- one finding in one zoo -------------------------------------------------------------------
def _verdict(low: float, high: float) -> str:
    return "yes" if low > 0 else "no" if high < 0 else "unresolved"


def _group(names: tuple[str, ...], other: tuple[str, ...], models: list[str]) -> list[str] | None:
    """The models of a group (``*``: every model not named in ``other``); None if one is missing."""
    if OTHERS in names:
        return [m for m in models if m not in other]
    return list(names) if set(names) <= set(models) else None


def worst_case(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Per image and model, the largest of the losses in ``frames`` (image x model tables of
    :func:`measure_losses`), on the images and models all of them hold; the first frame alone
    where they share none."""
    images = frames[0].index
    models = frames[0].columns
    for frame in frames[1:]:
        images, models = images.intersection(frame.index), models.intersection(frame.columns)
    if not len(images) or not len(models):
        return frames[0]
    largest = np.maximum.reduce([f.loc[images, models].to_numpy() for f in frames])
    return pd.DataFrame(largest, index=images, columns=models)


def check_finding(finding: Finding, losses: dict[Measure, pd.DataFrame | None], n_boot: int = 1000, seed: int = 0,
                 level: float = 0.95, num_classes: int = 10) -> dict:
    """The statistic of ``finding`` in one zoo (``losses``: each measure's table,
    :func:`measure_losses`): ``value``, ``low``, ``high`` (points; for ``rank`` Kendall's tau),
    ``n`` images, ``measure``, ``detail`` (which models it compares) and ``verdict`` (yes, no,
    unresolved, or ``not measured`` where the zoo lacks the measure or a named model)."""
    absent = {"value": float("nan"), "low": float("nan"), "high": float("nan"), "n": 0, "measure": "-",
              "detail": "", "verdict": "not measured"}
    held = [m for m in finding.measures if losses.get(m) is not None]
    if not held:
        return absent
    measure, frame = held[0], losses[held[0]]
    shown = {"measure": measure.title, "n": len(frame)}
    if finding.worst_case and len(held) > 1:
        used = [measure]
        for other in held[1:]:
            combined = worst_case([frame, losses[other]])
            if combined is not frame:
                frame, used = combined, used + [other]
        if len(used) > 1:
            shown = {"measure": "worst case of " + ", ".join(m.title for m in used), "n": len(frame)}
    if finding.kind == "rank":
        other = losses.get(finding.against)
        if other is None or len(set(frame.columns) & set(other.columns)) < 3:
            return absent
        result = rank_agreement(frame, other, n_boot=n_boot, seed=seed, level=level)
        resolved = len(result.resolved_flips)
        verdict = "yes" if resolved else "no" if not result.flips and result.low >= 1 else "unresolved"
        return {**shown, "measure": f"{measure.title} against {finding.against.title}", "value": result.tau,
                "low": result.low, "high": result.high, "verdict": verdict,
                "detail": f"Kendall's tau; {len(result.flips)} pairs flip, {resolved} resolved under both"}
    means = frame.mean()
    models = list(frame.columns)
    if finding.kind == "chance":
        best = means.idxmin()
        chance_error = 1 - 1 / num_classes
        ci = bootstrap_mean_ci(frame[best] - chance_error, n_boot=n_boot, seed=seed, level=level)
        detail = f"chance-level top-1 {100 / num_classes:.0f}% minus {best}'s ({100 * (1 - means[best]):.1f}%)"
    else:
        better = _group(finding.better, finding.worse, models)
        worse = _group(finding.worse, finding.better, models)
        if not better or not worse:
            return absent
        pairs = sorted(((b, w) for b in better for w in worse if b != w),
                       key=lambda pair: means[pair[1]] - means[pair[0]])   # the closest pair first
        if not pairs:
            return absent
        cis = {pair: bootstrap_mean_ci(frame[pair[1]] - frame[pair[0]], n_boot=n_boot, seed=seed, level=level)
               for pair in pairs}
        verdicts = {pair: _verdict(ci.low, ci.high) for pair, ci in cis.items()}
        verdict = "no" if "no" in verdicts.values() else "yes" if set(verdicts.values()) == {"yes"} else "unresolved"
        shown_pair = next(pair for pair in pairs if verdicts[pair] == verdict)
        ci = cis[shown_pair]
        detail = f"{shown_pair[1]} minus {shown_pair[0]}"
        if len(pairs) > 1:
            resolved = sum(v == "yes" for v in verdicts.values())
            detail += f"; {resolved} of {len(pairs)} pairs resolved as the claim says"
        return {**shown, "value": ci.value, "low": ci.low, "high": ci.high, "detail": detail, "verdict": verdict}
    return {**shown, "value": ci.value, "low": ci.low, "high": ci.high, "detail": detail,
            "verdict": _verdict(ci.low, ci.high)}


def across_verdict(reference: str, other: str) -> str:
    """holds, flips or unresolved (module docstring); ``holds (false in both)`` where both zoos
    resolve the claim as false; ``not measured`` where a zoo lacks it."""
    if "not measured" in (reference, other):
        return "not measured"
    if "unresolved" in (reference, other):
        return "unresolved"
    if reference != other:
        return "flips"
    return "holds" if reference == "yes" else "holds (false in both)"


def _zoo_summary(runs: list[Run]) -> str:
    for measure in CLEAN:
        frame = measure_losses(runs, measure)
        if frame is not None:
            top1 = 100 * (1 - frame.mean())
            return (f"{len(top1)} models ({', '.join(top1.index)}), clean top-1 {top1.min():.1f}-{top1.max():.1f}% "
                    f"on {len(frame):,} images")
    return f"{len({_architecture(r) for r in runs})} models"


def compare_zoos(reference: list[Run], other: list[Run], findings=FINDINGS, n_boot: int = 1000, seed: int = 0,
                 level: float = 0.95) -> pd.DataFrame:
    """One row per finding and zoo (``zoo``: ``reference`` or ``other``; ``dataset``: the zoo's
    runs'), with ``across``: the verdict across the two (:func:`across_verdict`)."""
    rows = []
    zoos = {"reference": (reference, {}, {}), "other": (other, {}, {})}   # runs, losses by measure, hits by run
    for finding in findings:
        verdicts = {}
        for zoo, (runs, known, hits) in zoos.items():
            wanted = [*finding.measures, *([finding.against] if finding.against else [])]
            for m in wanted:
                if m not in known:
                    known[m] = measure_losses(runs, m, hits)
            losses = {m: known[m] for m in wanted}
            classes = next((r.num_classes for r in runs if r.num_classes), 10)
            result = check_finding(finding, losses, n_boot=n_boot, seed=seed, level=level, num_classes=classes)
            verdicts[zoo] = result["verdict"]
            rows.append({"finding": finding.key, "claim": finding.claim, "kind": finding.kind, "zoo": zoo,
                         "dataset": ",".join(sorted({r.dataset for r in runs})), **result})
        for row in rows[-2:]:
            row["across"] = across_verdict(verdicts["reference"], verdicts["other"])
    return pd.DataFrame(rows)


def _cell(row) -> str:
    if row["verdict"] == "not measured":
        return "not measured"
    digits = 2 if row["kind"] == "rank" else 1   # Kendall's tau, else points
    return (f"{row['verdict']}: {row['value']:+.{digits}f} [{row['low']:+.{digits}f}, {row['high']:+.{digits}f}] "
            f"({row['detail']}; {row['n']:,} images)")


def _label(paths) -> str:
    names = []
    for path in map(Path, paths):
        path = path.resolve()
        folder = path.parent if (path / "run.json").is_file() else path
        names.append(folder.parent.name if folder.name == "runs" else folder.name)
    return " + ".join(dict.fromkeys(names))


def write_across_scale(reference_paths, other_paths, out_dir, n_boot: int = 1000, seed: int = 0,
                       level: float = 0.95) -> list[Path]:
    """``across_scale.csv``, ``report.md`` and ``report.html`` in ``out_dir``: every finding of
    :data:`FINDINGS` in the zoo of ``reference_paths`` beside the zoo of ``other_paths``."""
    reference, other = load_zoo(reference_paths), load_zoo(other_paths)
    for runs, paths in ((reference, reference_paths), (other, other_paths)):
        if not runs:
            raise ValueError(f"{', '.join(map(str, paths))}: no run of rotation, Table 10's PGD, the corruptions or "
                             f"the attacks, which the findings read")
    table = compare_zoos(reference, other, n_boot=n_boot, seed=seed, level=level)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [write_csv(table, out / "across_scale.csv")]
    names = {"reference": _label(reference_paths), "other": _label(other_paths)}
    if names["reference"] == names["other"]:   # the table's two columns need two names
        names = {zoo: f"{name} ({zoo})" for zoo, name in names.items()}
    rows = []
    for finding in dict.fromkeys(table["finding"]):
        pair = table[table["finding"] == finding].set_index("zoo")
        rows.append({"finding": pair["claim"].iloc[0], names["reference"]: _cell(pair.loc["reference"]),
                     names["other"]: _cell(pair.loc["other"]), "across scale": pair["across"].iloc[0]})
    counts = table.drop_duplicates("finding")["across"].value_counts()
    md = ["# What survives across scale", "",
          f"The findings of **{names['reference']}** ({_zoo_summary(reference)}) tested again in "
          f"**{names['other']}** ({_zoo_summary(other)}).", "",
          f"Each cell: the finding's statistic in that zoo (points, or Kendall's tau for a ranking), its "
          f"{level:.0%} paired bootstrap interval over the zoo's images ({n_boot} resamples, seed {seed}) and the "
          "models it compares; positive where the claim is true. yes: the interval lies above 0; no: below; "
          "unresolved: it covers 0. A ranking's tau is 1 where the two measures order the models alike, so "
          "there yes means a pair of models flips order and every resample keeps the flip, no that no pair "
          "flips and tau's interval is 1. Across scale a finding holds (both zoos resolve it the same way), flips "
          "(opposite ways) or is unresolved (either interval covers 0). Definitions: "
          "`robust_attn/reports/across_scale.py`.", "",
          to_markdown(pd.DataFrame(rows)), "",
          "In all: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + ".", ""]
    atomic_write_text(out / "report.md", "\n".join(md))
    files.append(out / "report.md")
    from robust_attn.reports.html import write_html

    files.append(write_html(out, title="What survives across scale"))
    return files
