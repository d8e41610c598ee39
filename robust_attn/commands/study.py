"""``robust-attn study``: SAN section 5.4 on the zoo models of a dataset (rotation, Table 10
PGD and an eps sweep on the same images), then the report with the findings
(:mod:`robust_attn.study.run`). ``robust-attn study CONFIG.toml`` runs the models a study config
names, from any source (:mod:`robust_attn.study.config`); the options below then override the
file's values (e.g. ``--limit 100`` for a first try). Resumable: run it again to finish an
interrupted study. Runs under ``torchrun --nproc_per_node=N -m robust_attn.cli study ...`` too
(each rank a shard of the images)."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from robust_attn.cli import UserError
from robust_attn.commands.eval_common import parse_list
from robust_attn.commands.study_preset import add_size_options, preset_suffix, with_preset

__all__ = ["add_parser", "run_study_cmd"]

def add_parser(sub: argparse._SubParsersAction) -> None:
    from robust_attn.layers.paths import ATTENTION_PATH_HELP, ATTENTION_PATHS
    from robust_attn.data import SPLITS
    from robust_attn.protocols.settings import add_options
    from robust_attn.study.batches import DEFAULT_BATCHES
    from robust_attn.study.config import protocol_fields, study_config_class

    d = study_config_class()()
    p = sub.add_parser("study", help="rotation, Table 10 PGD, AutoAttack, Square, transfer and gradient-masking "
                                     "checks on the zoo models of a dataset, or on the models of a study config "
                                     "(any source), then the report")
    p.add_argument("config", nargs="?", metavar="CONFIG.toml",
                   help="a study config: models from any source, dataset, protocols (e.g. zoo/studies/imagenet.toml);"
                        " without it, the zoo models of --dataset (one per architecture)")
    p.add_argument("--dataset", help=f"zoo dataset (default {d.dataset})")
    p.add_argument("--models", help="comma list of zoo entries (default: one per architecture of --dataset, "
                                    "the entry named after it); with CONFIG: "
                                    "the labels of the config's models to run")
    p.add_argument("--root", help="data folder (default: the config's root, $ROBUST_ATTN_DATA, ./data or the "
                                  "system copy)")
    p.add_argument("--split", choices=SPLITS, help=f"default {d.split}")
    p.add_argument("--limit", type=int, help="a fixed-seed subset of this many images (default: all)")
    p.add_argument("--batch-size", type=int,
                   help=f"images per batch and record chunk (default {DEFAULT_BATCHES['cifar'].batch_size} at 32 px, "
                        f"{DEFAULT_BATCHES['imagenet'].batch_size} at ImageNet resolution)")
    p.add_argument("--protocols", help=f"comma list of the protocols to run, in order (default {','.join(d.protocols)}; "
                                       f"separate processes may share --runs)")
    p.add_argument("--attack-limit", type=int,
                   help=f"seeded subset of images for apgd, autoattack, square and transfer "
                        f"(default {d.attack_limit})")
    p.add_argument("--attack-batch-size", type=int,
                   help=f"images per batch and record chunk of the attacks (default "
                        f"{DEFAULT_BATCHES['cifar'].attack_batch_size} at 32 px, {DEFAULT_BATCHES['imagenet'].attack_batch_size} at "
                        f"ImageNet resolution)")
    p.add_argument("--shift-seed", type=int, help=f"seed of the corruptions, occlusions and shuffles "
                                                  f"(default {d.shift_seed})")
    p.add_argument("--seed", type=int, help=f"attack targets and bootstrap seed (default {d.seed})")
    p.add_argument("--bootstrap", type=int, help=f"bootstrap resamples (default {d.bootstrap})")
    p.add_argument("--baseline", help=f"convolutional reference model (default {d.baseline})")
    add_options(p, protocol_fields())   # each protocol's settings (robust_attn.protocols.settings)
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--attention-path", choices=ATTENTION_PATHS, default="lean", help=ATTENTION_PATH_HELP)
    p.add_argument("--manifest", help="zoo manifest (default zoo/manifest.json)")
    p.add_argument("--runs", default=None, help="run directories (default runs/study-<dataset or config name>)")
    p.add_argument("--reuse-runs", action="append", metavar="FOLDER", default=[],
                   help="another study's --runs folder: its finished record chunks of the same computation (same "
                        "model, images and condition) are adopted instead of computed (written to --runs as "
                        "reuse.json, so resumptions and other workers adopt too; docs/studies.md)")
    p.add_argument("--out", default=None, help="report folder (default runs/study-<dataset or config name>-report; give "
                        "--out reports/study-NAME to regenerate a committed report)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes sharing the runs, one thread each (default on CPU: one per core; on GPU: 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_size_options(p)
    p.set_defaults(func=run_study_cmd)


def _given(args) -> dict:
    """The StudyConfig fields the command line sets (options left out are not in it): every field
    with an option of its name (``models`` and ``root`` are handled apart), a tuple field parsed
    from a comma list of its item type."""
    from robust_attn.protocols.settings import given_options
    from robust_attn.study.config import study_config_class

    fields = [f for f in dataclasses.fields(study_config_class()) if f.name not in ("models", "root")]
    return given_options(fields, args, parse_list)


def _config(args):
    from robust_attn.study.config import load_study_config, read_study_toml, study_config_class

    given = _given(args)
    selected = [m.strip() for m in (args.models or "").split(",") if m.strip()]
    try:
        if args.config:
            if "dataset" in given:
                raise UserError(f"--dataset is for the zoo study; {args.config} names its dataset")
            if args.preset is not None:
                given = with_preset(args, given, read_study_toml(args.config).get("dataset"))
            config = load_study_config(args.config, given)
            if selected:
                names = [m.name for m in config.models]
                unknown = [m for m in selected if m not in names]
                if unknown:
                    raise UserError(f"--models {','.join(unknown)}: {args.config} has no model labelled so; its "
                                    f"models: {', '.join(names)}")
                config = dataclasses.replace(config, models=tuple(m for m in config.models if m.name in selected))
            return config, Path(args.config).stem + preset_suffix(args)
        given = with_preset(args, given)
        config = study_config_class()(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()},
                             models=tuple(selected))
        return config, config.dataset + preset_suffix(args)
    except ValueError as err:
        raise UserError(str(err)) from None


def run_study_cmd(args) -> int:
    import torch

    from robust_attn.distributed import cleanup
    from robust_attn.study.run import default_workers, run_study

    config, name = _config(args)
    on_cpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
    workers = args.workers if args.workers is not None else (default_workers(config.dataset) if on_cpu else 1)
    if workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    runs = args.runs or f"runs/study-{name}"
    if args.reuse_runs:   # checked for --plan too, which writes nothing
        from robust_attn.runs.adopt import check_reuse_folders, write_reuse_sources
        try:
            (check_reuse_folders if args.plan else write_reuse_sources)(runs, args.reuse_runs)
        except (OSError, ValueError) as err:
            raise UserError(str(err)) from None
    try:
        run_study(config, runs, args.out or f"runs/study-{name}-report",
                  root=args.root, device=args.device, manifest=args.manifest, progress=not args.no_progress,
                  workers=workers, attention_path=args.attention_path, plan_only=args.plan,
                  reuse=args.reuse_runs or ())
    finally:
        cleanup()   # leave the torchrun process group, also on errors
    return 0
