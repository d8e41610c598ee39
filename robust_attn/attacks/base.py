"""The common interface of the evaluation attacks, and their registry.

Every attack is one file in this package holding one :class:`Attack` subclass decorated with
:func:`register_attack`; nothing else names attacks. An attack is built from an
:class:`AttackConfig` (validated when made) and run on a model that takes images in [0, 1]
(a :class:`~robust_attn.models.wrapper.NormalizedModel`, in eval mode)::

    >>> from robust_attn.attacks.base import AttackConfig, make_attack
    >>> attack = make_attack(AttackConfig("apgd-ce", norm="linf", eps=8 / 255))
    >>> out = attack.run(model, images, labels)          # AttackOutput(adv, queries)

Units: ``eps`` and ``step`` are in [0, 1] image units (8/255, not 8). :func:`parse_eps` reads the
CLI's ``8/255`` or ``0.0314``. L-inf eps must lie in [0, 1]; an L2 eps in [0, sqrt(C*H*W)] (the
diameter of the image cube), and one below 0.01 draws a warning, since it most likely was meant in
1/255 units (RobustBench's CIFAR L2 radius is 0.5).

Targeted and untargeted: ``targeted=True`` attacks toward the ``targets`` given to :meth:`Attack.run`
(success = prediction equals the target); otherwise success is any misclassification. An attack
lists what it supports in ``Attack.targeted_modes``; asking for another mode is a clear error.
"""
from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch
import torch.nn as nn

from robust_attn.utils.plugins import Registry
from robust_attn.utils.radius import RadiusError, parse_radius

__all__ = ["AttackConfig", "AttackOutput", "Attack", "ATTACKS", "register_attack", "make_attack",
           "list_attacks", "parse_eps", "NORMS", "SCHEDULES", "AttackInputError"]

NORMS = ("linf", "l2")
SCHEDULES = ("constant", "cosine", "step")
L2_EPS_WARN = 0.01


class AttackInputError(ValueError):
    """A bad attack setting; the message names the fix."""


@dataclass(frozen=True)
class AttackConfig:
    """What an attack is asked to do. ``None`` fields take the attack's own default.

    ``attack``: a name from :func:`list_attacks`. ``norm``: "linf" or "l2". ``eps``: radius in
    [0, 1] image units. ``targeted``: attack toward given targets. ``steps``: iterations (gradient
    attacks). ``restarts``: random restarts; the strongest per image is kept. ``step``: step size
    in image units (PGD). ``schedule``: PGD step-size schedule ("constant", "cosine", "step").
    ``queries``: query budget (Square). ``seed``: seeds the attack's random draws.
    ``options``: attack-specific extras (e.g. ``{"n_target_classes": 9}``).
    """

    attack: str
    norm: str = "linf"
    eps: float = 8 / 255
    targeted: bool = False
    steps: int | None = None
    restarts: int = 1
    step: float | None = None
    schedule: str = "constant"
    queries: int | None = None
    seed: int = 0
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.norm not in NORMS:
            raise AttackInputError(f"unknown norm {self.norm!r}; choose one of {', '.join(NORMS)}")
        if isinstance(self.eps, bool) or not isinstance(self.eps, numbers.Real) or not math.isfinite(self.eps):
            raise AttackInputError(f"eps must be a finite number in image units (e.g. 8/255), got {self.eps!r}")
        if self.eps < 0:
            raise AttackInputError(f"eps must be >= 0, got {self.eps}")
        if self.norm == "linf" and self.eps > 1:
            raise AttackInputError(f"L-inf eps {self.eps:g} is above 1, the whole [0, 1] pixel range; eps is in "
                                   f"image units: write {self.eps:g}/255 for {self.eps:g} in 1/255 units")
        for name in ("steps", "queries"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                                      or value < 0):
                raise AttackInputError(f"{name} must be a non-negative int, got {value!r}")
        if isinstance(self.restarts, bool) or not isinstance(self.restarts, numbers.Integral) or self.restarts < 1:
            raise AttackInputError(f"restarts must be an int >= 1, got {self.restarts!r}")
        if self.step is not None and (not isinstance(self.step, numbers.Real) or not self.step > 0):
            raise AttackInputError(f"step must be a positive number in image units, got {self.step!r}")
        if self.schedule not in SCHEDULES:
            raise AttackInputError(f"unknown step schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if not isinstance(self.targeted, bool):
            raise AttackInputError(f"targeted must be a bool, got {self.targeted!r}")
        if self.norm == "l2" and 0 < self.eps < L2_EPS_WARN:
            warnings.warn(f"L2 eps {self.eps:g} is tiny: an L2 radius is the norm of the whole perturbation, "
                          f"in image units (RobustBench uses 0.5 on CIFAR-10); did you divide by 255?",
                          stacklevel=3)

    @property
    def name(self) -> str:
        """A condition name: ``apgd-ce_linf_eps8``, eps in 1/255 for L-inf and x1000 for L2."""
        if self.norm == "linf":
            size = f"eps{self.eps * 255:.6g}"
        else:
            size = f"eps{self.eps:.6g}".replace(".", "p")
        tags = [self.attack, self.norm, size]
        if self.targeted:
            tags.append("t")
        if self.steps is not None:
            tags.append(f"n{self.steps}")
        if self.restarts > 1:
            tags.append(f"r{self.restarts}")
        return "_".join(tags).replace("/", "-")

    def as_dict(self) -> dict:
        return {"name": self.name, **asdict(self)}


@dataclass
class AttackOutput:
    """``adv``: adversarial images (N, C, H, W) in [0, 1], within ``eps`` of the input.
    ``queries``: per-image model queries used (score-based attacks), else None.
    ``by``: per image, which part of an ensemble produced ``adv`` ("" where none succeeded),
    else None."""

    adv: torch.Tensor
    queries: torch.Tensor | None = None
    by: list[str] | None = None


class Attack:
    """Base class. Subclasses set ``name``, ``norms``, ``targeted_modes`` and implement :meth:`_run`.

    :meth:`run` validates the inputs (eval mode, [0, 1] images, one label and, when targeted, one
    wrong-class target per image), runs ``_run`` with the parameters frozen, and checks the result
    stays in the eps-ball and in [0, 1] (a violation is a bug in the attack: an error, never a
    silently wrong number).
    """

    name: ClassVar[str] = ""
    norms: ClassVar[tuple[str, ...]] = NORMS
    targeted_modes: ClassVar[tuple[bool, ...]] = (False, True)
    gradient_free: ClassVar[bool] = False
    paper: ClassVar[str] = ""
    #: where an attack that can save its progress mid-run reads and writes it (set by AutoAttack;
    #: :mod:`robust_attn.attacks.progress`); None: it runs without
    progress = None
    #: whether that progress may be resumed on another device type: its random numbers come from a
    #: CPU generator on every device (:mod:`robust_attn.attacks.rng`), not from the device's own
    portable_progress: ClassVar[bool] = False
    #: which model the attack's iterations query (:data:`~robust_attn.attacks.fast_model.ATTACK_COPY_MODES`):
    #: the attack-time copy (batch norm folded, channels-last input; the same function, rounded
    #: differently) or the model as given; ``auto``: the copy on a CPU. Set per instance by the
    #: attack protocol; the result is judged by the caller on the model as given.
    attack_copy: str = "auto"

    def __init__(self, config: AttackConfig):
        if config.norm not in self.norms:
            raise AttackInputError(f"attack {self.name!r} supports {', '.join(self.norms)}, not {config.norm!r}")
        if config.targeted not in self.targeted_modes:
            mode = "targeted" if config.targeted else "untargeted"
            other = "drop --targeted" if config.targeted else "add --targeted and targets"
            raise AttackInputError(f"attack {self.name!r} has no {mode} mode; {other}, or choose another attack "
                                   f"({', '.join(list_attacks())})")
        self.config = config

    def own_step_sizes(self, default_steps: int, why: str) -> int:
        """For attacks that choose their step sizes themselves (APGD, FAB): ``step`` and a
        ``schedule`` are errors (``why`` says what the attack does instead); returns the number
        of iterations, ``config.steps`` or ``default_steps``, at least 1."""
        c = self.config
        if c.step is not None:
            raise AttackInputError(f"{self.name} {why}: drop step={c.step!r}")
        if c.schedule != "constant":
            raise AttackInputError(f"{self.name} {why}: drop schedule={c.schedule!r}")
        steps = default_steps if c.steps is None else c.steps
        if steps < 1:
            raise AttackInputError(f"{self.name} needs steps >= 1 (default {default_steps}), got {steps}")
        return steps

    def target_classes(self, num_classes: int, default: int = 9) -> int:
        """How many of the most likely wrong classes the targeted runs of an untargeted attack
        take (AutoAttack's APGD-T and FAB-T): ``options["n_target_classes"]``, else
        ``min(default, num_classes - 1)``; a clear error when it is not an int in [1, C - 1]."""
        n = self.config.options.get("n_target_classes")
        if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1):
            raise AttackInputError(f"options['n_target_classes'] must be an int >= 1 (default "
                                   f"min({default}, num_classes - 1)), got {n!r}")
        n = min(default, num_classes - 1) if n is None else int(n)
        if n > num_classes - 1:
            raise AttackInputError(f"options['n_target_classes']={n} but the model has only {num_classes - 1} "
                                   f"wrong classes: use n_target_classes <= {num_classes - 1}")
        return n

    def run(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
            targets: torch.Tensor | None = None) -> AttackOutput:
        from robust_attn.attacks.inputs import frozen_parameters, validate_attack_inputs

        labels = labels.to(images.device, torch.long)
        if self.config.targeted:
            if targets is None:
                raise AttackInputError(f"targeted {self.name} needs targets (one wrong class per image; "
                                       f"see robust_attn.attacks.draw_targets)")
            targets = targets.to(images.device, torch.long)
            validate_attack_inputs(model, images, targets, labels)
        else:
            validate_attack_inputs(model, images, labels)
            targets = None
        with torch.enable_grad(), frozen_parameters(model):
            out = self._run(self.attacked_model(model, images), images.detach(), labels, targets)
        self._check_output(images, out.adv)
        out.adv = out.adv.detach()
        return out

    def attacked_model(self, model: nn.Module, images: torch.Tensor) -> nn.Module:
        """The model :meth:`_run` queries: :func:`~robust_attn.attacks.fast_model.attack_copy` of
        ``model`` where :attr:`attack_copy` resolves to it on the images' device, else ``model``."""
        from robust_attn.attacks.fast_model import attack_copy, resolve_attack_copy

        if not resolve_attack_copy(self.attack_copy, images.device):
            return model
        return attack_copy(model, images[:4].detach())

    def _run(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
             targets: torch.Tensor | None) -> AttackOutput:
        raise NotImplementedError

    def _check_output(self, images: torch.Tensor, adv: torch.Tensor) -> None:
        if adv.shape != images.shape or not torch.isfinite(adv).all():
            raise RuntimeError(f"{self.name} returned images of shape {tuple(adv.shape)} or non-finite values")
        if adv.min() < 0 or adv.max() > 1:
            raise RuntimeError(f"{self.name} left [0, 1]: values in [{adv.min().item():.4g}, {adv.max().item():.4g}]")
        delta = (adv - images).flatten(1)
        size = delta.abs().amax(1) if self.config.norm == "linf" else delta.norm(dim=1)
        slack = 1e-5 if self.config.norm == "linf" else 1e-4 * max(1.0, self.config.eps)
        if (size > self.config.eps + slack).any():
            raise RuntimeError(f"{self.name} exceeded its {self.config.norm} budget {self.config.eps:.6g}: "
                               f"largest perturbation {size.max().item():.6g}")


#: every attack, from the modules of :mod:`robust_attn.attacks` (one file each)
ATTACKS: Registry[type[Attack]] = Registry("attack", package="robust_attn.attacks", error=AttackInputError)


def register_attack(cls: type[Attack]) -> type[Attack]:
    """Class decorator: add ``cls`` under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a name")
    return ATTACKS.register(cls.name, cls)


def list_attacks() -> list[str]:
    return ATTACKS.names()


def make_attack(config: AttackConfig) -> Attack:
    """The attack ``config.attack`` set up with ``config``; unknown names get a suggestion."""
    return ATTACKS.get(config.attack)(config)


def parse_eps(text: str | float, norm: str = "linf") -> float:
    """``"8/255"`` -> 8/255; ``"0.5"`` or ``0.5`` -> 0.5 (image units): the radius syntax of every
    command and config (:func:`robust_attn.utils.radius.parse_radius`), with its errors raised as
    :class:`AttackInputError`."""
    try:
        return parse_radius(text, option="eps", norm=norm)
    except RadiusError as error:
        raise AttackInputError(str(error)) from None
