"""Gradient-masking checks as a protocol: per model, from its attack runs and its own probes.

The checks themselves are :mod:`robust_attn.attacks.masking`; this module gathers their inputs
from the run directories and saves their verdicts (``checks.json``: name, verdict, detail,
evidence) beside a small run of its own, so the report can show them and ``report`` can derive
them again from what was saved.

In the study (step ``masking``, after ``apgd``, ``autoattack``, ``square`` and ``transfer``), for each
model:

* ``blackbox_beats_whitebox``: the white-box part of AutoAttack at the largest eps (images
  misclassified already, or fooled by APGD-CE, APGD-T or FAB-T: AutoAttack's records name the
  member in ``by``) against Square alone at the same eps, against AutoAttack's own Square member
  (an image only Square fooled inside AutoAttack is the same evidence), and against the
  untargeted transfer attack from every other model at 8/255. Where AutoAttack did not run at
  Square's eps or at 8/255 (a study of AutoAttack at 2/255 with Square at 8/255), the white-box
  attack there is APGD-CE from the ``apgd`` step, when it ran at that eps; the source's name then
  says so (``square 8/255 (against APGD-CE 8/255)``), and without either the source is not
  compared. Against APGD-CE alone, the images a source fools and APGD-CE does not are attacked
  again with AutoAttack's other white-box members, APGD-T and then FAB-T
  (:mod:`robust_attn.attacks.masking.followup`; per image in ``whitebox_followup.csv``), and
  count against the white-box attack only where those fail too. An image a source still wins is
  a near miss, reported and not counted, where PGD from the clean image closes at least half of
  its clean margin (:mod:`robust_attn.attacks.masking.near_miss`; per image in
  ``whitebox_margins.csv``);
* ``gain_with_strength``: AutoAttack's success rate must grow with eps; where it ran at one
  radius only (e.g. 8/255 on a CPU), APGD-CE's, at the ``apgd`` step's radii and at AutoAttack's
  radius, read from AutoAttack's records: its first member is APGD-CE with the same iterations,
  run on every image the model classifies correctly, so the images it fooled (``by``
  ``apgd-ce``) and the misclassified ones (``clean``) are APGD-CE's success there. The wider
  ladder matters for an adversarially trained model, which APGD-CE at 1-4/255 may fool no more
  often than its clean errors on a small subset;
* ``unbounded_attack``: 20-step PGD at eps = 1 on the first ``config.masking_images`` images;
* ``input_gradients``: compared with the baseline model's (``config.baseline``) on those images;
* ``loss_saturation``: the loss along the gradient sign and 4 random directions on 4 images,
  plotted to ``loss_directions.png``.

For a single ``eval attack`` run (:func:`attack_run_checks`) the checks the run allows: the
unbounded attack, the input gradients (no baseline), the loss sweep, success against eps when
several eps of one attack ran, and black-box against white-box: AutoAttack's white-box members
against its own Square member (and a Square condition at the same eps), or else Square against
a white-box condition at the same eps, with the images Square alone fools attacked again with
APGD-T and FAB-T as in the study. ``docs/masking-checks.md`` lists which checks each
command runs.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from torch.utils.data import DataLoader, Subset

from robust_attn.attacks import masking
from robust_attn.attacks.masking import followup, near_miss
from robust_attn.protocols.study_step import Passes, study_protocol
from robust_attn.protocols.settings import ProtocolSettings, setting
from robust_attn.protocols.runner import open_run
from robust_attn.runs.store import RunStore, load_description, load_records
from robust_attn.utils.io import atomic_write_json, atomic_write_text
from robust_attn.utils.radius import shown_radius

__all__ = ["PROTOCOL", "white_box_records", "attack_run_checks", "write_checks"]

PROTOCOL = "masking"
CHECKS_FILE = "checks.json"
PLOT_FILE = "loss_directions.png"
SWEEP_FILE = "loss_directions.csv"
FOLLOWUP_FILE = "whitebox_followup.csv"
MARGINS_FILE = "whitebox_margins.csv"
WHITE_BOX_MEMBERS = ("clean", "apgd-ce", "apgd-t", "fab-t")


def _first_images(dataset, n: int, device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    n = min(n, len(dataset))
    images, labels = next(iter(DataLoader(Subset(dataset, range(n)), batch_size=n)))
    return images.to(device), torch.as_tensor(labels).long().to(device), list(range(n))


def white_box_records(records: pd.DataFrame) -> pd.DataFrame:
    """AutoAttack records with ``success`` kept only where a white-box member (or the clean
    misclassification) did it: an image Square alone fooled counts as not fooled."""
    out = records.copy()
    out["success"] = (out["success"].astype(bool) & out["by"].isin(WHITE_BOX_MEMBERS)).astype(int)
    return out


def _condition_at(run_dir: Path, attack: str, eps: float) -> str | None:
    for c in load_description(run_dir)["conditions"]:
        if c.get("attack") == attack and c.get("norm", "linf") == "linf" and abs(c["eps"] - eps) < 1e-9 \
                and not c.get("targeted", False):
            return c["name"]
    return None


def _success_by_eps(run_dir: Path, records: pd.DataFrame, attack: str, radii, label: str = "") -> dict:
    """``{"<label><eps>/255": success rate}`` of ``attack``'s untargeted L-inf conditions in a run,
    from the smallest eps to the largest (the radii the run has; ``radii`` in image units)."""
    conditions = {e: _condition_at(run_dir, attack, e) for e in sorted(radii)}
    return {label + shown_radius(e): float(records.loc[records["condition"] == c, "success"].mean())
            for e, c in conditions.items() if c}


def _apgd_ce_member_rate(records: pd.DataFrame) -> float:
    """APGD-CE's success rate inside an AutoAttack condition's records: the images it found
    misclassified or fooled first (``by``), since AutoAttack runs it first on every image."""
    return float(records["by"].isin(("clean", "apgd-ce")).mean())


def _at(by_eps: dict, eps: float):
    """The value of ``by_eps`` (eps -> records) at ``eps`` (float keys, compared to 1e-9)."""
    return next((v for e, v in by_eps.items() if abs(e - eps) < 1e-9), None)


def write_checks(out: Path, model, images, labels, indices, eps: float, run_info: dict, *, white=None,
                 black=None, rates=None, baseline=None, seed: int = 0, batch_size: int = 64,
                 followed=None, reference: str = "APGD-CE", near=None) -> list[dict]:
    """Run the checks the inputs allow and save them in run directory ``out`` (records of the
    unbounded attack, the loss sweep and its plot, ``checks.json``). Returns the checks. The
    model sees at most ``batch_size`` images at a time. ``followed``: the sources whose white-box
    records (of ``reference`` alone) carry the white-box follow-up
    (:func:`robust_attn.attacks.masking.followup.with_followup`); ``near``: per source, the images
    that are near misses of the white-box attack (:func:`_near_misses`)."""
    store = open_run(out, run_info, protocol=PROTOCOL, parameters={"eps": eps, "unbounded_steps": 20,
                                                                   "sweep_images": 4, "seed": seed},
                     conditions=[{"name": "unbounded", "attack": "pgd", "eps": 1.0, "steps": 20}],
                     num_images=len(images), chunk_size=len(images), device=images.device)
    if (out / CHECKS_FILE).is_file() and not store.missing():
        stored = json.loads((out / CHECKS_FILE).read_text())
        stale = near_miss.rule_changed(stored)
        if stale:
            print(f"masking: {out / CHECKS_FILE} {stale}; its verdict is kept as it was decided: delete {out} "
                  f"to decide the checks again under the current rules", file=sys.stderr, flush=True)
        return stored
    results = []
    started = time.perf_counter()   # the run's one chunk keeps the time of every check
    if white is not None and black:
        check = masking.check_blackbox_beats_whitebox(white, black, near=near)
        results.append(followup.with_followup(check, followed, reference) if followed else check)
    unbounded = masking.unbounded_success(model, images, labels, steps=20, seed=seed, indices=indices,
                                          batch_size=batch_size)
    results.append(masking.check_unbounded(unbounded))
    if rates is not None and len(rates) > 1:
        results.append(masking.check_gain_with_strength(rates, what="eps"))
    results.append(masking.check_input_gradients(masking.input_gradient_stats(model, images, labels, batch_size),
                                                 baseline))
    sweep = masking.loss_along_directions(model, images[:4], labels[:4], eps, seed=seed, indices=indices[:4],
                                          batch_size=batch_size)
    sweep.to_csv(out / SWEEP_FILE, index=False)
    masking.plot_loss_along_directions(sweep, out / PLOT_FILE, title=str(run_info.get("model", "")))
    results.append(masking.check_loss_saturation(sweep))
    if not store.has_chunk("unbounded", 0, len(images)):
        store.write_chunk("unbounded", 0, len(images), unbounded, seconds=time.perf_counter() - started)
    checks = [r.to_dict() for r in results]
    atomic_write_json(out / CHECKS_FILE, checks)
    return checks


def attack_run_checks(run_dir, model, dataset, configs, device, images: int = 64,
                      batch_size: int = 64) -> list[dict]:
    """The checks an ``eval attack`` run allows (module docstring), saved in ``<run_dir>/masking``
    and summarized in ``<run_dir>/checks.json``; the model sees at most ``batch_size`` images at a
    time (the run's own batch size)."""
    run_dir = Path(run_dir)
    records = load_records(run_dir)
    x, y, idx = _first_images(dataset, images, device)
    linf = [c for c in configs if c.norm == "linf" and not c.targeted]
    eps = max((c.eps for c in linf), default=8 / 255)
    white = black = None
    square = [c for c in linf if c.attack == "square"]
    whites = [c for c in linf if c.attack != "square" and any(abs(s.eps - c.eps) < 1e-9 for s in square)]
    if whites:
        w = whites[-1]
        s = next(s for s in square if abs(s.eps - w.eps) < 1e-9)
        white = records[records["condition"] == w.name]
        black = {"square": records[records["condition"] == s.name]}
    ensembles = [c for c in linf if c.attack == "autoattack"]
    if ensembles:   # AutoAttack's own Square member: an image only it fooled is the same evidence
        aa = max(ensembles, key=lambda c: c.eps)
        top = records[records["condition"] == aa.name]
        white = white_box_records(top)
        black = {"autoattack's square": top.assign(success=top["success"].astype(bool).astype(int))}
        alone = [c for c in square if abs(c.eps - aa.eps) < 1e-9]
        if alone:
            black["square"] = records[records["condition"] == alone[0].name]
    rates = None
    by_attack: dict[str, list] = {}
    for c in linf:
        by_attack.setdefault(c.attack, []).append(c)
    sweeps = [cs for cs in by_attack.values() if len(cs) > 1]
    if sweeps:
        cs = sorted(sweeps[0], key=lambda c: c.eps)
        rates = {c.name: float(records.loc[records["condition"] == c.name, "success"].mean()) for c in cs}
    followed, reference = None, "APGD-CE"
    if whites and not ensembles and not (run_dir / "masking" / CHECKS_FILE).is_file():
        # Square against one white-box attack: what it alone missed goes to APGD-T and FAB-T
        held, reference = {"square": w.eps}, w.attack.upper()
        found, followed = _follow_up(model, dataset, device, run_dir / "masking", {"square": white}, black, held,
                                     steps=w.steps, seed=w.seed, batch_size=batch_size)
        white = found["square"]
    near = None
    if white is not None and black and not (run_dir / "masking" / CHECKS_FILE).is_file():
        ref = aa if ensembles else w    # the white-box attack the black-box wins are held to
        near = _near_misses(model, dataset, device, run_dir / "masking", white, black, dict.fromkeys(black, ref.eps),
                            steps=ref.steps, seed=ref.seed, batch_size=batch_size)
    description = load_description(run_dir)
    info = {k: description[k] for k in ("model", "dataset", "checkpoint") if k in description}
    checks = write_checks(run_dir / "masking", model, x, y, idx, eps, info, white=white, black=black, rates=rates,
                          batch_size=batch_size, followed=followed, reference=reference, near=near)
    atomic_write_json(run_dir / CHECKS_FILE, checks)
    return checks


def _describe(config) -> str:
    return f"gradient-masking checks per model (their probes on the first {config.masking_images} of these images)"


@dataclass(frozen=True)
class MaskingSettings(ProtocolSettings):
    masking_images: int = setting(100, "images of the gradient-masking probes (unbounded PGD, gradients)")

    def check(self, study) -> None:
        if self.masking_images < 1:
            raise ValueError(f"masking_images must be at least 1, got {self.masking_images}")


def _attack_evidence(ctx, entry, entries, eps: float) -> tuple[dict, dict, dict | None, dict]:
    """What the attack runs of ``entry`` give the checks: the white-box records at each black-box
    source's radius and the sources' records (both by source name, for ``blackbox_beats_whitebox``),
    the success rates against eps (for ``gain_with_strength``; None without them), and the
    sources held to APGD-CE alone, with their radius (for the white-box follow-up)."""
    config = ctx.config
    white, black, rates = {}, {}, None   # white: eps -> the white-box records there
    aa_dir = ctx.run_dir("autoattack", entry.name)
    top = None
    if RunStore(aa_dir).exists():
        aa = load_records(aa_dir)
        rates = _success_by_eps(aa_dir, aa, "autoattack", config.autoattack_eps)
        top = aa[aa["condition"] == _condition_at(aa_dir, "autoattack", eps)]
        white[eps] = white_box_records(top)
        black["autoattack's square"] = (eps, top.assign(success=top["success"].astype(bool).astype(int)))
    apgd_dir = ctx.run_dir("apgd", entry.name)
    if RunStore(apgd_dir).exists():
        apgd = load_records(apgd_dir)
        if rates is None or len(rates) < 2:   # AutoAttack at one radius only
            rates = _success_by_eps(apgd_dir, apgd, "apgd-ce", config.apgd_eps, "APGD-CE ")
            if top is not None and len(top) and eps > max(config.apgd_eps) + 1e-9:   # the same attack
                rates["APGD-CE " + shown_radius(eps)] = _apgd_ce_member_rate(top)   # (both: attack_steps)
        for radius in (config.square_eps, 8 / 255):   # the black-box radii, where AutoAttack did not run
            c = _condition_at(apgd_dir, "apgd-ce", radius) if _at(white, radius) is None else None
            if c:
                white[radius] = apgd[apgd["condition"] == c]
    square_dir = ctx.run_dir("square", entry.name)
    if _at(white, config.square_eps) is not None and RunStore(square_dir).exists():
        c = _condition_at(square_dir, "square", config.square_eps)
        if c:
            sq = load_records(square_dir)
            black["square"] = (config.square_eps, sq[sq["condition"] == c])
    if _at(white, 8 / 255) is not None:
        for source in entries:
            t_dir = ctx.run_dir("transfer", source.name)
            if source.name == entry.name or not RunStore(t_dir).exists():
                continue
            tr = load_records(t_dir)
            mine = tr[(tr["target_model"] == entry.name) & (tr["target"] == -1)
                      & ~tr["condition"].str.startswith("clean.")]
            if len(mine):
                first = mine[mine["condition"] == mine["condition"].iloc[0]]
                black[f"transfer from {source.name}"] = (8 / 255, first)
    whites, blacks, against_apgd = {}, {}, {}
    for name, (radius, records) in black.items():
        reference = _at(white, radius)
        if abs(radius - eps) > 1e-9 or top is None:   # compared with APGD-CE there: the name says so
            name = f"{name} {shown_radius(radius)} (against APGD-CE {shown_radius(radius)})"
            against_apgd[name] = radius
        whites[name], blacks[name] = reference, records
    return whites, blacks, rates, against_apgd


def _follow_up(model, dataset, device, out: Path, whites: dict, blacks: dict, held: dict, *, steps, seed,
               batch_size: int) -> tuple[dict, dict]:
    """The white-box follow-up (:mod:`robust_attn.attacks.masking.followup`) of the sources in
    ``held`` (name -> radius: those held to one white-box attack alone): per radius, APGD-T and
    FAB-T on the images of ``dataset`` some source there fooled and the white-box attack did not,
    saved per image in ``out/whitebox_followup.csv`` (read back, not computed again, when it
    holds those images). Returns the white-box records with it applied and, per source it
    followed, its contested indices and the follow-up's records at its radius."""
    contested = {name: followup.contested(whites[name], blacks[name]) for name in held}
    wanted: dict[float, set] = {}
    for name, radius in held.items():
        wanted.setdefault(radius, set()).update(contested[name])
    path = out / FOLLOWUP_FILE
    saved = pd.read_csv(path) if path.is_file() else None
    frames = []
    for radius, indices in sorted(wanted.items()):
        indices = sorted(indices)
        if not indices:
            continue
        have = None if saved is None else saved[(saved["eps"] - radius).abs() < 1e-9]
        if have is not None and sorted(have["index"]) == indices:
            frames.append(have)
            continue
        images, labels = next(iter(DataLoader(Subset(dataset, indices), batch_size=len(indices))))
        frames.append(followup.whitebox_followup(model, images.to(device), torch.as_tensor(labels).long().to(device),
                                                 indices, radius, steps=steps, seed=seed, batch_size=batch_size))
    records = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["index", "eps", "by"])
    if frames:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, records.to_csv(index=False))
    followed = {}
    for name, radius in held.items():
        if contested[name]:
            followed[name] = (contested[name], records[(records["eps"] - radius).abs() < 1e-9])
            whites = {**whites, name: followup.apply_followup(whites[name], records, radius)}
    return whites, followed


def _near_misses(model, dataset, device, out: Path, whites, blacks: dict, radii: dict, *, steps, seed,
                 batch_size: int) -> dict[str, set[int]]:
    """Per source of ``blacks`` (at its radius in ``radii``), the images it still wins against the
    white-box records (``whites``: one frame for every source, or one per source) that are near
    misses of a working gradient (:mod:`robust_attn.attacks.masking.near_miss`). Their margins are
    saved per image in ``out/whitebox_margins.csv`` and read back, not measured again."""
    white_of = whites if isinstance(whites, dict) else dict.fromkeys(blacks, whites)
    won = {name: followup.contested(white_of[name], blacks[name]) for name in blacks}
    path = out / MARGINS_FILE
    frames = [pd.read_csv(path)] if path.is_file() else []
    measured = len(frames)
    for radius in sorted(set(radii.values())):
        have = {int(i) for f in frames[:measured] for i in f.loc[(f["eps"] - radius).abs() < 1e-9, "index"]}
        wanted = sorted({i for name, r in radii.items() if abs(r - radius) < 1e-9 for i in won[name]} - have)
        if wanted:
            images, labels = next(iter(DataLoader(Subset(dataset, wanted), batch_size=len(wanted))))
            frames.append(near_miss.margins(model, images.to(device), torch.as_tensor(labels).long().to(device),
                                            wanted, radius, steps=steps, seed=seed, batch_size=batch_size))
    if not frames:
        return {}
    records = pd.concat(frames, ignore_index=True)
    if len(frames) > measured:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, records.to_csv(index=False))
    return {name: near_miss.near_misses(records, radii[name]) & set(won[name]) for name in blacks if won[name]}


def _passes(config) -> Passes:
    """Per model, on ``masking_images`` images: the unbounded 20-step PGD, one input gradient and
    a few forward passes (the loss sweep on 4 images is small beside them)."""
    return Passes(forward=2, backward=21, images="masking")


@study_protocol("masking", per_model=False, chunked=False,
                summary="gradient-masking checks per model, from the attack runs", describe=_describe,
                attack_subset=True, default_order=6, settings=MaskingSettings, passes=_passes)
def study_masking(ctx, entries, models):
    """The checks of the module docstring for every model (after autoattack, square and transfer)."""
    config = ctx.config
    images, labels, indices = _first_images(ctx.attack_dataset, config.masking_images, ctx.device)
    base = models.get(config.baseline)
    batch = config.attack_batch_size
    baseline = masking.input_gradient_stats(base, images, labels, batch) if base is not None else None
    eps = max(config.autoattack_eps)
    outs = []
    for entry in entries:
        model = models[entry.name]
        whites, blacks, rates, against_apgd = _attack_evidence(ctx, entry, entries, eps)
        out = ctx.run_dir("masking", entry.name)
        if ctx.rank == 0:
            followed = near = None
            if against_apgd and not (out / CHECKS_FILE).is_file():
                whites, followed = _follow_up(model, ctx.attack_dataset, ctx.device, out, whites, blacks, against_apgd,
                                              steps=config.attack_steps, seed=config.seed, batch_size=batch)
            if blacks and not (out / CHECKS_FILE).is_file():
                radii = {name: against_apgd.get(name, eps) for name in blacks}
                near = _near_misses(model, ctx.attack_dataset, ctx.device, out, whites, blacks, radii,
                                    steps=config.attack_steps, seed=config.seed, batch_size=batch)
            write_checks(out, model, images, labels, indices, eps, ctx.run_info(entry, model), white=whites or None,
                         black=blacks or None, rates=rates, baseline=baseline, seed=config.seed, batch_size=batch,
                         followed=followed, near=near)
        outs.append(out)
    return outs
