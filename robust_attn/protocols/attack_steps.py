"""The study steps of the evaluation attacks (:mod:`robust_attn.protocols.attack`): AutoAttack,
APGD-CE alone and Square alone on the study's seeded attack subset, each with its settings (the
study config's fields and ``robust-attn study``'s options), the sentence the report's preamble
says of it, and its cost per image for the study's plan.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from robust_attn.attacks.base import AttackConfig
from robust_attn.protocols.attack import study_attack
from robust_attn.protocols.settings import ProtocolSettings, setting
from robust_attn.protocols.study_step import Passes, study_protocol

__all__ = ["AttackStepSettings", "AutoAttackSettings", "APGDSettings", "SquareSettings", "autoattack_images"]


def _levels(radii) -> str:
    """Radii in image units as the report names them: ``1, 2, 4`` (in 1/255)."""
    return ", ".join(f"{round(e * 255, 6):g}" for e in radii)


def _describe_autoattack(config) -> str:
    eps = _levels(config.autoattack_eps)
    steps = f" with {config.attack_steps} iterations per member" if config.attack_steps else ""
    images = f" on a seeded {config.autoattack_limit:,} of them" if config.autoattack_limit else ""
    return f"AutoAttack's standard ensemble, untargeted L-inf, at eps {{{eps}}}/255{steps}{images}"


def _describe_apgd(config) -> str:
    eps = _levels(config.apgd_eps)
    steps = config.attack_steps or 100
    return (f"APGD-CE alone (AutoAttack's first member), untargeted L-inf, {steps} iterations, at eps {{{eps}}}/255: "
            f"an upper bound on robust accuracy at radii where the whole ensemble is beyond a CPU")


def _describe_square(config) -> str:
    return f"Square alone at {_levels([config.square_eps])}/255 with {config.square_queries} queries"


def _check_eps(name: str, eps) -> None:
    if any(not 0 < e <= 1 for e in eps):
        raise ValueError(f"{name} are radii in image units, in (0, 1] (e.g. 8/255); got {list(eps)}")


@dataclass(frozen=True)
class AttackStepSettings(ProtocolSettings):
    attack_steps: int | None = setting(None, "iterations of AutoAttack's members and of APGD-CE (default: their "
                                             "standard 100)")

    def check(self, study) -> None:
        if self.attack_steps is not None and self.attack_steps < 1:
            raise ValueError(f"attack_steps must be at least 1 (or unset for AutoAttack's standard 100), "
                             f"got {self.attack_steps}")


@dataclass(frozen=True)
class AutoAttackSettings(AttackStepSettings):
    autoattack_eps: tuple[float, ...] = setting((1 / 255, 2 / 255, 4 / 255, 8 / 255), "AutoAttack L-inf radii, comma "
                                                "list", radius="linf")
    autoattack_limit: int | None = setting(None, "AutoAttack on a seeded subset of this many of the attack subset's "
                                                 "images (the others' attacks run on all of them; default: all)",
                                           scope="study")

    def check(self, study) -> None:
        super().check(study)
        _check_eps("autoattack_eps", self.autoattack_eps)
        if self.autoattack_limit is not None and self.autoattack_limit < 1:
            raise ValueError(f"autoattack_limit must be positive (or unset for the whole attack subset), got "
                             f"{self.autoattack_limit}")


def autoattack_images(dataset, limit: int | None):
    """The images AutoAttack runs on: a seeded ``limit`` of ``dataset`` (the study's attack subset,
    so they are among the images APGD-CE, Square and transfer run on), or all of it. Its records'
    ``index`` is the position in that subset."""
    from robust_attn.data import subset_dataset
    from robust_attn.data.splits import subset_indices

    keep = subset_indices(len(dataset), limit)
    return dataset if keep is None else subset_dataset(dataset, keep)


@dataclass(frozen=True)
class APGDSettings(AttackStepSettings):
    apgd_eps: tuple[float, ...] = setting((1 / 255, 2 / 255, 4 / 255), "APGD-CE (protocol apgd) L-inf radii, comma "
                                          "list", radius="linf")

    def check(self, study) -> None:
        super().check(study)
        _check_eps("apgd_eps", self.apgd_eps)


@dataclass(frozen=True)
class SquareSettings(ProtocolSettings):
    square_eps: float = setting(8 / 255, "Square's L-inf radius", radius="linf")
    square_queries: int = setting(5000, "Square's budget")

    def check(self, study) -> None:
        _check_eps("square_eps", (self.square_eps,))
        if self.square_queries < 1:
            raise ValueError(f"square_queries must be positive, got {self.square_queries}")


#: AutoAttack's standard members: APGD-T and FAB-T each run against 9 target classes
_AA_TARGETS = 9


def _steps(config) -> int:
    return config.attack_steps or 100


def _autoattack_passes(config) -> Passes:
    """Per radius: APGD-CE, then APGD-T and FAB-T against each of 9 targets, then Square's
    queries, each on the images still robust (counted as every image: a bound)."""
    radii = len(config.autoattack_eps)
    per_radius_backward = _steps(config) * (1 + 2 * _AA_TARGETS)
    return Passes(forward=1 + radii * (1 + config.square_queries), backward=radii * per_radius_backward,
                  images="autoattack", bound=True, least=Passes(forward=1 + radii, backward=radii * _steps(config),
                                                                images="autoattack"))


def _apgd_passes(config) -> Passes:
    radii = len(config.apgd_eps)
    return Passes(forward=1 + radii, backward=radii * _steps(config), images="attack", bound=True)


def _square_passes(config) -> Passes:
    return Passes(forward=2 + config.square_queries, images="attack", bound=True,
                  least=Passes(forward=3, images="attack"))


def _at_radii(config, attack: str, radii) -> list[AttackConfig]:
    """``attack`` at each of ``radii``, with the study's iterations and seed."""
    return [AttackConfig(attack, eps=e, steps=config.attack_steps, seed=config.seed) for e in radii]


@study_protocol("autoattack", summary="AutoAttack (standard, untargeted L-inf) at each eps on the attack subset",
                describe=_describe_autoattack, attack_subset=True, default_order=3,
                settings=AutoAttackSettings, passes=_autoattack_passes)
def study_autoattack(ctx, entry, model):
    """RobustBench's number: AutoAttack's standard ensemble at ``config.autoattack_eps``, on
    ``config.autoattack_limit`` of the attack subset's images (:func:`autoattack_images`)."""
    images = autoattack_images(ctx.attack_dataset, ctx.config.autoattack_limit)
    return study_attack(dataclasses.replace(ctx, attack_dataset=images), entry, model, "autoattack",
                        _at_radii(ctx.config, "autoattack", ctx.config.autoattack_eps))


@study_protocol("apgd", summary="APGD-CE (untargeted L-inf) at each small eps on the attack subset",
                describe=_describe_apgd, attack_subset=True, default_order=2, settings=APGDSettings,
                passes=_apgd_passes)
def study_apgd(ctx, entry, model):
    """APGD-CE alone at ``config.apgd_eps``: AutoAttack's first and cheapest member, where the
    other three cost 6-23 CPU-seconds per surviving image on the CIFAR-10 zoo
    (``benchmarks/bench_autoattack_members.py``). Its top-1 bounds AutoAttack's from above; how
    tight the bound is shows in the report's members table (AutoAttack's ``by``: which member
    fooled each image first). It ranks the models at radii where some images survive a strong
    attack, which 8/255 does not on an undefended zoo."""
    return study_attack(ctx, entry, model, "apgd", _at_radii(ctx.config, "apgd-ce", ctx.config.apgd_eps))


@study_protocol("square", summary="Square (score-based, no gradients) on the attack subset",
                describe=_describe_square, attack_subset=True, default_order=4, settings=SquareSettings,
                passes=_square_passes)
def study_square(ctx, entry, model):
    """The black-box reference: Square alone on every image, ``config.square_queries`` queries."""
    return study_attack(ctx, entry, model, "square", [
        AttackConfig("square", eps=ctx.config.square_eps, queries=ctx.config.square_queries,
                     seed=ctx.config.seed)])
