"""``FILE.py:FUNCTION`` and ``package.module:FUNCTION``: any user's ``torch.nn.Module``.

``FUNCTION(**model_args)`` is called after ``torch.manual_seed(seed)``, with
``num_classes=<the dataset's>`` added when it takes a ``num_classes`` argument (or
``**kwargs``) and model-args do not set it. It must return an ``nn.Module``. A file is
imported by path (its folder need not be on ``sys.path``); a module is imported by name.

Preprocessing: ``None`` (the dataset's images as they are), unless the returned module has a
``preprocessing`` attribute: a :class:`~robust_attn.sources.base.Preprocessing` or a dict of its
fields (mean, std, input_size, resize_size, crop_size, interpolation), applied to the images of
datasets read from files (imagenet, imagefolder) like a timm model's.

Normalization: the returned module is assumed to take input normalized with its
``preprocessing`` mean/std, else the dataset's, and is wrapped in a :class:`NormalizedModel`
with them; a function that returns a :class:`NormalizedModel` (its own mean/std inside) is
taken as it is. Either way the model sees [0, 1] images from the attacks. ``checkpoint``: a
local state dict loaded (strictly) into the module the function returned.

Weights: ``weights_origin`` is ``checkpoint`` with one, else ``user``: the function may have
drawn them at random or loaded its own; robust-attn does not claim either.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path, PurePath

import torch
import torch.nn as nn

from robust_attn.sources import CALLABLE, register_source, unknown_module_hint
from robust_attn.sources.base import (LoadedModel, Preprocessing, SourceError, SourceRequest, load_weights_file,
                                      state_dict_sha256)
from robust_attn.sources.provenance import USER
from robust_attn.models.wrapper import NormalizedModel

PREPROCESSING_FIELDS = tuple(f.name for f in dataclasses.fields(Preprocessing))


def _missing_module(name: str, spec: str) -> SourceError:
    return SourceError(f"{spec!r}: no model source {name.split('.')[0] + ':'!r} and no importable module "
                       f"{name!r}.{unknown_module_hint(name)} For a user's function, install the package or put "
                       f"its folder on PYTHONPATH, or give the file: PATH.py:FUNCTION")


def check_user_function(target: str, spec: str) -> None:
    """Before anything is built: the file exists, or the module's top-level package can be found."""
    left = target.rpartition(":")[0]
    if left.endswith(".py"):
        if not Path(left).expanduser().is_file():
            raise SourceError(f"model file {left} does not exist (from {spec!r}); give the path of a .py file "
                              f"that defines the function, FILE.py:FUNCTION")
    elif importlib.util.find_spec(left.split(".")[0]) is None:
        raise _missing_module(left.split(".")[0], spec)


def _import_file(path: Path, spec: str):
    path = path.resolve()
    name = f"_robust_attn_user_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise SourceError(f"importing model file {path} failed: {type(err).__name__}: {err}") from err
    return module


def _import_module(name: str, spec: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and not (name == err.name or name.startswith(err.name + ".")):  # a dependency is missing
            raise SourceError(f"importing module {name} failed: {err}") from err
        raise _missing_module(name, spec) from None


def _call(fn, kwargs: dict, num_classes: int, where: str):
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "num_classes" not in kwargs and ("num_classes" in params or takes_kwargs):
        kwargs = dict(kwargs, num_classes=num_classes)
    try:
        return fn(**kwargs)
    except TypeError as err:
        raise SourceError(f"calling {where}(**{kwargs}) failed: {err}; check --model-args") from err
    except Exception as err:   # the user's own code failed: say where, in one line
        frame = traceback.extract_tb(err.__traceback__)[-1]
        raise SourceError(f"calling {where}(**{kwargs}) raised {type(err).__name__}: {err} (at "
                          f"{frame.filename}:{frame.lineno}); fix the function, or run it in Python to see "
                          f"the whole traceback") from err


def label_user_function(target: str) -> str:
    """``STEM-FUNCTION`` for ``FILE.py:FUNCTION``, ``MODULE-FUNCTION`` for ``package.module:FUNCTION``."""
    left, _, function = target.rpartition(":")
    return f"{PurePath(left).stem if left.endswith('.py') else left.rsplit('.', 1)[-1]}-{function}"


@register_source(CALLABLE, check=check_user_function, label=label_user_function,
                 form="FILE.py:FUNCTION or package.module:FUNCTION")
def load_user_function(request: SourceRequest) -> LoadedModel:
    check_user_function(request.target, request.spec)
    left, _, function = request.target.rpartition(":")
    if left.endswith(".py"):
        module, origin = _import_file(Path(left).expanduser(), request.spec), {"file": str(Path(left).resolve())}
        model_name = f"{Path(left).stem}-{function}"
    else:
        module, origin = _import_module(left, request.spec), {"module": left}
        model_name = f"{left}-{function}"
    fn = getattr(module, function, None)
    if not callable(fn):
        have = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                      and getattr(v, "__module__", None) == module.__name__)
        raise SourceError(f"{left} has no function {function!r}; it defines: {', '.join(have) or 'nothing callable'}")
    torch.manual_seed(request.seed)
    net = _call(fn, request.model_args, request.dataset_info.num_classes, f"{left}:{function}")
    if not isinstance(net, nn.Module):
        raise SourceError(f"{left}:{function} returned a {type(net).__name__}, not a torch.nn.Module: make it "
                          f"return the model (e.g. `return MyNet(num_classes)`)")
    info = request.dataset_info
    preprocessing = _preprocessing_attribute(net, f"{left}:{function}")
    wrapped = isinstance(net, NormalizedModel)
    mean, std = (preprocessing.mean, preprocessing.std) if preprocessing is not None else (info.mean, info.std)
    desc = {"source": CALLABLE, "model": model_name, "function": function, **origin, "checkpoint": None,
            "arch": {"name": model_name, "class": type(net).__qualname__, **request.model_args},
            "normalization": "the function's own NormalizedModel" if wrapped else
                             "the model's preprocessing mean/std (the wrapper)" if preprocessing is not None else
                             f"dataset {info.name} mean/std (the wrapper)"}
    if request.checkpoint:
        sha = load_weights_file(net, request.checkpoint, request.spec)
        desc.update(checkpoint={"path": request.checkpoint, "sha256": sha}, weights_sha256=sha,
                    weights_origin="checkpoint")
    model = net if wrapped else NormalizedModel(net, mean, std)
    if not request.checkpoint:   # the function's own weights: random or loaded by it, it alone knows
        desc.update(weights_sha256=state_dict_sha256(model), weights_origin=USER, init_seed=request.seed)
    return LoadedModel(model, preprocessing, desc)


def _preprocessing_attribute(net: nn.Module, where: str) -> Preprocessing | None:
    """The returned module's ``preprocessing`` attribute: a :class:`Preprocessing` or a dict of
    its fields (e.g. ``{"input_size": 224, "resize_size": 240, "crop_size": 224, "interpolation":
    "bicubic", "mean": (0.5,) * 3, "std": (0.5,) * 3}``); None when it has none."""
    value = getattr(net, "preprocessing", None)
    if value is None or isinstance(value, Preprocessing):
        return value
    if not isinstance(value, dict):
        raise SourceError(f"{where}: the model's preprocessing attribute must be a dict of {PREPROCESSING_FIELDS} "
                          f"or a robust_attn.sources.Preprocessing, got {type(value).__name__}")
    unknown = sorted(set(value) - set(PREPROCESSING_FIELDS))
    missing = [k for k in PREPROCESSING_FIELDS if k not in value and k != "interpolation"]
    if unknown or missing:
        raise SourceError(f"{where}: the model's preprocessing attribute has unknown keys {unknown} and lacks "
                          f"{missing}; give {', '.join(PREPROCESSING_FIELDS)}")
    return Preprocessing.from_dict(value)
