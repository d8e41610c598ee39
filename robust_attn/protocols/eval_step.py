"""How a protocol joins ``robust-attn eval``: a registered step, with options from its settings.

A protocol module decorates ``step(ctx, model, settings) -> RunStore`` with :func:`eval_protocol`;
``robust-attn eval NAME`` then exists with the options every ``eval`` subcommand has (model,
data, output: :func:`robust_attn.commands.eval_common.add_common_options`) plus one per field of
its :class:`~robust_attn.protocols.settings.ProtocolSettings` (``--name-with-dashes``; checked by
its ``check`` before the model loads). These are the same settings the protocol's study step
takes, so ``eval`` and the study share every default. The step gets an :class:`EvalContext`
(the model's images, its run directory and description, the device and this process's shard)
and the settings, and writes a resumable run directory, as every protocol does; ``summary``
says the finished run in one line (default: top-1 per condition).

Every built-in subcommand is registered so (``eval rotation`` in
:mod:`robust_attn.protocols.rotation`, ...). A protocol that evaluates several models at once
(``eval transfer``) says ``models="sources-targets"``: its settings then hold ``source`` and
``target`` model specs, which the command loads, and ``model`` is the pair
``(sources, targets)``, each a list of ``(name, model, description)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from robust_attn.utils.plugins import Registry

__all__ = ["EvalContext", "EvalProtocol", "EVAL_PROTOCOLS", "eval_protocol"]


@dataclass
class EvalContext:
    """What an eval step gets: the dataset's info, the images (through the model's own
    preprocessing), the run directory, the run description (model, data, command), the device,
    this process's shard and the loop's options."""

    info: Any
    dataset: Any
    out: Path
    run_info: dict
    device: Any
    rank: int = 0
    world_size: int = 1
    batch_size: int = 64
    num_workers: int = 0
    progress: bool = True
    seed: int = 0
    data: dict = field(default_factory=dict)   # the command's dataset, root, split and limit
    repair: bool = False

    @property
    def loop(self) -> dict:
        """The keyword arguments every protocol's run function takes for the loop."""
        return {"batch_size": self.batch_size, "device": self.device, "run_info": self.run_info, "rank": self.rank,
                "world_size": self.world_size, "num_workers": self.num_workers, "progress": self.progress}


@dataclass(frozen=True)
class EvalProtocol:
    name: str
    step: Callable
    settings: type
    help: str = ""
    summary: Callable | None = None      # (ctx, settings, store) -> the line printed when it finished
    run_name: Callable | None = None     # (settings) -> the run's name in the default --out (default: name)
    models: str = "one"                  # "one" (--model ...) or "sources-targets" (the settings' specs)


#: every eval step a protocol registered, from the modules of robust_attn.protocols
EVAL_PROTOCOLS: Registry[EvalProtocol] = Registry("eval protocol", package="robust_attn.protocols", error=ValueError)


def eval_protocol(name: str, *, settings: type, help: str = "", summary: Callable | None = None,
                  run_name: Callable | None = None, models: str = "one"):
    """Decorator: register ``step(ctx, model, settings) -> RunStore`` as ``robust-attn eval
    NAME``, its options the fields of ``settings``; ``help``: the subcommand's one line;
    ``summary``, ``run_name`` and ``models``: see :class:`EvalProtocol` and the module docstring."""
    if models not in ("one", "sources-targets"):
        raise ValueError(f"models must be 'one' or 'sources-targets', got {models!r}")

    def add(step: Callable) -> Callable:
        EVAL_PROTOCOLS.register(name, EvalProtocol(name, step, settings, help or (step.__doc__ or "").split("\n")[0],
                                                   summary, run_name, models))
        return step

    return add
