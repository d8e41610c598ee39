"""White-box targeted PGD under L-infinity (SAN, Zhao et al. 2020, section 5.4 and Table 10).

The paper attacks with ``{eps, step, n} = {8, 4, 2}`` and ``{8, 2, 4}`` (eps and step in 1/255
units of [0, 1] pixels, n iterations; Madry et al. 2018) and reports the attack success rate
(prediction equals the target) and top-1 under attack (prediction equals the true label).

Choices where the paper is silent (stated here and recorded in every run's ``run.json``):

* Targets: one per image, uniform over the classes other than the true one, drawn by
  :func:`robust_attn.attacks.draw_targets` from a seeded generator over the whole evaluated set,
  saved as ``targets.csv`` in the run directory, and reusable by other runs (``targets_file=``,
  the CLI's ``--targets``), so every model is attacked towards the same targets. The Python API
  also takes the targets as a tensor (``run_pgd(..., targets=tensor)``, one class per image in
  dataset order).
* Both rates are over all images (the paper's "top-1" under attack is comparable with its clean
  top-1 only that way); the report adds both on the clean-correct subset.
* No random start (the paper's step sizes exactly reach eps in n steps: step = eps / n); a
  sweep without an explicit step uses that rule.
* Units: the run records each condition's eps and step (``run.json``) and each image's largest
  pixel change (``linf``) in [0, 1] image units, as every protocol; the condition names keep
  Table 10's numbers in 1/255 units (``pgd_eps8_step2_n4``), and so do the report's tables.
* The attack runs on the model in eval mode; gradients flow through the normalization inside
  :class:`robust_attn.models.wrapper.NormalizedModel`.
* Backend agreement: by default the native attack agrees with torchattacks and foolbox up to
  floating-point ties (a faster float order). ``run_pgd(..., exact=True)`` (``eval pgd --exact``)
  makes the three backends bit-identical at any ``batch_size``, the ragged last chunk included,
  by running each chunk in power-of-two blocks: torchattacks differentiates the mean loss and
  foolbox the sum, and their 1/N factor is exact in float32 only for N a power of two (see
  :func:`robust_attn.attacks.targeted_pgd` for why, and for the cases it still cannot cover:
  random starts, subnormal gradients, non-deterministic GPU kernels).
"""
from __future__ import annotations

import itertools
import json
import math
import re
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pandas as pd
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from robust_attn.attacks.targeted_pgd import BACKENDS
from robust_attn.distributed import barrier
from robust_attn.protocols.eval_step import eval_protocol
from robust_attn.protocols.study_step import Passes, study_protocol
from robust_attn.protocols.settings import ProtocolSettings, setting
from robust_attn.protocols.runner import finite_logits, open_run, run_chunks, topk_hits
from robust_attn.protocols.targets import dataset_labels, prepare_targets, save_targets
from robust_attn.runs.migrations import IMAGE_UNITS
from robust_attn.utils.io import atomic_write_json

__all__ = ["AttackSetting", "PAPER_SETTINGS", "pgd_settings", "load_checks",
           "make_evaluator", "run_pgd", "summarize_pgd", "PROTOCOL", "CLEAN"]

PROTOCOL = "pgd"
CLEAN = "clean"
CHECKS_FILE = "checks.json"


@dataclass(frozen=True)
class AttackSetting:
    """eps and step in 1/255 units (Table 10's numbers, and the condition's name), ``steps``
    iterations; :meth:`as_dict`, the run's record of it, has them in image units."""

    eps: float
    step: float
    steps: int

    def __post_init__(self):
        if not (math.isfinite(self.eps) and math.isfinite(self.step)):
            raise ValueError(f"PGD eps and step must be finite numbers, got {self}")
        if self.eps < 0 or self.step < 0 or self.steps < 0:
            raise ValueError(f"PGD eps, step and steps must be non-negative, got {self}")
        if self.steps > 0 and self.step == 0:
            raise ValueError(f"PGD step size must be positive (got {self}); give --step for eps 0")
        if self.eps > 255 or self.step > 255:
            raise ValueError(f"PGD eps and step are in 1/255 units (Table 10: eps 8 means 8/255), at most 255, "
                             f"the whole [0, 1] pixel range; got eps {self.eps:g}, step {self.step:g}")

    @property
    def name(self) -> str:
        return f"pgd_eps{self.eps:g}_step{self.step:g}_n{self.steps}"

    def as_dict(self) -> dict:
        """The condition in ``run.json``: its name, and eps and step in [0, 1] image units."""
        return {"name": self.name, **asdict(self), "eps": float(self.eps) / 255, "step": float(self.step) / 255}


PAPER_SETTINGS = (AttackSetting(8, 4, 2), AttackSetting(8, 2, 4))
_NAME = re.compile(r"pgd_eps(?P<eps>[0-9.e+-]+)_step(?P<step>[0-9.e+-]+)_n(?P<steps>[0-9]+)")


def parse_setting_name(name: str) -> AttackSetting:
    """The inverse of ``AttackSetting.name``: ``"pgd_eps8_step2_n4"`` -> ``AttackSetting(8, 2, 4)``."""
    match = _NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"{name!r} is not a PGD condition name (pgd_eps<E>_step<S>_n<N>)")
    return AttackSetting(float(match["eps"]), float(match["step"]), int(match["steps"]))


def pgd_settings(eps: Sequence[float] = (8,), steps: Sequence[int] = (2, 4),
                 step: Sequence[float] | None = None) -> list[AttackSetting]:
    """Every combination of ``eps`` x ``steps`` (x ``step``); without ``step`` the step size is
    eps / steps (the rule both of the paper's settings follow). The defaults give the paper's
    two settings."""
    if not eps or not steps:
        raise ValueError("give at least one --eps and one --steps value")
    if any(int(n) != n or n < 1 for n in steps):
        raise ValueError(f"--steps takes positive integers, got {list(steps)}")
    out = []
    for e, n in itertools.product(eps, steps):
        for s in (step if step else [e / n]):
            setting = AttackSetting(float(e), round(float(s), 6), int(n))
            if setting not in out:
                out.append(setting)
    return out


def make_evaluator(model: nn.Module, settings: Sequence[AttackSetting], targets: torch.Tensor,
                   device: torch.device, backend: str = "native", attack: Callable | None = None,
                   exact: bool = False):
    """The ``evaluate`` callback of :func:`robust_attn.protocols.runner.run_chunks`.

    Records per image: ``index, label, target, pred, top1`` (pred == label), ``success``
    (pred == target), ``top5`` and ``linf`` (the largest pixel change, in [0, 1] image units).
    ``attack`` defaults to :func:`robust_attn.attacks.targeted_pgd`; ``exact=True`` is passed on to
    it (``exact=True`` only, so a custom ``attack`` without that keyword still works otherwise).
    """
    from robust_attn.attacks import PGDConfig

    if attack is None:
        from robust_attn.attacks import targeted_pgd as attack
    by_name = {s.name: s for s in settings}

    def records(indices, labels, tgt, logits, linf) -> pd.DataFrame:
        pred = finite_logits(logits, indices, "PGD").argmax(dim=1)
        return pd.DataFrame({
            "index": indices.numpy(), "label": labels.cpu().numpy(), "target": tgt.cpu().numpy(),
            "pred": pred.cpu().numpy(), "top1": (pred == labels).long().cpu().numpy(),
            "success": (pred == tgt).long().cpu().numpy(), "top5": topk_hits(logits, labels).cpu().numpy(),
            "linf": linf.cpu().numpy().round(7)})

    def evaluate(images, labels, indices, todo) -> Iterator[tuple[str, pd.DataFrame]]:
        images, labels = images.to(device), labels.to(device)
        tgt = targets[indices].to(device)
        for name in todo:
            if name == CLEAN:
                adv = images
            else:
                s = by_name[name]
                extra = {"exact": True} if exact else {}
                adv = attack(model, images, tgt, PGDConfig(s.eps, s.step, s.steps), backend=backend,
                             **extra).detach()
            with torch.no_grad():
                logits = model(adv)
            linf = (adv - images).abs().flatten(1).amax(dim=1)
            yield name, records(indices, labels, tgt, logits, linf)

    return evaluate


def _batch_checks(model, dataset, targets, settings, device, backend, batch_size: int = 8) -> list[dict]:
    """The attack's per-batch sanity checks (:func:`robust_attn.attacks.run_checks`: eval mode,
    determinism, perturbation within eps and images in [0, 1], non-zero input gradient, eps = 0
    reproduces clean) for every setting, on the first (up to) 8 images, at most ``batch_size``."""
    from robust_attn.attacks import PGDConfig, run_checks, targeted_pgd

    n = min(8, len(dataset), batch_size)
    images, _ = next(iter(DataLoader(dataset, batch_size=n)))
    images, tgt = images.to(device), targets[:n].to(device)
    out = []
    for s in settings:
        config = PGDConfig(s.eps, s.step, s.steps)
        adv = targeted_pgd(model, images, tgt, config, backend=backend)
        out += [{"setting": s.name, **r.to_dict()} for r in run_checks(model, images, tgt, adv, config, backend)]
    return out


def _sweep_check(records: pd.DataFrame, settings) -> dict:
    """Success must not fall as eps or steps grow (:func:`robust_attn.attacks.check_monotone_success`),
    over the whole run's records."""
    from robust_attn.attacks import PGDConfig, check_monotone_success

    rates = records.groupby("condition")["success"].mean()
    result = check_monotone_success({PGDConfig(s.eps, s.step, s.steps): float(rates[s.name]) for s in settings
                                     if s.name in rates.index})
    return {"setting": "all", **result.to_dict()}


def run_pgd(model: nn.Module, dataset, out_dir, *, num_classes: int,
            settings: Sequence[AttackSetting] = PAPER_SETTINGS, seed: int = 0, backend: str = "native",
            targets_file: str | Path | None = None, batch_size: int = 64, device: str | torch.device = "cpu",
            run_info: dict | None = None, rank: int = 0, world_size: int = 1, num_workers: int = 0,
            progress: bool = True, attack: Callable | None = None, checks: bool = True, exact: bool = False,
            targets: torch.Tensor | None = None, model_info=None):
    """Run (or resume) targeted PGD (clean condition plus each setting) into ``out_dir``.

    ``model`` is any module taking [0, 1] images (normalization inside, e.g. a
    :class:`~robust_attn.models.wrapper.NormalizedModel`). The targets are drawn with ``seed``, or given
    as ``targets`` (a tensor: one class per image, in dataset order) or ``targets_file`` (another
    run's ``targets.csv``); they are saved (``targets.csv``). ``model_info`` says where the
    model came from, as for :func:`robust_attn.protocols.rotation.run_rotation` (recorded in
    ``run.json`` with the weights' sha256 and parameter count). ``checks=True`` runs the attack's sanity checks
    once on the first images, and the sweep's monotonicity check on the finished records, and
    saves them (``checks.json``: name, passed, detail, setting). Returns the RunStore.

    ``exact=True`` runs the attack in its exact mode (:func:`robust_attn.attacks.targeted_pgd`):
    every backend on power-of-two blocks of each chunk, the native one in the libraries' float
    order, so native, torchattacks and foolbox runs give bit-identical records at any
    ``batch_size`` (the ragged last chunk included); it is recorded in ``run.json`` as
    ``parameters["exact"]``. The per-batch sanity checks always exercise the default mode.
    """
    from robust_attn.sources.provenance import with_provenance

    if not isinstance(exact, bool):
        raise TypeError(f"exact must be a bool (True: bit-identical across backends), got {exact!r}")
    device = torch.device(device)
    model = model.to(device).eval()
    settings = list(settings)
    labels = dataset_labels(dataset)
    targets, source = prepare_targets(labels, num_classes, seed, targets_file, targets=targets)
    conditions = [{"name": CLEAN, "eps": 0.0, "step": 0.0, "steps": 0}] + [s.as_dict() for s in settings]
    store = open_run(out_dir, with_provenance(model, run_info, model_info, dataset), protocol=PROTOCOL,
                     parameters={"norm": "Linf", "units": IMAGE_UNITS, "targeted": True, "random_start": False,
                                 "backend": backend, "exact": exact, "seed": int(seed), "targets": source},
                     conditions=conditions, num_images=len(dataset), chunk_size=batch_size, rank=rank, device=device)
    if rank == 0:
        save_targets(out_dir, labels, targets)
    checks_path = Path(out_dir) / CHECKS_FILE
    if checks and rank == 0 and not checks_path.is_file():
        if progress:  # tens of seconds with no output otherwise looks hung
            print(f"pgd: sanity checks on the first {min(8, len(dataset), batch_size)} images (eps 0, gradients, "
                  f"bounds)...",
                  file=sys.stderr, flush=True)
        atomic_write_json(checks_path, _batch_checks(model, dataset, targets, settings, device, backend,
                                                       batch_size))
    run_chunks(store, dataset, [c["name"] for c in conditions],
               make_evaluator(model, settings, targets, device, backend, attack, exact=exact),
               chunk_size=batch_size, rank=rank, world_size=world_size, num_workers=num_workers,
               progress=progress and rank == 0, desc="pgd")
    barrier()
    if checks and rank == 0:
        from robust_attn.runs.store import load_records

        saved = [c for c in load_checks(out_dir) if c.get("setting") != "all"]
        atomic_write_json(checks_path, saved + [_sweep_check(load_records(out_dir), settings)])
    return store


def summarize_pgd(records: pd.DataFrame) -> pd.DataFrame:
    """Per condition (percent): ``success_rate`` and ``top1`` over all images, and both on the
    images the model classifies correctly without attack (``*_clean_correct``), from the records;
    ``max_linf``: the largest pixel change, in 1/255 units (as the condition names)."""
    clean = records[records["condition"] == CLEAN].set_index("index")["top1"]
    rows = []
    for condition, group in records.groupby("condition", sort=False):
        correct = group["index"].map(clean).fillna(0).astype(bool) if len(clean) else None
        row = {"condition": condition, "n": len(group), "success_rate": group["success"].mean() * 100,
               "top1": group["top1"].mean() * 100, "max_linf": group["linf"].max() * 255}
        if correct is not None:
            sub = group[correct.to_numpy()]
            row.update(n_clean_correct=len(sub),
                       success_rate_clean_correct=sub["success"].mean() * 100 if len(sub) else float("nan"),
                       top1_clean_correct=sub["top1"].mean() * 100 if len(sub) else float("nan"))
        rows.append(row)
    return pd.DataFrame(rows)


def load_checks(run_dir) -> list[dict]:
    path = Path(run_dir) / CHECKS_FILE
    return json.loads(path.read_text()) if path.is_file() else []


def _describe(config) -> str:
    eps = ", ".join(f"{e:g}" for e in _in_levels(config.sweep_eps))
    sweep = f" plus eps {{{eps}}}/255 with {config.sweep_steps} steps of eps/{config.sweep_steps}" if eps else ""
    return (f"PGD: targeted L-inf, Table 10's {{8, 4, 2}} and {{8, 2, 4}}{sweep}, {config.backend} backend; "
            f"every model attacked towards the same targets (seed {config.seed}).")


def _in_levels(radii) -> list[float]:
    """Radii in image units as Table 10 names them, in 1/255 units (to 1e-6)."""
    return [round(r * 255, 6) for r in radii]


@dataclass(frozen=True)
class PGDSettings(ProtocolSettings):
    """Table 10's PGD. ``eval pgd`` runs ``eps`` x ``steps`` (x ``step``), by default the paper's
    two settings; the study runs those two always, plus the sweep ``sweep_eps`` x ``sweep_steps``.
    Radii in image units (``8/255``), as everywhere; the conditions keep Table 10's names in 1/255
    units (``pgd_eps8_step2_n4``)."""

    sweep_eps: tuple[float, ...] = setting((2 / 255, 4 / 255, 8 / 255, 16 / 255),
                                           "the study's eps sweep beside Table 10's settings, comma list",
                                           scope="study", radius="linf")
    sweep_steps: int = setting(4, "PGD steps of the study's sweep, with step = eps / steps (the rule of both "
                                  "paper settings)", scope="study")
    backend: str = setting("native", "PGD backend", choices=BACKENDS)
    eps: tuple[float, ...] = setting((8 / 255,), "L-inf radius(es), comma list (the study: Table 10's 8/255 and "
                                                 "its sweep)", scope="eval", radius="linf")
    steps: tuple[int, ...] = setting((2, 4), "iteration count(s), comma list (with eps 8/255: the paper's {8,4,2} "
                                             "and {8,2,4})", scope="eval")
    step: tuple[float, ...] | None = setting(None, "step size(s), comma list, e.g. 2/255 (default: eps/steps, the "
                                                   "paper's rule)", scope="eval", radius="linf")
    targets: str | None = setting(None, "reuse another run's targets.csv (same images) instead of drawing",
                                  scope="eval")
    no_checks: bool = setting(False, "skip the attack sanity checks (the study runs them)", scope="eval")
    exact: bool = setting(False, "exact mode: bit-identical images across the native, torchattacks and foolbox "
                                 "backends at any --batch-size (slower native attack; the study runs the fast "
                                 "mode)", scope="eval")

    def check(self, study) -> None:
        if self.sweep_steps < 1 or any(not 0 < e <= 1 for e in self.sweep_eps):
            raise ValueError(f"sweep_eps are radii in image units, in (0, 1] (e.g. 8/255), and sweep_steps at "
                             f"least 1; got {list(self.sweep_eps)} and {self.sweep_steps}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.targets and not Path(self.targets).is_file():
            raise ValueError(f"--targets {self.targets} does not exist; pass another run's targets.csv")
        self.eval_settings()   # eps x steps x step: a ValueError naming what is wrong

    def attack_settings(self) -> list[AttackSetting]:
        """The study's: Table 10's two settings, then the sweep (without repeating a paper setting)."""
        settings = list(PAPER_SETTINGS)
        if self.sweep_eps:
            settings += [s for s in pgd_settings(_in_levels(self.sweep_eps), [self.sweep_steps]) if s not in settings]
        return settings

    def eval_settings(self) -> list[AttackSetting]:
        """``eval pgd``'s: every combination of ``eps`` x ``steps`` (x ``step``)."""
        return pgd_settings(_in_levels(self.eps), list(self.steps),
                            None if self.step is None else _in_levels(self.step))


def _summary(ctx, settings, store) -> str:
    from robust_attn.runs.store import load_records

    summary = summarize_pgd(load_records(store.root)).set_index("condition")
    parts = [f"{s.name}: success {summary.loc[s.name, 'success_rate']:.1f}, top-1 {summary.loc[s.name, 'top1']:.1f}"
             for s in settings.eval_settings()]
    failed = [f"{c['setting']}: {c['name']} ({c['detail']})" for c in load_checks(store.root) if not c["passed"]]
    if failed:
        print(f"WARNING: {len(failed)} attack sanity check(s) failed (see {store.root / CHECKS_FILE}): "
              + "; ".join(failed[:3]), file=sys.stderr)
    return f"clean top-1 {summary.loc['clean', 'top1']:.1f}; {'; '.join(parts)}"


@eval_protocol("pgd", settings=PGDSettings, summary=_summary, help="white-box targeted L-inf PGD (SAN Table 10)")
def eval_pgd(ctx, model, settings):
    """``robust-attn eval pgd``: Table 10's targeted PGD on one model."""
    for e in settings.eps:
        if e > 32 / 255:
            warnings.warn(f"--eps {e:g} is {e * 255:g}/255 of the pixel range (Table 10's is 8/255); a radius is in "
                          f"image units in every command")
    return run_pgd(model, ctx.dataset, ctx.out, num_classes=ctx.info.num_classes, settings=settings.eval_settings(),
                   seed=ctx.seed, backend=settings.backend, targets_file=settings.targets,
                   checks=not settings.no_checks, exact=settings.exact, **ctx.loop)


def _passes(config) -> Passes:
    """The clean pass, and per setting one pass on its adversarial images after its steps."""
    settings = PGDSettings.of(config).attack_settings()
    return Passes(forward=1 + len(settings), backward=sum(s.steps for s in settings))


@study_protocol("pgd", summary="SAN Table 10's targeted PGD {8, 4, 2} and {8, 2, 4} plus an eps sweep",
                describe=_describe, default_order=1, settings=PGDSettings, passes=_passes)
def study_pgd(ctx, entry, model):
    """The study's Table 10 step: every image of the study, the same targets for every model."""
    out = ctx.run_dir("pgd", entry.name)
    settings = PGDSettings.of(ctx.config).attack_settings()
    run_pgd(model, ctx.dataset, out, num_classes=ctx.info.num_classes, settings=settings,
            seed=ctx.config.seed, backend=ctx.config.backend, batch_size=ctx.config.batch_size, device=ctx.device,
            run_info=ctx.run_info(entry, model), progress=ctx.progress, **ctx.shard)
    return out
