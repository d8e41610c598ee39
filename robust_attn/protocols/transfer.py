"""Transfer attacks: adversarial images crafted on a source model, evaluated on targets.

A transfer attack is black-box for the target: it needs none of the target's gradients, so a
target that a transfer attack fools more often than a white-box attack on the target itself has
uninformative gradients (gradient masking; Athalye et al. 2018, Carlini et al. 2019). The
study's transfer matrix puts every zoo model as source against every model as target.

The source is one model or an ensemble (:class:`EnsembleModel`, the mean of its members'
logits). For every chunk of images and every crafting attack (an :class:`AttackConfig`, e.g.
Table 10's targeted {8, 2, 4} or a 10-step untargeted PGD) the adversarial images are made once
on the source and then given to every target. One run directory per source; its conditions are
``<attack>.<target>`` for every attack and target, plus ``clean.<target>``.

Records, per image and condition: ``index, label, target`` (the attack's target class, -1
untargeted), ``source`` and ``target_model`` (names), ``clean_pred`` and ``pred`` (the target
model's predictions on the clean and on the transferred image), ``top1`` (pred == label),
``success`` (targeted: pred == target; untargeted: pred != label), ``source_success`` (the same
on the source model), ``linf`` and ``l2`` (the perturbation's norms, [0, 1] units). The
crafting attack's random draws are seeded per chunk as in :mod:`robust_attn.protocols.attack`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import pandas as pd
import torch
import torch.nn as nn

from robust_attn.attacks.base import AttackConfig, list_attacks, make_attack
from robust_attn.distributed import barrier
from robust_attn.protocols.targets import dataset_labels, prepare_targets, save_targets
from robust_attn.protocols.attack_eval import AttackOptions
from robust_attn.protocols.eval_step import eval_protocol
from robust_attn.protocols.study_step import Passes, study_protocol
from robust_attn.protocols.settings import is_eval, setting
from robust_attn.protocols.runner import finite_logits, open_run, run_chunks
from robust_attn.runs.store import RunStore

__all__ = ["PROTOCOL", "EnsembleModel", "transfer_condition", "split_condition", "run_transfer",
           "summarize_transfer", "check_compatible"]

PROTOCOL = "transfer"
CLEAN = "clean"


class EnsembleModel(nn.Module):
    """The mean of the members' logits; every member takes [0, 1] images."""

    def __init__(self, members: Sequence[nn.Module]):
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one member")
        self.members = nn.ModuleList(members)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(x) for m in self.members]).mean(0)


def transfer_condition(attack: str, target: str) -> str:
    return f"{attack}.{target}"


def split_condition(condition: str) -> tuple[str, str]:
    """``"pgd_linf_eps8_n10.resnet26"`` -> ``("pgd_linf_eps8_n10", "resnet26")``."""
    attack, _, target = condition.partition(".")
    return attack, target


def _num_classes(model: nn.Module, image: torch.Tensor) -> int:
    with torch.no_grad():
        return int(model(image[:1]).shape[1])


def check_compatible(source: str, source_model: nn.Module, targets: Mapping[str, nn.Module],
                     image: torch.Tensor) -> int:
    """Every target has the source's number of classes (else a clear error); returns it."""
    n = _num_classes(source_model, image)
    bad = {name: k for name, m in targets.items() if (k := _num_classes(m, image)) != n}
    if bad:
        raise ValueError(f"transfer source {source} has {n} classes but target(s) "
                         + ", ".join(f"{k} has {v}" for k, v in bad.items())
                         + "; sources and targets must be trained on the same dataset")
    return n


def _records(indices, labels, tgt, source_name, target_name, clean_logits, logits, source_logits,
             images, adv) -> pd.DataFrame:
    pred = finite_logits(logits, indices, f"{target_name} on images crafted on {source_name}").argmax(1)
    source_pred = finite_logits(source_logits, indices, f"source {source_name}").argmax(1)
    finite_logits(clean_logits, indices, f"{target_name} on clean images")
    hit = (lambda p: p == tgt) if tgt is not None else (lambda p: p != labels)
    delta = (adv - images).flatten(1).double()
    n = len(labels)
    return pd.DataFrame({
        "index": indices.cpu().numpy(), "label": labels.cpu().numpy(),
        "target": (tgt if tgt is not None else torch.full_like(labels, -1)).cpu().numpy(),
        "source": [source_name] * n, "target_model": [target_name] * n,
        "clean_pred": clean_logits.argmax(1).cpu().numpy(), "pred": pred.cpu().numpy(),
        "top1": (pred == labels).long().cpu().numpy(), "success": hit(pred).long().cpu().numpy(),
        "source_success": hit(source_pred).long().cpu().numpy(),
        "linf": delta.abs().amax(1).cpu().numpy().round(7), "l2": delta.norm(dim=1).cpu().numpy().round(6)})


def _evaluator(source_name: str, source: nn.Module, targets: Mapping[str, nn.Module],
               configs: Sequence[AttackConfig], attack_targets: torch.Tensor | None, device):
    by_name = {c.name: c for c in configs}

    def evaluate(images, labels, indices, todo) -> Iterator[tuple[str, pd.DataFrame]]:
        images, labels = images.to(device), labels.to(device).long()
        start = int(indices[0])
        wanted = [split_condition(c) for c in todo]
        clean = {}
        with torch.no_grad():
            for _, target in wanted:
                if target not in clean:
                    clean[target] = targets[target](images)
        for attack_name in dict.fromkeys(a for a, _ in wanted):
            if attack_name == CLEAN:
                adv, tgt, source_logits = images, None, None
            else:
                config = by_name[attack_name]
                attack = make_attack(dataclasses.replace(config, seed=config.seed * 2 ** 32 + start))
                tgt = attack_targets[indices].to(device) if config.targeted else None
                adv = attack.run(source, images, labels, tgt).adv
            with torch.no_grad():
                source_logits = source(adv)
                for a, target in wanted:
                    if a != attack_name:
                        continue
                    logits = clean[target] if attack_name == CLEAN else targets[target](adv)
                    yield transfer_condition(attack_name, target), _records(
                        indices, labels, tgt, source_name, target, clean[target], logits, source_logits, images, adv)

    return evaluate


def _stored_order(out_dir, names: list[str]) -> list[str]:
    """The target models in the order an existing run of ``out_dir`` stored them, when it holds the
    same models (a study resumed with ``--models`` in another order); else ``names`` as given.
    The order changes neither the images crafted on the source nor any target's records."""
    store = RunStore(out_dir)
    if store.exists():
        stored = store.description().get("parameters", {}).get("target_models")
        if isinstance(stored, list) and sorted(stored) == sorted(names):
            return list(stored)
    return list(names)


def run_transfer(source_name: str, source: nn.Module, targets: Mapping[str, nn.Module], dataset, out_dir, *,
                 configs: Sequence[AttackConfig], seed: int = 0, targets_file: str | Path | None = None,
                 batch_size: int = 64, device: str | torch.device = "cpu", run_info: dict | None = None,
                 rank: int = 0, world_size: int = 1, num_workers: int = 0, progress: bool = True):
    """Run (or resume) the transfer of every attack in ``configs`` from ``source`` (a model or an
    :class:`EnsembleModel`, named ``source_name``) to every model of ``targets`` (name -> model).
    ``seed`` draws the targets of targeted attacks. Returns the RunStore."""
    configs = list(configs)
    if not configs or not targets:
        raise ValueError("give at least one attack and one target model")
    for c in configs:
        make_attack(c)
    bad = [n for n in list(targets) + [c.name for c in configs] if "." in n]
    if bad:
        raise ValueError(f"model and attack names may not contain '.', got {bad}")
    device = torch.device(device)
    source = source.to(device).eval()
    order = _stored_order(out_dir, list(targets))   # a resumed run keeps its targets' order
    targets = {name: targets[name].to(device).eval() for name in order}
    if run_info is not None and sorted(run_info.get("target_models") or []) == sorted(order):
        run_info = {**run_info, "target_models": order}
    first = dataset[0][0][None].to(device)
    num_classes = check_compatible(source_name, source, targets, first)
    labels = dataset_labels(dataset)
    attack_targets, target_source = None, None
    if any(c.targeted for c in configs):
        attack_targets, target_source = prepare_targets(labels, num_classes, seed, targets_file)
    names = [CLEAN] + [c.name for c in configs]
    conditions = [{"name": transfer_condition(a, t), "attack": a, "target_model": t}
                  for a in names for t in targets]
    attacks = {c.name: c.as_dict() for c in configs}
    store = open_run(out_dir, dict(run_info or {}), protocol=PROTOCOL,
                     parameters={"source": source_name, "targets": target_source, "seed": int(seed),
                                 "attacks": attacks, "target_models": list(targets),
                                 "chunk_seed": "config.seed * 2**32 + chunk start"},
                     conditions=conditions, num_images=len(dataset), chunk_size=batch_size, rank=rank, device=device)
    if rank == 0 and attack_targets is not None:
        save_targets(out_dir, labels, attack_targets)
    run_chunks(store, dataset, [c["name"] for c in conditions],
               _evaluator(source_name, source, targets, configs, attack_targets, device),
               chunk_size=batch_size, rank=rank, world_size=world_size, num_workers=num_workers,
               progress=progress and rank == 0, desc=f"transfer from {source_name}")
    barrier()
    return store


def summarize_transfer(records: pd.DataFrame) -> pd.DataFrame:
    """Per (source, attack, target): top-1 and success rate on the target (percent), the
    source's own success rate, and how many images fooled the source and the target."""
    frame = records.copy()
    frame["attack"] = frame["condition"].map(lambda c: split_condition(c)[0])
    rows = []
    for (source, attack, target), g in frame.groupby(["source", "attack", "target_model"], sort=False):
        rows.append({"source": source, "attack": attack, "target_model": target, "n": len(g),
                     "top1": g["top1"].mean() * 100, "success_rate": g["success"].mean() * 100,
                     "source_success_rate": g["source_success"].mean() * 100})
    return pd.DataFrame(rows)


def study_transfer_configs(config) -> list[AttackConfig]:
    """Table 10's targeted {8, 2, 4} (no random start) and an untargeted PGD of
    ``config.transfer_steps`` steps of 2/255 at 8/255, both crafted on the source."""
    return [AttackConfig("pgd", eps=8 / 255, targeted=True, steps=4, step=2 / 255, seed=config.seed,
                         options={"random_start": False}),
            AttackConfig("pgd", eps=8 / 255, steps=config.transfer_steps, step=2 / 255, seed=config.seed)]


def _describe(config) -> str:
    return ("a transfer matrix (every model crafting Table 10's targeted {8, 2, 4} and an untargeted "
            f"{config.transfer_steps}-step PGD at 8/255 for every model)")


@dataclass(frozen=True)
class TransferSettings(AttackOptions):
    """The study's transfer matrix (every model a source and a target: Table 10's {8, 2, 4} and an
    untargeted PGD of ``transfer_steps``) and ``eval transfer`` (the attack of the options, from
    ``source`` to each ``target``)."""

    transfer_steps: int = setting(10, "iterations of the study's transfer matrix's untargeted PGD (step 2/255), "
                                      "beside {8, 2, 4}", scope="study")
    attack: str | None = setting("pgd", lambda: f"attack crafted on the sources ({', '.join(list_attacks())})",
                                 scope="eval")
    source: tuple[str, ...] = setting((), "zoo entry name (for --dataset), checkpoint .safetensors or any model spec "
                                          "(timm:NAME, torchvision:NAME[:WEIGHTS], FILE.py:FUNCTION, ...); repeat "
                                          "for an ensemble (mean of logits)", scope="eval", repeat=True)
    target: tuple[str, ...] = setting((), "zoo entry name, checkpoint .safetensors or model spec; repeat for "
                                          "several targets", scope="eval", repeat=True)

    def check(self, study) -> None:
        if self.transfer_steps < 1:
            raise ValueError(f"transfer_steps must be positive, got {self.transfer_steps}")
        if is_eval(study):
            if not self.source or not self.target:
                raise ValueError("eval transfer needs --source MODEL and --target MODEL (each may repeat)")
            super().check(study)


def _summary(ctx, settings, store) -> str:
    from robust_attn.runs.store import load_records

    summary = summarize_transfer(load_records(store.root))
    return "\n".join(f"{row['source']} -> {row['target_model']} [{row['attack']}]: top-1 {row['top1']:.1f}, "
                     f"success {row['success_rate']:.1f} (on the source {row['source_success_rate']:.1f})"
                     for _, row in summary.iterrows())


@eval_protocol("transfer", settings=TransferSettings, summary=_summary, models="sources-targets",
               run_name=lambda s: "transfer", help="craft adversarial images on --source model(s), evaluate them "
                                                   "on every --target model")
def eval_transfer(ctx, models, settings):
    """``robust-attn eval transfer``: ``models`` is (sources, targets), each ``(name, model, description)``."""
    sources, targets = models
    name = "+".join(n for n, _, _ in sources)
    source = sources[0][1] if len(sources) == 1 else EnsembleModel([m for _, m, _ in sources])
    return run_transfer(name, source, {n: m for n, m, _ in targets}, ctx.dataset, ctx.out,
                        configs=settings.configs(), seed=ctx.seed, **ctx.loop)


def _passes(config) -> Passes:
    """Per source model: Table 10's targeted {8, 2, 4} (4 steps) and the untargeted
    ``transfer_steps`` PGD crafted on it, then the clean and both attacked images through every
    other model (and itself)."""
    return Passes(forward=3, backward=4 + config.transfer_steps, images="attack", per_target=3)


@study_protocol("transfer", per_model=False, summary="every model as source against every model as target",
                describe=_describe, attack_subset=True, default_order=5, settings=TransferSettings, passes=_passes)
def study_transfer(ctx, entries, models):
    """The transfer matrix on the attack subset: one run per source, every zoo model a target."""
    outs = []
    for entry in entries:
        out = ctx.run_dir("transfer", entry.name)
        run_transfer(entry.name, models[entry.name], models, ctx.attack_dataset, out,
                     configs=study_transfer_configs(ctx.config), seed=ctx.config.seed,
                     batch_size=ctx.config.attack_batch_size, device=ctx.device,
                     run_info={**ctx.run_info(entry, models[entry.name]), "model": entry.name,
                               "target_models": list(models)}, progress=ctx.progress, **ctx.shard)
        outs.append(out)
    return outs
