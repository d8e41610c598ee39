"""``robust-attn eval attack``: any registered attack (PGD, APGD, FAB, Square, AutoAttack) on one
model, through :func:`robust_attn.protocols.attack.run_attack`, with the gradient-masking checks.

:class:`AttackOptions` are an attack's settings on the command line, shared with ``eval
transfer`` (:mod:`robust_attn.protocols.transfer`). The study runs its attacks with settings of
its own (the ``apgd``, ``autoattack`` and ``square`` steps of :mod:`robust_attn.protocols.attack`),
so these are options of ``eval`` only. Radii are in image units (``8/255``), as everywhere.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from robust_attn.attacks.base import NORMS, AttackConfig, list_attacks
from robust_attn.attacks.fast_model import ATTACK_COPY_MODES
from robust_attn.protocols.attack import run_attack, summarize_attack
from robust_attn.protocols.eval_step import eval_protocol
from robust_attn.protocols.settings import ProtocolSettings, setting

__all__ = ["AttackOptions", "AttackSettings", "eval_attack"]


@dataclass(frozen=True)
class AttackOptions(ProtocolSettings):
    """One attack at one or more radii: one :class:`AttackConfig` per ``eps``."""

    attack: str | None = setting(None, lambda: f"attack name ({', '.join(list_attacks())})", scope="eval")
    norm: str = setting("linf", "threat model", choices=NORMS, scope="eval")
    eps: tuple[float, ...] = setting((8 / 255,), "radius(es), comma list: 8/255 or 0.031", scope="eval",
                                     radius="norm")
    targeted: bool = setting(False, "attack toward seeded wrong-class targets", scope="eval")
    steps: int | None = setting(None, "iterations (default: the attack's own)", scope="eval")
    step: float | None = setting(None, "step size, e.g. 2/255 (PGD; default: the attack's own)", scope="eval",
                                 radius="norm")
    restarts: int = setting(1, "random restarts, strongest kept per image", scope="eval")
    queries: int | None = setting(None, "query budget of score-based attacks (Square)", scope="eval")
    attack_seed: int = setting(0, "seed of the attack's random draws", scope="eval")

    def check(self, study) -> None:
        if self.attack is None:
            raise ValueError(f"give --attack NAME ({', '.join(list_attacks())})")
        self.configs()

    def configs(self) -> list[AttackConfig]:
        return [AttackConfig(self.attack, norm=self.norm, eps=e, targeted=self.targeted, steps=self.steps,
                             restarts=self.restarts, step=self.step, queries=self.queries, seed=self.attack_seed)
                for e in self.eps]


@dataclass(frozen=True)
class AttackSettings(AttackOptions):
    targets: str | None = setting(None, "reuse another run's targets.csv (same images) for --targeted", scope="eval")
    no_checks: bool = setting(False, "skip the gradient-masking checks", scope="eval")
    attack_copy: str = setting("auto", "whether the attacks query the attack-time copy of the model (batch norm "
                               "folded, channels-last input: the same function, faster on a CPU, rounded "
                               "differently) or the model as given; auto: the copy on a CPU; recorded in run.json",
                               choices=ATTACK_COPY_MODES, scope="eval")

    def check(self, study) -> None:
        super().check(study)
        if self.targets and not Path(self.targets).is_file():
            raise ValueError(f"--targets {self.targets} does not exist; pass another run's targets.csv")


def _warn_flagged(root: Path) -> None:
    path = Path(root) / "checks.json"
    if not path.is_file():
        return
    flagged = [c for c in json.loads(path.read_text()) if c.get("verdict", "pass") != "pass"
               or c.get("passed", True) is False]
    if flagged:
        print(f"WARNING: {len(flagged)} gradient-masking check(s) flagged (see {path}): "
              + "; ".join(f"{c['name']}: {c.get('detail', '')}" for c in flagged[:3]), file=sys.stderr)


def _summary(ctx, settings, store) -> str:
    from robust_attn.runs.store import load_records

    summary = summarize_attack(load_records(store.root)).set_index("condition")
    parts = [f"{c.name}: robust top-1 {summary.loc[c.name, 'robust_top1']:.1f}" for c in settings.configs()]
    _warn_flagged(store.root)
    return f"{settings.attack}: clean top-1 {summary.loc['clean', 'robust_top1']:.1f}; {'; '.join(parts)}"


@eval_protocol("attack", settings=AttackSettings, summary=_summary, run_name=lambda s: f"attack-{s.attack}",
               help="an evaluation attack (PGD, APGD, FAB, Square, AutoAttack) with per-image records and "
                    "gradient-masking checks")
def eval_attack(ctx, model, settings):
    """``robust-attn eval attack``: the attack at each radius on one model."""
    return run_attack(model, ctx.dataset, ctx.out, configs=settings.configs(), num_classes=ctx.info.num_classes,
                      seed=ctx.seed, targets_file=settings.targets, checks=not settings.no_checks, attack_copy=settings.attack_copy,
                      **ctx.loop)
