"""One spec string for a model's source: the CLI's ``--model``, the Python API and configs.

    >>> from robust_attn.data import dataset_info
    >>> from robust_attn.sources import load_model_spec
    >>> loaded = load_model_spec("torchvision:resnet18:none", dataset_info=dataset_info("imagenet"))
    >>> loaded.model            # NormalizedModel in eval mode: images in [0, 1]
    >>> loaded.preprocessing    # Preprocessing(mean, std, input_size=224, resize_size=256, ...)
    >>> loaded.description      # {"source": "torchvision", "spec": ..., "weights_sha256": ..., ...}

==============================  =================================================================
spec                            model
==============================  =================================================================
``NAME``                        the registry (``robust-attn zoo list``): random weights (``seed``)
                                or ``checkpoint`` (a robust-attn .safetensors with its sidecar)
``zoo:NAME``                    the zoo's trained ``NAME`` for the dataset (sha256-checked)
``timm:NAME``                   timm (optional: ``pip install timm``): pretrained weights where the
                                network allows, else ``checkpoint`` = a local state dict file;
                                model-arg ``pretrained=False`` for random weights
``torchvision:NAME[:WEIGHTS]``  torchvision's weights API; WEIGHTS an enum member
                                (default ``DEFAULT``) or ``none`` (random init, the head sized to
                                the dataset); ``checkpoint`` = a local state dict file
``san-official:PATH[:ARCH]``    the SAN authors' .pth (hszhao/SAN), converted by name
``FILE.py:FUNCTION``            any user's ``nn.Module``: ``FUNCTION(**model_args)`` (plus
``package.module:FUNCTION``     ``num_classes=`` when it takes it) from a file or an importable module
==============================  =================================================================

A prefix registered here wins over a module of the same name (``timm:x`` is the timm source,
never a function ``x`` of a module ``timm``). Each source gives the model wrapped for [0, 1]
images and its :class:`Preprocessing` (mean/std, sizes, interpolation) from timm's pretrained
config or torchvision's weights transforms, or a user's function's ``preprocessing``
attribute; ``None`` for sources whose weights take the dataset's images as they are (the
registry, the zoo's checkpoints, a user's function without one). The run description records
where the model came from: ``source``, ``spec``, ``weights_origin``, ``weights_sha256``,
``params`` and ``preprocessing`` (:mod:`robust_attn.sources.provenance`). Every model is checked
to output the dataset's number of classes (:func:`robust_attn.models.checkpoint.check_num_classes`).

A new source is one new module in this package with a function decorated by
``@register_source("prefix")`` (optionally ``check=``: what is wrong with a spec before anything
is built, :func:`check_spec`) taking a :class:`SourceRequest` and returning a
:class:`LoadedModel` whose description names ``weights_origin`` and ``weights_sha256``; the
modules are imported when a spec is first resolved (:data:`SOURCES`).
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Callable

from robust_attn.sources.base import (LoadedModel, Preprocessing, SourceError, SourceRequest, load_weights_file,
                                      state_dict_sha256)
from robust_attn.utils.plugins import Registry

__all__ = ["Preprocessing", "LoadedModel", "SourceError", "SourceRequest", "Source", "SOURCES", "register_source",
           "list_sources", "parse_spec", "check_spec", "spec_label", "load_model_spec", "state_dict_sha256",
           "load_weights_file", "spec_help"]



@dataclass(frozen=True)
class Source:
    """A registered source: ``load(request)``, and optionally ``check(target, spec)`` (what is wrong
    with a spec before anything is built), ``label(target)`` (its :func:`spec_label`) and ``form``
    (how a spec of it is written, for :func:`spec_help`)."""

    load: Callable[[SourceRequest], LoadedModel]
    check: Callable[[str, str], None] | None = None
    label: Callable[[str], str] | None = None
    form: str = ""


#: every model source by prefix, from the modules of this package
SOURCES: Registry[Source] = Registry("model source", package="robust_attn.sources", error=SourceError)
#: the sources chosen by a spec's form rather than a prefix
REGISTRY, CALLABLE = "registry", "callable"
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def register_source(prefix: str, *, check: Callable[[str, str], None] | None = None,
                    label: Callable[[str], str] | None = None, form: str = ""):
    """Decorator registering ``fn(request) -> LoadedModel`` as the source of ``prefix:...`` specs;
    ``check(target, spec)`` (optional) raises :class:`SourceError` for what is wrong with a spec
    before anything is built (:func:`check_spec`); ``label(target)`` (optional) names the model
    (:func:`spec_label`; default ``prefix-NAME``); ``form``: how a spec is written (default
    ``prefix:NAME``)."""

    def wrap(fn):
        SOURCES.register(prefix, Source(fn, check, label, form or f"{prefix}:NAME"))
        return fn

    return wrap


def list_sources() -> list[str]:
    return SOURCES.names()


def spec_help() -> str:
    """How a spec of each source is written, e.g. for ``--model``'s help."""
    return ", ".join(source.form for _, source in SOURCES.items())


def parse_spec(spec: str) -> tuple[str, str]:
    """``(source, target)`` of a spec: a registered prefix first, then ``FILE.py:FUNCTION`` /
    ``package.module:FUNCTION``, then a bare registry ``NAME``."""
    SOURCES.discover()
    if not isinstance(spec, str) or not spec.strip():
        raise SourceError(f"empty model spec; give one of: {spec_help()}")
    spec = spec.strip()
    prefix, sep, rest = spec.partition(":")
    if sep and prefix in SOURCES:
        if not rest:
            raise SourceError(f"model spec {spec!r} names no model after {prefix + ':'!r}; e.g. {prefix}:NAME")
        return prefix, rest
    if sep:
        left, _, function = spec.rpartition(":")
        if re.fullmatch(_IDENT, function) and (left.endswith(".py") or re.fullmatch(rf"{_IDENT}(\.{_IDENT})*", left)):
            return CALLABLE, spec
        raise SourceError(f"unknown model source {prefix!r} in {spec!r}.{_suggest(prefix)} A spec is one of: "
                          f"{spec_help()}")
    if spec.endswith(".py"):
        raise SourceError(f"{spec!r} is a Python file: name the function that builds the model, {spec}:FUNCTION")
    if spec.endswith((".safetensors", ".pth", ".pt")):
        raise SourceError(f"{spec!r} is a weights file, not a model spec: pass it as --checkpoint (with --model "
                          f"NAME for the registry), or san-official:{spec} for the SAN authors' checkpoints")
    return REGISTRY, spec


def check_spec(spec: str) -> tuple[str, str]:
    """:func:`parse_spec`, plus what the source can check without building the model (its
    ``check``: e.g. a user's ``FILE.py`` or a ``san-official:`` file exists, a module's package can
    be found, so ``tim:x`` is an unknown source with the hint ``timm:``)."""
    source, target = parse_spec(spec)
    check = SOURCES.get(source).check
    if check is not None:
        check(target, spec)
    return source, target


def _suggest(prefix: str) -> str:
    close = difflib.get_close_matches(prefix, [p for p in SOURCES.names() if p not in (REGISTRY, CALLABLE)], n=1)
    return f" Did you mean {close[0] + ':'!r}?" if close else ""


def unknown_module_hint(module: str) -> str:
    """For a ``module:FUNCTION`` spec whose module does not exist: the source it may have meant."""
    return _suggest(module.split(".")[0])


def spec_label(spec: str) -> str:
    """A short name for the model of ``spec`` (run folders, report rows, the study's ``label``
    default): ``NAME`` for the registry and ``zoo:NAME``; ``timm-NAME``, ``torchvision-NAME``;
    the architecture (or the file's stem) for ``san-official:PATH[:ARCH]``; ``STEM-FUNCTION`` or
    ``MODULE-FUNCTION`` for a user's function. Only letters, digits, ``_``, ``+`` and ``-``
    (other characters become ``_``), so it can name a folder and a transfer condition."""
    source, target = parse_spec(spec)
    label = SOURCES.get(source).label
    name = label(target) if label is not None else f"{source}-{target.split(':')[0]}"
    return re.sub(r"[^A-Za-z0-9_+-]+", "_", name).strip("_") or source


def load_model_spec(spec: str | None, *, dataset_info, checkpoint: str | None = None, model_args: dict | None = None,
                    seed: int = 0, device: str = "cpu", check: bool = True, manifest: str | None = None,
                    other_dataset: bool = False) -> LoadedModel:
    """The model of ``spec`` for ``dataset_info`` (a :class:`robust_attn.data.DatasetInfo`).

    ``checkpoint``: weights for the registry, timm, torchvision or a user's function (refused
    by the zoo and san-official, whose weights the spec names). ``model_args``: keyword
    arguments of the constructor. ``seed``: torch's seed before random weights are drawn.
    ``check``: one dummy forward (at the preprocessing's input size, else the dataset's image
    size) refusing a model whose output is not the dataset's classes. ``manifest``: the zoo
    manifest of ``zoo:NAME`` (default ``zoo/manifest.json`` or ``$ROBUST_ATTN_ZOO_MANIFEST``).
    ``spec`` may be None with a ``checkpoint``: the architecture its sidecar names.
    ``other_dataset``: allow a robust-attn checkpoint whose sidecar names another dataset than
    ``dataset_info`` (its normalization and classes belong to that one; refused by default).
    A dataset whose classes are some of the model's (``dataset_info.logit_subset``, e.g.
    ImageNet-R) gets the model built and checked for all of them, then restricted to its own
    (:class:`robust_attn.models.wrapper.ClassSubset`; ``logit_subset`` in the description).

    The description records where the model came from (:mod:`robust_attn.sources.provenance`):
    ``source``, ``spec``, ``weights_origin``, ``weights_sha256``, ``params`` and ``preprocessing``."""
    from robust_attn.models.checkpoint import check_num_classes
    from robust_attn.sources.provenance import count_parameters

    if spec is None:
        if not checkpoint:
            raise SourceError(f"give a model spec ({spec_help()}) or a checkpoint")
        source, target = REGISTRY, ""
    else:
        source, target = parse_spec(spec)
    model_info = dataset_info.for_models()   # a test set of some of the model's classes: the model's
    request = SourceRequest(spec=spec if spec is not None else "", target=target, dataset_info=model_info,
                            checkpoint=str(checkpoint) if checkpoint else None, model_args=dict(model_args or {}),
                            seed=seed, device=str(device), manifest=str(manifest) if manifest else None,
                            other_dataset=other_dataset)
    loaded = SOURCES.get(source).load(request)
    loaded.model = loaded.model.to(device).eval()
    desc = loaded.description
    desc.setdefault("source", source)
    desc["spec"] = spec if spec is not None else desc.get("model", "")
    if not desc.get("weights_sha256") or desc.get("weights_origin") is None:
        raise RuntimeError(f"model source {source!r} did not record weights_sha256 and weights_origin")
    desc["params"] = count_parameters(loaded.model)
    desc["preprocessing"] = loaded.preprocessing.as_dict() if loaded.preprocessing is not None else None
    if check:
        size = loaded.preprocessing.input_size if loaded.preprocessing is not None else dataset_info.image_size
        check_num_classes(loaded.model, model_info.num_classes, f"model {desc['spec']}", image_size=size)
    if dataset_info.logit_subset:
        from robust_attn.models.wrapper import ClassSubset

        loaded.model = ClassSubset(loaded.model, dataset_info.logit_subset).to(device).eval()
        desc["logit_subset"] = {"classes": len(dataset_info.logit_subset), "of": dataset_info.model_classes}
    return loaded
