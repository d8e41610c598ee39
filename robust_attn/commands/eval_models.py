"""The models of an ``eval`` subcommand that evaluates several at once (``eval transfer``): each
given as a zoo entry name, a checkpoint file or any model spec, loaded, checked and described
for ``run.json``."""
from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import torch

from robust_attn.cli import UserError
from robust_attn.commands.eval_common import (check_classes, check_common, check_deterministic_model, repair_run)

__all__ = ["load_named_model", "setup_models"]


def load_named_model(spec: str, info, device, other_dataset: bool = False) -> tuple[str, torch.nn.Module, dict]:
    """A transfer source or target: a zoo entry name (``NAME`` or ``zoo:NAME``, for the dataset),
    a checkpoint file, or any other model spec (:mod:`robust_attn.sources`; its description
    carries its ``preprocessing``). Returns (name, model, description)."""
    from robust_attn.models.checkpoint import check_num_classes, check_trained_on, load_checkpoint
    from robust_attn.models.manifest import Manifest, load_entry
    from robust_attn.sources import load_model_spec, parse_spec, spec_label
    from robust_attn.utils.io import sha256_file

    path = Path(spec)
    if not (spec.endswith(".safetensors") or path.is_file()) and parse_spec(spec)[0] not in ("registry", "zoo"):
        loaded = load_model_spec(spec, dataset_info=info, device=str(device))
        return spec_label(spec), loaded.model, loaded.description
    if spec.endswith(".safetensors") or path.is_file():
        if not path.is_file():
            raise UserError(f"checkpoint {path} does not exist; check the path")
        model = load_checkpoint(path)
        check_trained_on(path, info.name, allow_other=other_dataset)
        name = path.stem
        desc = {"model": model.arch_args.get("name", name), "checkpoint": {"path": str(path),
                                                                           "sha256": sha256_file(path)}}
    else:
        manifest = Manifest()
        entry_name = spec.removeprefix("zoo:")
        try:
            entry = manifest.get(entry_name, info.name)
        except (KeyError, ValueError) as err:
            raise UserError(f"{spec!r} is neither a checkpoint file nor a zoo model for {info.name}: {err}") from None
        model = load_entry(entry, manifest, device=str(device))
        name = entry.name
        desc = {"model": entry.name, "zoo_entry": entry.name,
                "checkpoint": {"path": entry.weights, "sha256": entry.sha256}}
    model = model.to(device).eval()
    check_num_classes(model, info.num_classes, f"model {spec}", image_size=info.image_size)
    return name.replace(".", "_"), model, desc


def setup_models(args, settings, run_name: str):
    """What :func:`robust_attn.commands.eval_common.setup_run` is for one model, for the
    ``source`` and ``target`` specs of ``settings``: (info, rank, world_size, device, (sources,
    targets), dataset, out, run_info), each model a ``(name, model, description)``, all of one
    preprocessing (a crafted image is one tensor for every model), each deterministic."""
    from robust_attn.data import dataset_info
    from robust_attn.distributed import init_distributed
    from robust_attn.sources.contract import apply_input_contract
    from robust_attn.sources.inputs import model_dataset, same_preprocessing

    if args.model or args.checkpoint or args.zoo:
        raise UserError(f"eval {run_name} takes its models as --source and --target, not --model/--checkpoint/--zoo")
    check_common(args)
    info = dataset_info(args.dataset, root=args.root)
    check_classes(info, args.root)
    rank, world_size, device = init_distributed(args.device)
    sources = [load_named_model(s, info, device, args.other_dataset) for s in settings.source]
    targets = [load_named_model(t, info, device, args.other_dataset) for t in settings.target]
    source_name = "+".join(n for n, _, _ in sources)
    common = same_preprocessing({n: d.get("preprocessing") for n, _, d in sources + targets},
                                "a transferred image is one tensor for every source and target",
                                "transfer between models of one preprocessing")
    dataset = model_dataset(args.dataset, common, root=args.root, split=args.split, limit=args.limit)[0]
    # each user's model: its input contract (printed, recorded with it); every model: deterministic
    flag = getattr(args, "model_input", None)
    sources, targets = ([(n, m, apply_input_contract(m, d, flag if d.get("source") == "callable" else None, dataset,
                                                     device, args.batch_size,
                                                     log=lambda line, n=n: print(f"{n}: {line}", file=sys.stderr)))
                         for n, m, d in group] for group in (sources, targets))
    for n, m, _ in sources + targets:
        check_deterministic_model(m, dataset, device, args.batch_size, name=f"model {n}")
    out = Path(args.out or f"runs/{run_name}-{source_name}-{args.dataset}-{args.split}")
    repair_run(args, out, rank)
    origins = sorted({d.get("weights_origin", "zoo" if d.get("zoo_entry") else "checkpoint") for _, _, d in sources})
    run_info = {"model": source_name, "sources": [d for _, _, d in sources],
                "checkpoint": [d["checkpoint"] for _, _, d in sources] if all(d.get("checkpoint") for _, _, d in
                                                                              sources) else None,
                "weights_origin": "+".join(origins),   # "random" only when every source's weights are
                "target_models": {n: d for n, _, d in targets},
                "dataset": {"name": args.dataset, "split": args.split, "limit": args.limit},
                "data_source": getattr(dataset, "source", None), "command": list(sys.argv),
                "device": str(device), "world_size": world_size, "host": socket.gethostname(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return info, rank, world_size, device, (sources, targets), dataset, out, run_info
