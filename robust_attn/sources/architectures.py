"""``NAME``: an architecture of the robust-attn registry (``robust-attn zoo list``).

Without a checkpoint the weights are random (drawn after ``torch.manual_seed(seed)``, with a
warning: the numbers then say nothing about the architecture); with one, the robust-attn
checkpoint (.safetensors + .json sidecar) is loaded and must hold ``NAME`` (or the spec is
left out and the sidecar names the architecture). The model takes the dataset's images as they
are: preprocessing ``None``, normalization with the dataset's mean/std (random weights) or the
checkpoint's (inside the wrapper).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from robust_attn.sources import REGISTRY, register_source
from robust_attn.sources.base import LoadedModel, SourceError, SourceRequest, state_dict_sha256
from robust_attn.sources.provenance import RANDOM


@register_source(REGISTRY, label=str, form="NAME (registry; with --checkpoint)")
def load_registry(request: SourceRequest) -> LoadedModel:
    from robust_attn.models.checkpoint import check_trained_on, load_checkpoint
    from robust_attn.models.registry import create_model
    from robust_attn.utils.io import sha256_file
    from robust_attn.models.wrapper import NormalizedModel

    info, name = request.dataset_info, request.target
    if request.checkpoint:
        if request.model_args:
            raise SourceError("--model-args is for building a model without --checkpoint; a checkpoint carries "
                              "its architecture")
        path = Path(request.checkpoint)
        if not path.is_file():
            what = "is a folder; give the .safetensors file in it" if path.is_dir() else \
                "does not exist; train one with `robust-attn train` or check the path"
            raise SourceError(f"checkpoint {path} {what}")
        sha = sha256_file(path)
        model = load_checkpoint(path, map_location=request.device)
        check_trained_on(path, info.name, allow_other=request.other_dataset)
        arch = model.arch_args
        if name and name != arch["name"]:
            raise SourceError(f"--model {name} but checkpoint {path} holds {arch['name']}; drop --model or pass "
                              f"the matching checkpoint")
        if arch["num_classes"] != info.num_classes:
            raise SourceError(f"checkpoint {path} has {arch['num_classes']} classes but dataset {info.name} has "
                              f"{info.num_classes}; evaluate it on the dataset it was trained on")
        return LoadedModel(model, None, {"source": REGISTRY, "model": arch["name"], "arch": arch,
                                         "checkpoint": {"path": str(path), "sha256": sha},
                                         "weights_origin": "checkpoint", "weights_sha256": sha})
    torch.manual_seed(request.seed)
    net = create_model(name, num_classes=info.num_classes, resolution=info.resolution, **request.model_args)
    print(f"WARNING: no --checkpoint: evaluating {name} with RANDOM weights (seed {request.seed}); its numbers "
          f"mean nothing about the architecture", file=sys.stderr)
    model = NormalizedModel(net, info.mean, info.std).eval()
    return LoadedModel(model, None, {"source": REGISTRY, "model": name, "arch": net.arch_args, "checkpoint": None,
                                     "init_seed": request.seed, "weights_origin": RANDOM,
                                     "weights_sha256": state_dict_sha256(model)})
