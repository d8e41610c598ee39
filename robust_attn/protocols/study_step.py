"""How a protocol joins ``robust-attn study``: one registered step per protocol, in its own file.

A protocol module (or an attack's, :func:`robust_attn.protocols.attack.study_attack`) decorates a
function with :func:`study_protocol`; the study
(:mod:`robust_attn.study.run`) runs the steps that ``StudyConfig.protocols`` names, in that order,
and nothing else in the study names protocols. Two kinds of step:

* per model (``per_model=True``): ``step(ctx, entry, model) -> Path`` runs the protocol on one
  model (``entry.name`` its label; ``ctx.dataset`` and ``ctx.attack_dataset`` its images, through
  its own preprocessing) and returns its run directory;
* across models (``per_model=False``): ``step(ctx, entries, models) -> list[Path]`` runs once
  with every model loaded (e.g. the transfer matrix), after all per-model steps.

Every step writes resumable run directories under ``ctx.runs_dir`` and may be called again
after an interruption; under torchrun each rank computes a shard (``ctx.shard``).

A step says what it costs, for the study's plan (:mod:`robust_attn.study.estimate`):
``passes(config) -> Passes``, the passes through the model per image under the study's config
(a step registered without one is planned with an unknown cost).

A step also says what it ran, for the report's preamble: ``describe(config) -> str``, one
sentence from the study's config, and ``attack_subset=True`` when it runs on the seeded subset
of the expensive attacks (``ctx.attack_dataset``) rather than on every image of the study. The
preamble then describes exactly the protocols the study ran, each in its own words.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from robust_attn.utils.plugins import Registry

__all__ = ["StudyContext", "study_run_dir", "Passes", "StudyProtocol", "STUDY_PROTOCOLS", "study_protocol",
           "list_study_protocols", "default_study_protocols"]


@dataclass(frozen=True)
class Passes:
    """Passes through the model per image of the step's images: ``forward`` (no gradient) and
    ``backward`` (a forward and a backward pass to the input). ``bound``: an upper bound (the
    attack stops early on fooled images). ``images``: ``"study"`` (every image of the study),
    ``"attack"`` (the attack subset) or ``"autoattack"`` (AutoAttack's part of it); ``per_target``:
    forward passes per image through each *other* model (the transfer matrix's targets); ``least``:
    for a bound, the passes made even if every image is fooled at once (None: the bound itself)."""

    forward: float = 0.0
    backward: float = 0.0
    images: str = "study"
    bound: bool = False
    per_target: float = 0.0
    least: "Passes | None" = None

    def seconds(self, forward_s: float, backward_s: float, num_images: int, targets_forward_s: float = 0.0) -> float:
        """Seconds for ``num_images`` images, given one image's forward and forward-backward
        seconds through this model, and the sum over the other models of one image's forward."""
        return num_images * (self.forward * forward_s + self.backward * backward_s
                             + self.per_target * targets_forward_s)


@dataclass
class StudyContext:
    """What every study step gets: the config (:class:`robust_attn.study.config.StudyConfig`), the
    dataset's info, the evaluation images (``dataset``: the whole split or ``config.limit``;
    ``attack_dataset``: the seeded subset the expensive attacks use), where runs go, the device
    and this process's shard, and :meth:`run_info` for a model's part of run.json."""

    config: Any
    info: Any
    dataset: Any
    attack_dataset: Any
    runs_dir: Path
    device: Any
    rank: int = 0
    world_size: int = 1
    progress: bool = True
    base_info: dict = field(default_factory=dict)
    log: Callable[[str], None] = print

    @property
    def shard(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size}

    def run_info(self, entry, model) -> dict:
        described = getattr(entry, "description", None)
        if described is not None:   # the study's models (any source): where it came from, under its label
            return {**self.base_info, **described, "model": entry.name}
        arch = getattr(model, "arch_args", None) or entry.arch
        return {**self.base_info, "model": (arch or {}).get("name", entry.name), "zoo_entry": entry.name,
                "arch": arch, "checkpoint": {"path": entry.weights, "sha256": entry.sha256}}

    def run_dir(self, protocol: str, name: str) -> Path:
        return study_run_dir(self.runs_dir, protocol, name)


def study_run_dir(runs_dir, protocol: str, name: str) -> Path:
    """The run folder of ``protocol`` for the model labelled ``name`` in a study's ``runs_dir``."""
    return Path(runs_dir) / f"{protocol}-{name}"


@dataclass(frozen=True)
class StudyProtocol:
    name: str
    step: Callable
    per_model: bool = True
    summary: str = ""
    chunked: bool = True     # writes through claimed record chunks, so several study workers can share it
    describe: Callable[[Any], str] | None = None   # the report preamble's sentence, from the study config
    attack_subset: bool = False   # runs on the attack subset, not on every image of the study
    default_order: int | None = None   # its place in the study's default protocols; None: run when asked
    settings: type | None = None   # its ProtocolSettings: fields of the study config, options of `study`
    passes: Callable[[Any], Passes] | None = None   # its cost per image under a study config (the plan's)


#: every protocol's study step, from the modules of :mod:`robust_attn.protocols` (and of
#: :mod:`robust_attn.attacks`, where an attack may register its own study step)
STUDY_PROTOCOLS: Registry[StudyProtocol] = Registry("study protocol",
                                                    package=("robust_attn.protocols", "robust_attn.attacks"),
                                                    error=ValueError)


def study_protocol(name: str, *, per_model: bool = True, summary: str = "", chunked: bool = True,
                   describe: Callable[[Any], str] | None = None, attack_subset: bool = False,
                   default_order: int | None = None, settings: type | None = None,
                   passes: Callable[[Any], Passes] | None = None):
    """Decorator: register ``fn`` as the study step of protocol ``name``. ``chunked=False``: the
    step writes files of its own rather than claimed record chunks, so only the study's main
    process runs it. ``describe`` and ``attack_subset``: what the report's preamble says of it
    (module docstring). ``default_order``: where it runs in a study that names no protocols (in
    increasing order; ``None``: only when named). ``settings``: its
    :class:`~robust_attn.protocols.settings.ProtocolSettings` (the study config's fields and the
    command line's options it adds, checked by its ``check``). ``passes``: its :class:`Passes`
    per image under a study config, for the study's plan."""

    def add(fn: Callable) -> Callable:
        STUDY_PROTOCOLS.register(name, StudyProtocol(name, fn, per_model,
                                                     summary or (fn.__doc__ or "").split("\n")[0],
                                                     chunked, describe, attack_subset, default_order,
                                                     settings, passes))
        return fn

    return add


def list_study_protocols() -> list[str]:
    return STUDY_PROTOCOLS.names()


def default_study_protocols() -> tuple[str, ...]:
    """The protocols a study runs when its config names none, in the order they run."""
    chosen = [(p.default_order, name) for name, p in STUDY_PROTOCOLS.items() if p.default_order is not None]
    return tuple(name for _, name in sorted(chosen))


def replace(ctx: StudyContext, **changes) -> StudyContext:
    return dataclasses.replace(ctx, **changes)
