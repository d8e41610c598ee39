"""``zoo:NAME``: the zoo's trained ``NAME`` for the dataset (``zoo/manifest.json``,
``$ROBUST_ATTN_ZOO_MANIFEST`` or the request's ``manifest``), sha256-checked by
:func:`robust_attn.models.manifest.load_entry`.

A checkpoint entry takes the dataset's images as they are (preprocessing ``None``); its
description carries the entry's ``adversarial`` record (``{}``: standard training), so every
run of it says how it was trained. A torchvision
entry (``robust-attn zoo add NAME --torchvision MODEL --weights WEIGHTS``) has no weights file:
it is the spec ``torchvision:MODEL:WEIGHTS`` (:mod:`robust_attn.sources.torchvision_source`,
with that source's preprocessing and its clear error when the weights cannot be fetched).
"""
from __future__ import annotations

import dataclasses

from robust_attn.sources import register_source
from robust_attn.sources.base import LoadedModel, SourceError, SourceRequest


@register_source("zoo", label=str)
def load_zoo(request: SourceRequest) -> LoadedModel:
    from robust_attn.models.manifest import Manifest, load_entry

    if request.checkpoint or request.model_args:
        raise SourceError(f"{request.spec!r} names its weights in the zoo manifest: drop --checkpoint and "
                          f"--model-args (or use the registry spec {request.target!r} with --checkpoint)")
    manifest = Manifest(request.manifest)
    try:
        entry = manifest.get(request.target, request.dataset_info.name)
    except KeyError as err:
        raise SourceError(err.args[0]) from None
    if entry.source == "torchvision":
        from robust_attn.sources.torchvision_source import load_torchvision

        target = f"{entry.torchvision['model']}:{entry.torchvision['weights']}"
        loaded = load_torchvision(dataclasses.replace(request, spec=f"torchvision:{target}", target=target))
        loaded.description.update(source="zoo", model=entry.name, zoo_entry=entry.name,
                                  torchvision=dict(entry.torchvision))
        return loaded
    model = load_entry(entry, manifest, device=request.device)
    arch = model.arch_args or entry.arch
    return LoadedModel(model, None, {
        "source": "zoo", "model": (arch or {}).get("name", entry.name), "zoo_entry": entry.name, "arch": arch,
        "checkpoint": {"path": entry.weights, "sha256": entry.sha256}, "weights_origin": "zoo",
        "weights_sha256": entry.sha256, "adversarial": dict(entry.adversarial)})
