"""Evaluation attacks on a test set: any registered attack, per-image records.

Where :mod:`robust_attn.protocols.pgd` is SAN's Table 10 (targeted PGD with the paper's weak
settings), this protocol runs the attacks a careful evaluator adds (PGD with restarts, APGD-CE,
APGD-T, FAB-T, Square and the AutoAttack ensemble, :mod:`robust_attn.attacks`), each as one
condition of a resumable, shardable run directory (:mod:`robust_attn.runs.store`), beside the
clean condition.

Records, per image and condition:

``index, label``; ``target`` (the targeted attacks' target, -1 untargeted); ``clean_pred`` and
``pred`` (predictions on the clean and attacked image); ``top1`` (pred == label: robust
accuracy is its mean); ``success`` (targeted: pred == target; untargeted: pred != label, so an
image misclassified already counts as a success, as in RobustBench); ``margin`` (z_label minus
the largest other logit on the attacked image: negative means misclassified); ``linf`` and
``l2`` (the perturbation's norms in [0, 1] image units); ``queries`` (model queries a
score-based attack used, else -1); ``by`` (which member of an ensemble fooled the image,
``clean`` if it was misclassified without attack, ``none`` otherwise).

Choices: the conditions are computed clean first, then each attack (in the order given) from its
largest radius to its smallest (:func:`computation_order`): an attack that stops on success
(APGD, FAB-T, Square, AutoAttack's later members run only on the images still robust) costs
least where most images fall early, so the cheap radii's records land first and a long run on
a CPU gives its most telling numbers (the middle radii) before its most expensive one. The
order changes nothing in the records (each condition's draws are seeded on their own). A resumed
run first finishes the conditions a killed run left under way (:func:`resume_order`: those with a
saved state within a chunk, the furthest along first), so that stopping and starting again never
delays a nearly finished number behind a radius started from scratch.
The random draws of an attack on chunk ``[start, stop)`` are seeded with
``seed * 2**32 + start``, so a resumed or sharded run computes the same images as an
uninterrupted one, while the records depend on the batch size (recorded in run.json as the
chunk size). Targets for targeted attacks are drawn like Table 10's
(:func:`robust_attn.protocols.targets.prepare_targets`) and saved in ``targets.csv``.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import pandas as pd
import torch
import torch.nn as nn

from robust_attn.attacks.base import AttackConfig, make_attack
from robust_attn.distributed import barrier
from robust_attn.protocols.targets import dataset_labels, prepare_targets, save_targets
from robust_attn.protocols.runner import finite_logits, open_run, run_chunks

__all__ = ["PROTOCOL", "CLEAN", "attack_records", "computation_order", "logit_margin", "make_evaluator",
           "resume_order", "run_attack", "describe_attack_copy", "saved_states", "state_path", "summarize_attack",
           "config_from_condition", "study_attack"]

PROTOCOL = "attack"
CLEAN = "clean"
STATE_DIR = "partial"   # AutoAttack's state within a chunk (after each member), for a killed run to resume


def state_path(state_dir: str | Path, condition: str, start: int) -> Path:
    """Where an attack keeps its state within chunk ``[start, ...)`` of ``condition``."""
    return Path(state_dir) / f"{condition}-{start:09d}.pt"


def saved_states(state_dir: str | Path) -> list[tuple[str, int, Path]]:
    """``(condition, chunk start, path)`` of every state in ``state_dir`` (:func:`state_path`)."""
    found = []
    for path in sorted(Path(state_dir).glob("*-*.pt")):
        condition, _, start = path.stem.rpartition("-")
        found.append((condition, int(start), path))
    return found


def logit_margin(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``z_y - max_{i != y} z_i`` per row: positive where the label wins."""
    own = logits.gather(1, labels[:, None]).squeeze(1)
    other = logits.scatter(1, labels[:, None], float("-inf")).amax(1)
    return own - other


def attack_records(indices: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor | None,
                   clean_logits: torch.Tensor, logits: torch.Tensor, images: torch.Tensor, adv: torch.Tensor,
                   queries: torch.Tensor | None = None, by: Sequence[str] | None = None) -> pd.DataFrame:
    """The per-image records of one attacked batch (module docstring)."""
    pred = finite_logits(logits, indices, "attacked images").argmax(1)
    clean_pred = finite_logits(clean_logits, indices, "clean images").argmax(1)
    delta = (adv - images).flatten(1).double()
    success = pred == targets if targets is not None else pred != labels
    n = len(labels)
    return pd.DataFrame({
        "index": indices.cpu().numpy(), "label": labels.cpu().numpy(),
        "target": (targets if targets is not None else torch.full_like(labels, -1)).cpu().numpy(),
        "clean_pred": clean_pred.cpu().numpy(), "pred": pred.cpu().numpy(),
        "top1": (pred == labels).long().cpu().numpy(), "success": success.long().cpu().numpy(),
        "margin": logit_margin(logits.double(), labels).cpu().numpy().round(5),
        "linf": delta.abs().amax(1).cpu().numpy().round(7), "l2": delta.norm(dim=1).cpu().numpy().round(6),
        "queries": (queries.cpu().long().numpy() if queries is not None else [-1] * n),
        "by": [b or "none" for b in by] if by is not None else ["none"] * n})


def _log_line(line: str) -> None:
    """A line on a long attack's progress, printed above the progress bar (stderr), with the time."""
    from tqdm.auto import tqdm

    tqdm.write(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr)


def make_evaluator(model: nn.Module, configs: Sequence[AttackConfig], targets: torch.Tensor | None,
                   device: torch.device, state_dir: Path | None = None, log=None, attack_copy: str = "auto"):
    """The ``evaluate`` callback of :func:`robust_attn.protocols.runner.run_chunks`: the clean
    forward once per chunk, then every missing attack condition. ``state_dir``: where an attack
    that can save its state within a chunk (AutoAttack, after each member) keeps it, one file per
    condition and chunk, deleted once the chunk's records are written. ``log``: where such an
    attack's lines on its progress go (None: nowhere). ``attack_copy``: which model the attacks
    query (:attr:`robust_attn.attacks.base.Attack.attack_copy`); the records judge the model as given."""
    by_name = {c.name: c for c in configs}

    def evaluate(images, labels, indices, todo) -> Iterator[tuple[str, pd.DataFrame]]:
        images, labels = images.to(device), labels.to(device).long()
        with torch.no_grad():
            clean_logits = model(images)
        start = int(indices[0])
        for name in todo:
            if name == CLEAN:
                yield name, attack_records(indices, labels, None, clean_logits, clean_logits, images, images)
                continue
            config = by_name[name]
            attack = make_attack(dataclasses.replace(config, seed=config.seed * 2 ** 32 + start))
            attack.attack_copy = attack_copy
            state = None
            if state_dir is not None and hasattr(attack, "state_path"):
                state = attack.state_path = state_path(state_dir, name, start)
                if log is not None:
                    attack.log = lambda line, start=start: log(f"chunk {start}: {line}")
            tgt = targets[indices].to(device) if config.targeted else None
            out = attack.run(model, images, labels, tgt)
            with torch.no_grad():
                logits = model(out.adv)
            yield name, attack_records(indices, labels, tgt, clean_logits, logits, images, out.adv,
                                       out.queries, out.by)
            if state is not None:   # the records are written: the state is no longer needed
                state.unlink(missing_ok=True)

    return evaluate


def computation_order(configs: Sequence[AttackConfig]) -> list[str]:
    """Condition names in the order a run computes them: ``clean``, then the configs grouped by
    attack, norm and targeting (groups in order of first appearance), each group from its
    largest radius to its smallest (ties keep their given order); see the module's Choices."""
    groups: dict[tuple, list[AttackConfig]] = {}
    for c in configs:
        groups.setdefault((c.attack, c.norm, c.targeted), []).append(c)
    return [CLEAN] + [c.name for group in groups.values() for c in sorted(group, key=lambda c: -c.eps)]


def resume_order(order: Sequence[str], state_dir: str | Path) -> list[str]:
    """``order`` with the conditions a killed run left under way moved first, after ``clean``: those
    with a saved state in ``state_dir`` (:func:`saved_states`, AutoAttack's after each member),
    the one with the most members done first (ties, and the conditions not started, keep their
    order; an unreadable state counts as none done). See the module's Choices."""
    done: dict[str, int] = {}
    for name, _, path in saved_states(state_dir):
        try:
            n = int(torch.load(path, map_location="cpu", weights_only=True).get("done", 0))
        except Exception:   # half-written or of another format: the attack itself decides what to do with it
            n = 0
        done[name] = max(done.get(name, 0), n)
    rest = [n for n in order if n != CLEAN]
    started = sorted((n for n in rest if n in done), key=lambda n: -done[n])
    return [n for n in order if n == CLEAN] + started + [n for n in rest if n not in done]


def run_attack(model: nn.Module, dataset, out_dir, *, configs: Sequence[AttackConfig], num_classes: int,
               seed: int = 0, targets_file: str | Path | None = None, batch_size: int = 64,
               device: str | torch.device = "cpu", run_info: dict | None = None, rank: int = 0,
               world_size: int = 1, num_workers: int = 0, progress: bool = True, checks: bool = True,
               targets: torch.Tensor | None = None, model_info=None, attack_copy: str = "auto"):
    """Run (or resume) the clean condition and every attack of ``configs`` into ``out_dir``.

    ``seed`` draws the targets of targeted attacks (each attack's own random draws follow its
    config's seed); ``targets`` (one class per image, in dataset order) or ``targets_file``
    (another run's ``targets.csv``) give them instead. With ``checks`` the gradient-masking
    checks of :mod:`robust_attn.attacks.masking` that the records allow are computed after the
    run and saved in ``checks.json``. ``model_info``: where the model came from, as for
    :func:`robust_attn.protocols.rotation.run_rotation`. ``attack_copy``: whether the attacks query
    the attack-time copy (batch norm folded, channels-last input; ``auto``: on a CPU), recorded
    in run.json (``attack_copy``) as how the run computed, not what: a run may resume on the
    other setting. Returns the RunStore.
    """
    from robust_attn.sources.provenance import with_provenance

    configs = list(configs)
    if not configs:
        raise ValueError("give at least one attack")
    names = [c.name for c in configs]
    if len(set(names)) != len(names) or CLEAN in names:
        raise ValueError(f"attack conditions must have distinct names, got {names}")
    for c in configs:   # unknown attacks and unsupported settings fail before anything is written
        make_attack(c)
    device = torch.device(device)
    model = model.to(device).eval()
    run_info = dict(run_info or {}, attack_copy=describe_attack_copy(attack_copy, device))
    given, targets, source = targets, None, None
    labels = dataset_labels(dataset)
    if any(c.targeted for c in configs):
        targets, source = prepare_targets(labels, num_classes, seed, targets_file, targets=given)
    conditions = [{"name": CLEAN, "attack": "none", "eps": 0.0}] + [c.as_dict() for c in configs]
    store = open_run(out_dir, with_provenance(model, run_info, model_info, dataset), protocol=PROTOCOL,
                     parameters={"units": "[0, 1] image units", "seed": int(seed), "targets": source,
                                 "chunk_seed": "config.seed * 2**32 + chunk start"},
                     conditions=conditions, num_images=len(dataset), chunk_size=batch_size, rank=rank, device=device)
    if rank == 0 and targets is not None:
        save_targets(out_dir, labels, targets)
    run_chunks(store, dataset, resume_order(computation_order(configs), store.root / STATE_DIR),
               make_evaluator(model, configs, targets, device, state_dir=store.root / STATE_DIR,
                              log=_log_line if progress and rank == 0 else None, attack_copy=attack_copy),
               chunk_size=batch_size, rank=rank, world_size=world_size, num_workers=num_workers,
               progress=progress and rank == 0, desc="attack",
               claim_each_condition=True)   # an attack's radii are split among processes sharing the run
    barrier()
    if checks and rank == 0:
        from robust_attn.protocols.masking import attack_run_checks

        attack_run_checks(store.root, model, dataset, configs, device, batch_size=batch_size)
    return store


def describe_attack_copy(mode: str, device: torch.device) -> str:
    """run.json's ``attack_copy``: what the attacks of a run query under ``mode`` on ``device``."""
    from robust_attn.attacks.fast_model import resolve_attack_copy

    if resolve_attack_copy(mode, device):
        return f"{mode}: the attack copy (batch norm folded where it folds, channels-last input)"
    return f"{mode}: the model as given"


def config_from_condition(condition: dict) -> AttackConfig:
    """The :class:`AttackConfig` a run.json condition was made from."""
    fields = {f.name for f in dataclasses.fields(AttackConfig)}
    return AttackConfig(**{k: v for k, v in condition.items() if k in fields})


def summarize_attack(records: pd.DataFrame) -> pd.DataFrame:
    """Per condition (percent): ``robust_top1`` (mean top1 over all images), ``success_rate``,
    the clean-correct subset's size and robust accuracy, the largest perturbation norms and the
    median queries (score-based attacks)."""
    clean = records[records["condition"] == CLEAN].set_index("index")["top1"] if CLEAN in set(
        records["condition"]) else None
    rows = []
    for condition, group in records.groupby("condition", sort=False):
        row = {"condition": condition, "n": len(group), "robust_top1": group["top1"].mean() * 100,
               "success_rate": group["success"].mean() * 100, "max_linf": group["linf"].max(),
               "max_l2": group["l2"].max()}
        if clean is not None:
            correct = group["index"].map(clean).fillna(0).astype(bool).to_numpy()
            row["n_clean_correct"] = int(correct.sum())
            row["robust_top1_clean_correct"] = group["top1"][correct].mean() * 100 if correct.any() else float("nan")
        q = group["queries"][group["queries"] >= 0]
        row["median_queries"] = float(q.median()) if len(q) else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


def study_attack(ctx, entry, model, protocol: str, configs: list[AttackConfig]):
    """The study step of an attack: ``configs`` on the study's attack subset, one run
    ``<protocol>-<model>`` per model, the same seed for every model (``ctx.config.seed``)."""
    out = ctx.run_dir(protocol, entry.name)
    run_attack(model, ctx.attack_dataset, out, configs=configs, num_classes=ctx.info.num_classes,
               seed=ctx.config.seed, batch_size=ctx.config.attack_batch_size, device=ctx.device,
               run_info=ctx.run_info(entry, model), progress=ctx.progress, checks=False, **ctx.shard)
    return out
