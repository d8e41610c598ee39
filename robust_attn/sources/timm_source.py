"""``timm:NAME``: a model of timm (PyTorch Image Models), an optional extra: ``pip install timm``.

Weights: timm's pretrained weights where the network allows (``timm.create_model(NAME,
pretrained=True)``, its own cache and hub); with ``checkpoint``, a local state dict file
instead (read with ``weights_only=True``); with model-arg ``pretrained=False`` and no
checkpoint, random weights (after ``torch.manual_seed(seed)``). Other model-args go to
``timm.create_model`` (e.g. ``num_classes=10`` for a checkpoint fine-tuned on 10 classes).
Pretrained weights keep their own head (timm would otherwise put a fresh random classifier on
them); a head that is not the dataset's is refused before any download, and weights that are
neither cached nor reachable fail within seconds (:mod:`robust_attn.sources.timm_weights`).

Preprocessing: timm's pretrained config as ``timm.data.resolve_data_config({}, model=model)``
gives it: ``input_size`` (C, H, W), ``interpolation``, ``mean``, ``std`` and ``crop_pct``; the
resize side is ``floor(H / crop_pct)`` and the centre crop ``H``, as timm's eval transform
does for ``crop_mode="center"`` (other crop modes are recorded and refused: they are not a
resize-then-centre-crop).
"""
from __future__ import annotations

import contextlib
import math

import torch

from robust_attn.sources import register_source
from robust_attn.sources.base import INTERPOLATIONS, LoadedModel, Preprocessing, SourceError, SourceRequest
from robust_attn.sources.provenance import wrap_library_model

INSTALL = "pip install timm"


def _timm():
    try:
        import timm
        import timm.data  # noqa: F401
    except ImportError:
        raise SourceError(f"timm:NAME needs the optional package timm, which is not installed: {INSTALL}") from None
    return timm


def preprocessing_of(config: dict) -> Preprocessing:
    """:class:`Preprocessing` from timm's resolved data config."""
    _, height, width = config["input_size"]
    if height != width:
        raise SourceError(f"timm config asks for a {height}x{width} input; only square inputs are supported")
    crop_pct = float(config.get("crop_pct") or 1.0)
    crop_mode = config.get("crop_mode", "center")
    if crop_mode != "center":
        raise SourceError(f"timm config uses crop_mode={crop_mode!r}; only 'center' (resize then centre crop) "
                          f"is supported")
    interpolation = config.get("interpolation", "bilinear")
    if interpolation not in INTERPOLATIONS:  # timm's "random" is a training-time choice
        interpolation = "bilinear"
    return Preprocessing(mean=tuple(float(m) for m in config["mean"]), std=tuple(float(s) for s in config["std"]),
                         input_size=int(height), resize_size=int(math.floor(height / crop_pct)),
                         crop_size=int(height), interpolation=interpolation)


@register_source("timm")
def load_timm(request: SourceRequest) -> LoadedModel:
    timm = _timm()
    name, kwargs = request.target, dict(request.model_args)
    pretrained = bool(kwargs.pop("pretrained", not request.checkpoint))
    if pretrained and request.checkpoint:
        raise SourceError(f"{request.spec!r}: pretrained=True and --checkpoint both name the weights; drop one")
    if not pretrained:
        kwargs.setdefault("num_classes", request.dataset_info.num_classes)
    if not timm.is_model(name):
        import difflib

        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise SourceError(f"{request.spec!r}: timm has no model {name!r}.{hint} timm.list_models('*pattern*') "
                          f"lists them")
    where = contextlib.nullcontext()
    if pretrained:   # the class count and the weights' whereabouts before any download
        from robust_attn.sources.timm_weights import prepare_pretrained

        where = prepare_pretrained(timm, name, kwargs, request.dataset_info.num_classes, request.spec)
    torch.manual_seed(request.seed)
    try:
        with where:
            net = timm.create_model(name, pretrained=pretrained, **kwargs)
    except (TypeError, ValueError) as err:
        raise SourceError(f"{request.spec!r}: timm cannot build it with {kwargs or 'no arguments'} ({err})") from None
    except Exception as err:  # the download: hub/network/file errors of every kind
        if not pretrained:
            raise
        raise SourceError(f"{request.spec!r}: timm could not fetch its pretrained weights ({type(err).__name__}: "
                          f"{err}); no network? Pass --checkpoint LOCAL_STATE_DICT (a .pth/.safetensors of this "
                          f"model), or --model-args pretrained=False for random weights") from None
    preprocessing = preprocessing_of(timm.data.resolve_data_config({}, model=net))
    desc = {"source": "timm", "model": f"timm-{name}", "checkpoint": None,
            "arch": {"name": name, "pretrained": pretrained, **kwargs},
            "pretrained_tag": (getattr(net, "pretrained_cfg", None) or {}).get("tag") if pretrained else None,
            "timm_version": getattr(timm, "__version__", None)}
    return wrap_library_model(net, preprocessing, desc, request, pretrained)
