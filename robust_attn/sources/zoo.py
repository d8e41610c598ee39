"""``zoo:NAME``: the zoo's trained ``NAME`` for the dataset (``zoo/manifest.json``, or
``$ROBUST_ATTN_ZOO_MANIFEST``), sha256-checked by :func:`robust_attn.zoo.load_entry`.

A checkpoint entry takes the dataset's images as they are (preprocessing ``None``); a
torchvision entry takes its weights' preprocessing (see :mod:`robust_attn.sources.torchvision_source`).
"""
from __future__ import annotations

from robust_attn.sources import register_source
from robust_attn.sources.base import LoadedModel, SourceError, SourceRequest, state_dict_sha256


@register_source("zoo")
def load_zoo(request: SourceRequest) -> LoadedModel:
    from robust_attn.zoo import Manifest, load_entry

    if request.checkpoint or request.model_args:
        raise SourceError(f"{request.spec!r} names its weights in the zoo manifest: drop --checkpoint and "
                          f"--model-args (or use the registry spec {request.target!r} with --checkpoint)")
    manifest = Manifest()
    try:
        entry = manifest.get(request.target, request.dataset_info.name)
    except KeyError as err:
        raise SourceError(err.args[0]) from None
    model = load_entry(entry, manifest, device=request.device)
    desc = {"source": "zoo", "model": entry.name, "zoo_entry": entry.name, "zoo_manifest": str(manifest.path),
            "arch": model.arch_args, "recipe": entry.recipe or None}
    preprocessing = None
    if entry.source == "torchvision":
        from robust_attn.sources.torchvision_source import preprocessing_of, weights_enum

        weights = weights_enum(entry.torchvision["model"], request.spec)[entry.torchvision["weights"]]
        preprocessing = preprocessing_of(weights)
        desc.update(checkpoint=None, torchvision=dict(entry.torchvision), weights_sha256=state_dict_sha256(model))
    else:
        path = manifest.resolve(entry.weights)
        desc.update(checkpoint={"path": str(path), "sha256": entry.sha256}, weights_sha256=entry.sha256)
    return LoadedModel(model, preprocessing, desc)
