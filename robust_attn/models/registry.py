"""Model registry in the style of timm: ``register_model`` / ``create_model`` / ``list_models``.

Every architecture in the zoo is a function ``fn(num_classes=..., resolution=..., **overrides)``
decorated with :func:`register_model`. The function's name is the model's name. Nothing in
this module knows any model by name.
"""
from __future__ import annotations

import fnmatch
import inspect
from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from robust_attn.models.resolution import RESOLUTIONS
from robust_attn.utils.plugins import Registry

__all__ = ["ModelInfo", "MODELS", "register_model", "create_model", "list_models", "model_info"]


@dataclass(frozen=True)
class ModelInfo:
    """What the registry knows about an architecture besides its constructor."""

    name: str
    family: str
    paper: str
    entrypoint: Callable[..., nn.Module]


#: every architecture, from the family modules of :mod:`robust_attn.models`
MODELS: Registry[ModelInfo] = Registry("model", package="robust_attn.models",
                                       hint="`robust-attn zoo list` shows every architecture.")


def register_model(fn: Callable[..., nn.Module] | None = None, *, family: str = "", paper: str = ""):
    """Decorator adding ``fn`` to the registry under ``fn.__name__``.

    ``family`` groups models for listings (e.g. ``"san"``); ``paper`` names the paper section the
    architecture comes from. Registering the same name twice is an error.
    """

    def wrap(f: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        name = f.__name__
        doc_first_line = (inspect.getdoc(f) or "").split("\n")[0]
        MODELS.register(name, ModelInfo(name=name, family=family or name.split("_")[0],
                                        paper=paper or doc_first_line, entrypoint=f))
        return f

    return wrap(fn) if fn is not None else wrap


def list_models(pattern: str = "*", family: str | None = None) -> list[str]:
    """Sorted names of registered models matching a shell-style ``pattern`` (and ``family``)."""
    return sorted(name for name, info in MODELS.items()
                  if fnmatch.fnmatchcase(name, pattern) and (family is None or info.family == family))


def model_info(name: str) -> ModelInfo:
    """Registry entry of ``name``; an unknown name raises ``KeyError`` listing close matches."""
    if name not in MODELS:
        raise MODELS.unknown(name, n=3)
    return MODELS.get(name)


def create_model(name: str, num_classes: int = 1000, resolution: str = "imagenet",
                 **overrides) -> nn.Module:
    """Build architecture ``name`` for ``num_classes`` at ``resolution`` ("imagenet" or "cifar").

    ``overrides`` are passed to the family constructor (e.g. ``width=0.25`` or
    ``stem_downsample=2``); an override the family does not take is a ``ValueError``.
    The returned module carries ``model.arch_args`` (name, num_classes, resolution, overrides),
    which is all that is needed to build it again, e.g. from a checkpoint's sidecar.
    """
    info = model_info(name)
    if resolution not in RESOLUTIONS:
        raise ValueError(f"unknown resolution {resolution!r}; choose one of {sorted(RESOLUTIONS)}")
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    try:
        model = info.entrypoint(num_classes=num_classes, resolution=resolution, **overrides)
    except TypeError as err:
        if "unexpected keyword argument" not in str(err):
            raise
        raise ValueError(f"model {name!r} does not take override(s) {sorted(overrides)}: {err}") from err
    model.arch_args = {"name": name, "num_classes": num_classes, "resolution": resolution,
                       "overrides": dict(overrides)}
    return model
