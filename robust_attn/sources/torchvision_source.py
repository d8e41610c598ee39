"""``torchvision:NAME[:WEIGHTS]``: a torchvision classification model through its weights API.

``WEIGHTS`` is a member of the model's weights enum (``IMAGENET1K_V2``; default ``DEFAULT``)
or ``none``: random initialization (after ``torch.manual_seed(seed)``) with the classifier
sized to the dataset, or the local state dict given as ``checkpoint``. Pretrained weights are
fetched by torchvision (its cache, ``$TORCH_HOME``) where the network allows.

Preprocessing always comes from the weights enum's ``transforms()`` (for ``none``: of
``DEFAULT``), which is metadata and needs no download: ``ImageClassification``'s
``resize_size``, ``crop_size``, ``interpolation``, ``mean`` and ``std``. torchvision models
take normalized input, so the model is wrapped in a :class:`NormalizedModel` with those
mean/std and attacks still see [0, 1] images.
"""
from __future__ import annotations

import torch

from robust_attn.sources import register_source
from robust_attn.sources.base import LoadedModel, Preprocessing, SourceError, SourceRequest
from robust_attn.sources.provenance import wrap_library_model


def _torchvision_models():
    try:
        import torchvision.models as models
    except ImportError:
        raise SourceError("torchvision:NAME needs torchvision: pip install torchvision") from None
    return models


def weights_enum(name: str, spec: str):
    """The weights enum of torchvision model ``name``; a clear error with close names otherwise."""
    import difflib

    models = _torchvision_models()
    try:
        return models.get_model_weights(name)
    except (ValueError, KeyError):
        names = models.list_models(module=models)
        close = difflib.get_close_matches(name, names, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise SourceError(f"{spec!r}: torchvision has no classification model {name!r}.{hint} "
                          f"torchvision.models.list_models() lists the {len(names)} it has") from None


def _first(value) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def preprocessing_of(weights) -> Preprocessing:
    """The :class:`Preprocessing` of a torchvision weights enum member (its ``transforms()``)."""
    t = weights.transforms()
    crop = _first(t.crop_size)
    interpolation = getattr(t.interpolation, "value", str(t.interpolation))
    return Preprocessing(mean=tuple(float(m) for m in t.mean), std=tuple(float(s) for s in t.std),
                         input_size=crop, resize_size=_first(t.resize_size), crop_size=crop,
                         interpolation=interpolation)


@register_source("torchvision", form="torchvision:NAME[:WEIGHTS|none]")
def load_torchvision(request: SourceRequest) -> LoadedModel:
    models = _torchvision_models()
    name, _, weights_name = request.target.partition(":")
    enum = weights_enum(name, request.spec)
    weights_name = weights_name or ("none" if request.checkpoint else "DEFAULT")
    if weights_name.lower() == "none":
        weights = None
    else:
        members = [m for m in enum.__members__]
        if weights_name not in members:
            raise SourceError(f"{request.spec!r}: {enum.__name__} has no weights {weights_name!r}; choose one of "
                              f"{', '.join(members)}, or none for random weights")
        weights = enum[weights_name]
        if request.checkpoint:
            raise SourceError(f"{request.spec!r} names torchvision's weights {weights_name} and --checkpoint "
                              f"names others: use torchvision:{name}:none with --checkpoint")
    preprocessing = preprocessing_of(weights if weights is not None else enum.DEFAULT)
    kwargs = dict(request.model_args)
    classes = len((weights.meta.get("categories") or []) if weights is not None else [])
    wanted = request.dataset_info.num_classes
    if classes and classes != wanted and "num_classes" not in kwargs:   # refused before any download
        raise SourceError(f"{request.spec!r}: torchvision's {weights_name} weights classify {classes} classes but "
                          f"dataset {request.dataset_info.name} has {wanted}: evaluate them on a dataset of those "
                          f"classes (e.g. --dataset imagenet), or give weights trained on this one: "
                          f"torchvision:{name}:none with --checkpoint STATE_DICT")
    if weights is None:
        kwargs.setdefault("num_classes", request.dataset_info.num_classes)
    torch.manual_seed(request.seed)
    try:
        net = models.get_model(name, weights=weights, **kwargs)
    except (TypeError, ValueError) as err:
        raise SourceError(f"{request.spec!r}: torchvision cannot build it with {kwargs or 'no arguments'} "
                          f"({err})") from None
    except Exception as err:  # the download: URLError, HTTPError, OSError, RuntimeError (hash) ...
        raise SourceError(f"{request.spec!r}: torchvision could not fetch weights {weights} ({type(err).__name__}: "
                          f"{err}); no network? Put the file in torchvision's cache ($TORCH_HOME/hub/checkpoints), "
                          f"or pass torchvision:{name}:none with --checkpoint LOCAL_STATE_DICT") from None
    desc = {"source": "torchvision", "model": f"torchvision-{name}",
            "arch": {"name": name, "torchvision_weights": weights.name if weights is not None else None, **kwargs},
            "checkpoint": None}
    net.arch_args = desc["arch"]
    return wrap_library_model(net, preprocessing, desc, request, pretrained=weights is not None)
