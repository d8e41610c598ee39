"""``robust-attn study``: SAN section 5.4 on every zoo model of a dataset (rotation, Table 10
PGD and an eps sweep on the same images), then the report with the findings
(:mod:`robust_attn.study`). Resumable: run it again to finish an interrupted study. Runs under
``torchrun --nproc_per_node=N -m robust_attn.cli study ...`` too (each rank a shard of the images)."""
from __future__ import annotations

import argparse

from robust_attn.cli import UserError
from robust_attn.commands.eval import parse_list

__all__ = ["add_parser", "run_study_cmd"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    from robust_attn.study import BACKENDS, StudyConfig

    d = StudyConfig()
    p = sub.add_parser("study", help="rotation, Table 10 PGD, AutoAttack, Square, transfer and gradient-masking "
                                     "checks on every zoo model of a dataset, then the report")
    p.add_argument("--dataset", default=d.dataset, help=f"zoo dataset (default {d.dataset})")
    p.add_argument("--models", help="comma list of zoo entries (default: every entry for --dataset)")
    p.add_argument("--root", help="data folder (default: $ROBUST_ATTN_DATA, ./data or the system copy)")
    p.add_argument("--split", default=d.split, choices=["test", "val", "train"])
    p.add_argument("--limit", type=int, help="a fixed-seed subset of this many images (default: all)")
    p.add_argument("--angle-step", type=float, default=d.angle_step,
                   help=f"rotation sweep every this many degrees, 0 for none (default {d.angle_step:g})")
    p.add_argument("--sweep-eps", default=",".join(f"{e:g}" for e in d.sweep_eps),
                   help="eps sweep in 1/255, comma list (default %(default)s)")
    p.add_argument("--sweep-steps", type=int, default=d.sweep_steps, help="PGD steps of the sweep (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="images per batch and record chunk")
    p.add_argument("--protocols", default=",".join(d.protocols),
                   help="comma list of the protocols to run, in order (default %(default)s; separate processes "
                        "may share --runs)")
    p.add_argument("--attack-limit", type=int, default=d.attack_limit,
                   help="seeded subset of images for autoattack, square and transfer (default %(default)s)")
    p.add_argument("--autoattack-eps", default=",".join(f"{e:g}" for e in d.autoattack_eps),
                   help="AutoAttack L-inf radii in 1/255, comma list (default %(default)s)")
    p.add_argument("--square-queries", type=int, default=d.square_queries, help="Square's budget (default %(default)s)")
    p.add_argument("--attack-steps", type=int, default=None,
                   help="iterations of AutoAttack's members (default: the standard 100)")
    p.add_argument("--attack-batch-size", type=int, default=d.attack_batch_size,
                   help="images per batch and record chunk of the attacks (default %(default)s)")
    p.add_argument("--corruptions", default=d.corruptions,
                   help="corruption protocol: common, extra, all, families or names, comma list (default %(default)s)")
    p.add_argument("--severities", default=",".join(map(str, d.severities)),
                   help="corruption severities, comma list (default %(default)s)")
    p.add_argument("--occlusion-areas", default=",".join(f"{a:g}" for a in d.occlusion_areas),
                   help="occlusion: percent of the image one square covers, comma list (default %(default)s)")
    p.add_argument("--shuffle-grids", default=",".join(map(str, d.shuffle_grids)),
                   help="patch shuffle: grid sizes g, comma list (default %(default)s)")
    p.add_argument("--shift-seed", type=int, default=d.shift_seed, help="seed of the corruptions, occlusions and "
                                                                        "shuffles (default %(default)s)")
    p.add_argument("--backend", default=d.backend, choices=BACKENDS)
    p.add_argument("--seed", type=int, default=d.seed, help="attack targets and bootstrap seed")
    p.add_argument("--bootstrap", type=int, default=d.bootstrap, help="bootstrap resamples (default %(default)s)")
    p.add_argument("--baseline", default=d.baseline, help="convolutional reference model (default %(default)s)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--manifest", help="zoo manifest (default zoo/manifest.json)")
    p.add_argument("--runs", default=None, help="run directories (default runs/study-<dataset>)")
    p.add_argument("--out", default=None, help="report folder (default reports/study-<dataset>)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes sharing the runs, one thread each (default on CPU: one per core; on GPU: 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_study_cmd)


def run_study_cmd(args) -> int:
    from robust_attn.study import StudyConfig, run_study

    try:
        config = StudyConfig(dataset=args.dataset, split=args.split, limit=args.limit,
                             models=tuple(m.strip() for m in (args.models or "").split(",") if m.strip()),
                             angle_step=args.angle_step, sweep_eps=tuple(parse_list(args.sweep_eps, float, "--sweep-eps")),
                             sweep_steps=args.sweep_steps, batch_size=args.batch_size, seed=args.seed,
                             backend=args.backend, bootstrap=args.bootstrap, baseline=args.baseline,
                             protocols=tuple(p.strip() for p in args.protocols.split(",") if p.strip()),
                             attack_limit=args.attack_limit,
                             autoattack_eps=tuple(parse_list(args.autoattack_eps, float, "--autoattack-eps")),
                             square_queries=args.square_queries, attack_steps=args.attack_steps,
                             attack_batch_size=args.attack_batch_size, corruptions=args.corruptions,
                             severities=tuple(parse_list(args.severities, int, "--severities")),
                             occlusion_areas=tuple(parse_list(args.occlusion_areas, float, "--occlusion-areas")),
                             shuffle_grids=tuple(parse_list(args.shuffle_grids, int, "--shuffle-grids")),
                             shift_seed=args.shift_seed)
    except ValueError as err:
        raise UserError(str(err)) from None
    from robust_attn.distributed import cleanup

    import torch

    from robust_attn.study import default_workers

    on_cpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
    workers = args.workers if args.workers is not None else (default_workers() if on_cpu else 1)
    if workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    try:
        run_study(config, args.runs or f"runs/study-{args.dataset}", args.out or f"reports/study-{args.dataset}",
                  root=args.root, device=args.device, manifest=args.manifest, progress=not args.no_progress,
                  workers=workers)
    finally:
        cleanup()   # leave the torchrun process group, also on errors
    return 0
