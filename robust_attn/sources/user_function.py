"""``FILE.py:FUNCTION`` and ``package.module:FUNCTION``: any user's ``torch.nn.Module``.

``FUNCTION(**model_args)`` is called after ``torch.manual_seed(seed)``, with
``num_classes=<the dataset's>`` added when it takes a ``num_classes`` argument (or
``**kwargs``) and model-args do not set it. It must return an ``nn.Module``. A file is
imported by path (its folder need not be on ``sys.path``); a module is imported by name.

Normalization: the returned module is assumed to take input normalized with the dataset's
mean/std and is wrapped in a :class:`NormalizedModel` with them; a function that returns a
:class:`NormalizedModel` (its own mean/std inside) is taken as it is. Either way the model sees
[0, 1] images from the attacks. ``checkpoint``: a local state dict loaded (strictly) into the
module the function returned. Preprocessing ``None``: the dataset's images as they are.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

import torch
import torch.nn as nn

from robust_attn.sources import CALLABLE, register_source, unknown_module_hint
from robust_attn.sources.base import LoadedModel, SourceError, SourceRequest, load_weights_file, state_dict_sha256
from robust_attn.wrapper import NormalizedModel


def _import_file(path: Path, spec: str):
    if not path.is_file():
        raise SourceError(f"model file {path} does not exist (from {spec!r}); give the path of a .py file that "
                          f"defines the function, FILE.py:FUNCTION")
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
        raise SourceError(f"{spec!r}: no model source {name.split('.')[0] + ':'!r} and no importable module "
                          f"{name!r}.{unknown_module_hint(name)} For a user's function, install the package or put "
                          f"its folder on PYTHONPATH, or give the file: PATH.py:FUNCTION") from None


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


@register_source(CALLABLE)
def load_user_function(request: SourceRequest) -> LoadedModel:
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
    wrapped = isinstance(net, NormalizedModel)
    desc = {"source": CALLABLE, "model": model_name, "function": function, **origin, "checkpoint": None,
            "arch": {"name": model_name, "class": type(net).__qualname__, **request.model_args},
            "normalization": "the function's own NormalizedModel" if wrapped else
                             f"dataset {info.name} mean/std (the wrapper)", "init_seed": request.seed}
    if request.checkpoint:
        sha = load_weights_file(net, request.checkpoint, request.spec)
        desc.update(checkpoint={"path": request.checkpoint, "sha256": sha}, weights_sha256=sha)
    model = net if wrapped else NormalizedModel(net, info.mean, info.std)
    if not request.checkpoint:
        desc["weights_sha256"] = state_dict_sha256(model)
    return LoadedModel(model, None, desc)
