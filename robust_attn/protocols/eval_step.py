"""How a protocol joins ``robust-attn eval``: a registered step, with options from its settings.

A protocol module decorates ``step(ctx, model, settings) -> RunStore`` with :func:`eval_protocol`;
``robust-attn eval NAME`` then exists with the options every ``eval`` subcommand has (model,
data, output: :func:`robust_attn.commands.eval_common.add_common_options`) plus one per field of
its :class:`~robust_attn.protocols.settings.ProtocolSettings` (``--name-with-dashes``; checked by
its ``check``). The step gets an :class:`EvalContext` (the model's images, its run directory and
description, the device and this process's shard) and the settings, and writes a resumable run
directory, as every protocol does.
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
    extra: dict = field(default_factory=dict)


#: every eval step a protocol registered, from the modules of robust_attn.protocols
EVAL_PROTOCOLS: Registry[EvalProtocol] = Registry("eval protocol", package="robust_attn.protocols", error=ValueError)


def eval_protocol(name: str, *, settings: type, help: str = ""):
    """Decorator: register ``step(ctx, model, settings) -> RunStore`` as ``robust-attn eval
    NAME``, its options the fields of ``settings``; ``help``: the subcommand's one line."""

    def add(step: Callable) -> Callable:
        EVAL_PROTOCOLS.register(name, EvalProtocol(name, step, settings, help or (step.__doc__ or "").split("\n")[0]))
        return step

    return add
