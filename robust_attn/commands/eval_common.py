"""What every ``robust-attn eval`` subcommand shares: its common options, the model and images it
evaluates, the run directory's description, ``--repair`` and leaving the torchrun process group."""
from __future__ import annotations

import argparse
import ast
import math
import socket
import sys
import time
from pathlib import Path

import torch

from robust_attn.cli import UserError
from robust_attn.data import SPLITS
from robust_attn.layers.paths import ATTENTION_PATH_HELP, ATTENTION_PATHS

__all__ = ["parse_model_args", "parse_list", "add_common_options", "load_eval_model", "check_common", "check_classes",
           "setup_run", "check_deterministic_model", "repair_run", "with_cleanup"]


def parse_model_args(items: list[str] | None) -> dict:
    """``["width=0.25", "stem_downsample=2"]`` -> ``{"width": 0.25, "stem_downsample": 2}``."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--model-args takes key=value pairs (e.g. width=0.25), got {item!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = {"true": True, "false": False}.get(value.lower(), value)
    return out


def parse_list(text: str | None, kind=float, option: str = "") -> list | None:
    """``"2,4,8"`` -> ``[2.0, 4.0, 8.0]``; a clear error names the option (an empty item, as in
    ``1,,2``, or a non-finite float is refused, not skipped)."""
    if text is None:
        return None
    items = [v.strip() for v in str(text).split(",")]
    if items == [""]:
        raise UserError(f"{option} is empty")
    if "" in items:
        raise UserError(f"{option} has an empty item in {text!r}; write e.g. {option} 1,2,4")
    try:
        values = [kind(v) for v in items]
    except ValueError:
        raise UserError(f"{option} takes a comma-separated list of {kind.__name__}s, got {text!r}") from None
    if kind is float and not all(math.isfinite(v) for v in values):
        raise UserError(f"{option} takes finite numbers, got {text!r}")
    return values


def add_common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="SPEC",
                   help="model spec: NAME (registry architecture, robust-attn zoo list; with --checkpoint it must "
                        "match), zoo:NAME, timm:NAME (pip install timm), torchvision:NAME[:WEIGHTS|none], "
                        "san-official:PATH.pth[:ARCH], FILE.py:FUNCTION or package.module:FUNCTION (a function "
                        "returning an nn.Module; what it takes: --model-input)")
    p.add_argument("--checkpoint", help="trained weights: a robust-attn .safetensors with its .json sidecar "
                                        "(registry NAME), or a state dict file (.pth/.safetensors) for timm:, "
                                        "torchvision:NAME:none and FILE.py:FUNCTION; without one, NAME has RANDOM "
                                        "weights")
    p.add_argument("--zoo", action="store_true",
                   help="load --model's trained checkpoint for --dataset from the zoo manifest (sha256-checked)")
    p.add_argument("--model-args", nargs="*", default=[], metavar="KEY=VALUE",
                   help="keyword arguments of the model's constructor, e.g. width=0.25 (registry, without "
                        "--checkpoint), pretrained=False (timm) or those of your FUNCTION")
    from robust_attn.sources.contract import CONTRACTS, FLAG_HELP

    p.add_argument("--model-input", choices=CONTRACTS, help=FLAG_HELP)
    p.add_argument("--other-dataset", action="store_true",
                   help="evaluate a --checkpoint trained on another dataset than --dataset (refused otherwise)")
    p.add_argument("--dataset", default="imagenet", help="dataset name (default: imagenet)")
    p.add_argument("--root", help="data folder (default: $ROBUST_ATTN_DATA or ./data)")
    p.add_argument("--split", default="test", choices=SPLITS,
                   help="test = the paper's val-original set for ImageNet (default)")
    p.add_argument("--limit", type=int, help="evaluate a fixed-seed subset of this many images")
    p.add_argument("--batch-size", type=int, help="images per batch and per record chunk: every protocol, attack "
                                                  "and check runs the model on at most this many images at a time "
                                                  "(default: 64 for 32 px datasets, 16 at ImageNet resolution, which "
                                                  "fits 8 GB)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--attention-path", choices=ATTENTION_PATHS, default="lean", help=ATTENTION_PATH_HELP)
    p.add_argument("--num-workers", type=int, default=0, help="data loader workers")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights without --checkpoint "
                                                       "(and of the PGD targets)")
    p.add_argument("--out", help="run directory (default: runs/<protocol>-<model>-<dataset>-<split>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--repair", action="store_true", help="delete damaged record chunks (checksum mismatch) so they are computed again")


def load_eval_model(args, info) -> tuple[torch.nn.Module, dict]:
    """The NormalizedModel to evaluate and its part of the run description.

    ``--model`` is a model spec (:mod:`robust_attn.sources`): ``NAME`` (registry, random weights or
    ``--checkpoint``), ``zoo:NAME`` (``--zoo`` with ``NAME`` means the same), ``timm:NAME``,
    ``torchvision:NAME[:WEIGHTS]``, ``san-official:PATH.pth``, ``FILE.py:FUNCTION`` or
    ``package.module:FUNCTION``. The description records ``source``, ``spec``, ``weights_sha256``
    and the weights' ``preprocessing`` (None: the dataset's images as they are)."""
    from robust_attn.sources import load_model_spec, parse_spec, spec_help

    overrides = parse_model_args(args.model_args)
    spec = args.model
    if args.zoo:
        if not args.model or args.checkpoint:
            raise UserError("--zoo takes --model NAME (see zoo/manifest.json) and no --checkpoint")
        source, _ = parse_spec(args.model)
        if source not in ("registry", "zoo"):
            raise UserError(f"--zoo takes a zoo model NAME, not the spec {args.model!r}; drop --zoo")
        spec = args.model if source == "zoo" else f"zoo:{args.model}"
    if args.checkpoint and overrides and (spec is None or parse_spec(spec)[0] == "registry"):
        raise UserError("--model-args is for building a model without --checkpoint; a checkpoint carries its "
                        "architecture")
    if not spec and not args.checkpoint:
        raise UserError(f"give --model NAME (robust-attn zoo list) and usually --checkpoint PATH; --model takes "
                        f"any model spec: {spec_help()}")
    loaded = load_model_spec(spec, dataset_info=info, checkpoint=args.checkpoint, model_args=overrides,
                             seed=args.seed, other_dataset=args.other_dataset)
    return loaded.model, loaded.description


def check_common(args) -> None:
    """The numeric options every ``eval`` subcommand has, checked before anything is loaded or written.
    Without ``--batch-size``: 64 images for 32 px datasets, 16 at ImageNet resolution (an attack's
    backward pass on 16 images of an ImageNet model fits 8 GB; ``docs/memory.md``)."""
    if args.batch_size is None:
        from robust_attn.data import dataset_info

        args.batch_size = 16 if dataset_info(args.dataset, root=args.root).resolution == "imagenet" else 64
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be positive, got {args.batch_size}")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be positive, got {args.limit}")
    if args.num_workers < 0:
        raise UserError(f"--num-workers must be 0 (load in the main process) or more, got {args.num_workers}")


def check_classes(info, root=None) -> None:
    """A dataset of fewer than two classes is refused: every model is right on every image of it."""
    if info.num_classes < 2:
        where = f" (class folders under {root})" if root else ""
        raise UserError(f"dataset {info.name} has {info.num_classes} class{'' if info.num_classes == 1 else 'es'}"
                        f"{where}: accuracy and attacks need at least 2; give a folder with one subfolder per "
                        f"class, two or more")


def setup_run(args, protocol: str):
    from robust_attn.data import dataset_info
    from robust_attn.distributed import init_distributed
    from robust_attn.layers.paths import set_attention_path
    from robust_attn.sources.inputs import model_dataset, record_preprocessing

    check_common(args)
    info = dataset_info(args.dataset, root=args.root)  # imagefolder: the class count of --root's folders
    check_classes(info, args.root)
    rank, world_size, device = init_distributed(args.device)
    model, model_desc = load_eval_model(args, info)   # checked to output the dataset's classes
    set_attention_path(model, args.attention_path)
    # the weights' own preprocessing (resize/crop) where the dataset decodes image files
    dataset, applied = model_dataset(args.dataset, model_desc.get("preprocessing"), root=args.root,
                                     split=args.split, limit=args.limit)
    model_desc = record_preprocessing(model_desc, applied)
    model_desc = _preflight(args, model, model_desc, dataset, device, rank)
    out = Path(args.out or f"runs/{protocol}-{model_desc['model']}-{args.dataset}-{args.split}")
    repair_run(args, out, rank)
    run_info = dict(model_desc, dataset={"name": args.dataset, "split": args.split, "limit": args.limit},
                    data_root=str(args.root) if args.root else None, data_source=getattr(dataset, "source", None),
                    data_variant=getattr(dataset, "variant", args.dataset), command=list(sys.argv),
                    device=str(device), attention_path=args.attention_path, world_size=world_size,
                    host=socket.gethostname(),
                    created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    return info, rank, world_size, device, model, dataset, out, run_info


def _preflight(args, model, model_desc: dict, dataset, device, rank: int) -> dict:
    """Before any record: the model's input contract (:mod:`robust_attn.sources.contract`:
    declared, flagged or probed; printed and recorded) and a deterministic forward (two passes on
    the first images agree: dropout or another random layer left on makes every number of every
    protocol a draw)."""
    from robust_attn.sources.contract import apply_input_contract

    if len(dataset) < 1:
        raise UserError(f"--dataset {args.dataset} --split {args.split} holds no image; check --root and --limit")
    quiet = (lambda line: None) if rank != 0 else None
    model_desc = apply_input_contract(model, model_desc, getattr(args, "model_input", None), dataset, device,
                                      args.batch_size, log=quiet)
    check_deterministic_model(model, dataset, device, args.batch_size)
    return model_desc


def check_deterministic_model(model, dataset, device, batch_size: int, name: str = "the model") -> None:
    """Two forward passes on the first images (at most 8, at most ``batch_size``) must agree."""
    from robust_attn.attacks.checks import check_deterministic

    n = min(len(dataset), batch_size, 8)
    images = torch.stack([dataset[i][0] for i in range(n)]).to(device)
    check = check_deterministic(model, images)
    if not check.passed:
        raise UserError(f"{name} is not deterministic: {check.detail} on the same {n} images (dropout or "
                        f"another random layer left on?); call model.eval() in your function, or make its "
                        f"random layers follow self.training, so every protocol measures one model")


def repair_run(args, out: Path, rank: int) -> None:
    """``--repair``: rank 0 deletes the damaged chunks of ``out`` before the run resumes."""
    if getattr(args, "repair", False) and rank == 0:
        from robust_attn.runs.store import RunStore

        for path in RunStore(out).repair():
            print(f"--repair: {path} was damaged; computing it again", file=sys.stderr)


def with_cleanup(fn):
    """Leave the torchrun process group on the way out, also on errors."""

    def run(args) -> int:
        from robust_attn.distributed import cleanup

        try:
            return fn(args)
        finally:
            cleanup()

    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run
