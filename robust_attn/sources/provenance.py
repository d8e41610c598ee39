"""Where a run's model came from, as recorded in every run's ``run.json``.

Every model description (the CLI's, the study's, and the Python API's) carries:

* ``source``: the spec's source (``registry``, ``zoo``, ``timm``, ``torchvision``,
  ``san-official``, ``callable``), or ``user module`` for a module handed to the Python API;
* ``spec``: the spec string (``None`` for a module handed to the API);
* ``weights_origin``: ``random`` (drawn at build time: the numbers say nothing about the
  architecture), ``checkpoint`` (a local file), ``zoo`` (a zoo checkpoint), ``pretrained``
  (timm's or torchvision's published weights), or ``user`` (built by the user's own code: not
  known to be random, not known to be trained);
* ``weights_sha256``: the weights file's sha256, or :func:`state_dict_sha256` of the module;
* ``params``: the number of parameters;
* ``preprocessing``: the resize/crop/interpolation and mean/std the weights expect
  (:meth:`Preprocessing.as_dict`), ``None`` where the dataset's images are used as they are.

:func:`with_provenance` fills in what a Python-API caller did not say (``run_rotation(...,
model_info=...)``), so an API run is never mistaken for one with random weights.
"""
from __future__ import annotations

import torch.nn as nn

from robust_attn.sources.base import LoadedModel, Preprocessing, load_weights_file, state_dict_sha256

__all__ = ["WEIGHT_ORIGINS", "RANDOM", "USER", "USER_MODULE", "count_parameters", "with_provenance", "is_random",
           "wrap_library_model"]

RANDOM, USER, USER_MODULE = "random", "user", "user module"
WEIGHT_ORIGINS = (RANDOM, "checkpoint", "zoo", "pretrained", USER)


def count_parameters(model: nn.Module) -> int:
    """Parameters of ``model`` (buffers such as the wrapper's mean/std are not parameters)."""
    return int(sum(p.numel() for p in model.parameters()))


def _module_name(model: nn.Module) -> str:
    inner = getattr(model, "model", model)   # a NormalizedModel: the network inside
    return type(inner).__name__


def with_provenance(model: nn.Module, run_info: dict | None = None, model_info=None, dataset=None) -> dict:
    """``run_info`` with the model's provenance keys (module docstring) filled in, and the
    ``dataset`` it names when the caller named none (its ``variant``, else its class name).

    ``model_info`` is what the caller knows about the model: a :class:`LoadedModel` (its
    description), a dict (e.g. ``{"name": "my_vit", "weights_origin": "pretrained", "weights":
    "ImageNet-1k, epoch 300 of my run"}``; any other key is recorded as given), or a string
    describing the weights. Keys ``run_info`` already has win; ``weights_origin`` must be one of
    :data:`WEIGHT_ORIGINS` and defaults to ``user`` (never ``random`` unless said so).
    """
    info = dict(run_info or {})
    if isinstance(model_info, LoadedModel):
        model_info = model_info.description
    if isinstance(model_info, str):
        model_info = {"weights": model_info}
    if model_info is not None and not isinstance(model_info, dict):
        raise TypeError(f"model_info must be a dict, a string or a LoadedModel, got {type(model_info).__name__}")
    given = dict(model_info or {})
    if "name" in given:
        given.setdefault("model", given.pop("name"))
    if isinstance(given.get("preprocessing"), Preprocessing):
        given["preprocessing"] = given["preprocessing"].as_dict()
    for key, value in given.items():
        info.setdefault(key, value)
    info.setdefault("source", USER_MODULE)
    info.setdefault("spec", None)
    info.setdefault("model", _module_name(model))
    if "weights_origin" not in info:   # a description made by hand: a checkpoint or a seed says which
        info["weights_origin"] = ("checkpoint" if info.get("checkpoint") else
                                  RANDOM if info.get("init_seed") is not None else USER)
    if info["weights_origin"] not in WEIGHT_ORIGINS:
        raise ValueError(f"weights_origin must be one of {WEIGHT_ORIGINS}, got {info['weights_origin']!r}")
    if not info.get("weights_sha256"):
        info["weights_sha256"] = state_dict_sha256(model)
    info.setdefault("params", count_parameters(model))
    info.setdefault("preprocessing", None)
    if dataset is not None and "dataset" not in info:
        info["dataset"] = {"name": getattr(dataset, "variant", None) or type(dataset).__name__, "split": None,
                           "limit": None}
    return info


def is_random(description: dict) -> bool:
    """Whether a run's model had random weights. Runs recorded before ``weights_origin``
    existed: random when they name no checkpoint (only the CLI recorded one then)."""
    if "weights_origin" in description:
        return description["weights_origin"] == RANDOM
    return description.get("checkpoint") is None


def wrap_library_model(net: nn.Module, preprocessing: Preprocessing, desc: dict, request, pretrained: bool) -> LoadedModel:
    """A library's network (timm, torchvision) as the protocols take it: ``request.checkpoint``
    (a local state dict) loaded if given, wrapped with its preprocessing's mean/std, and its
    weights' origin and hash recorded in ``desc``: the file's sha256, else the state dict's with
    ``pretrained`` or ``random`` (and the seed) as the origin."""
    from robust_attn.models.wrapper import NormalizedModel

    if request.checkpoint:
        sha = load_weights_file(net, request.checkpoint, request.spec)
        desc.update(checkpoint={"path": request.checkpoint, "sha256": sha}, weights_sha256=sha,
                    weights_origin="checkpoint")
    model = NormalizedModel(net, preprocessing.mean, preprocessing.std)
    if not request.checkpoint:
        desc.update(weights_sha256=state_dict_sha256(model), weights_origin="pretrained" if pretrained else RANDOM,
                    init_seed=None if pretrained else request.seed)
    return LoadedModel(model, preprocessing, desc)
