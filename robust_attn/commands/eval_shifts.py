"""``robust-attn eval corruption|occlusion|shuffle``: distribution shifts beyond rotation (issue
#17) on one model: Hendrycks & Dietterich's common corruptions, Naseer et al.'s occlusion and
patch shuffling. Same model, data and output options as ``eval rotation``
(:mod:`robust_attn.commands.eval`); resumable, and sharded under torchrun."""
from __future__ import annotations

from pathlib import Path

from robust_attn.cli import UserError
from robust_attn.commands.eval_common import add_common_options, setup_run, with_cleanup, parse_list

__all__ = ["add_shift_parsers", "run_corruption_cmd", "run_occlusion_cmd", "run_shuffle_cmd"]


def add_shift_parsers(ev_sub) -> None:
    cor = ev_sub.add_parser("corruption", help="common corruptions (Hendrycks & Dietterich 2019) at severities 1-5")
    add_common_options(cor)
    cor.add_argument("--corruptions", default="common",
                     help="common (the 15 of ImageNet-C), extra (speckle_noise, gaussian_blur, spatter, saturate), all, "
                          "a family (noise, blur, weather, digital) or names, comma list (default common; frost needs "
                          "`pip install imagecorruptions` for its photographs)")
    cor.add_argument("--severities", default="1,2,3,4,5", help="comma list of severities 1-5 (default all five)")
    cor.add_argument("--shift-seed", type=int, default=0, help="seed of the per-image corruptions (default 0)")
    cor.add_argument("--cache", help="make the corrupted images once in this folder and read them from there "
                                     "(reused by every model evaluated with the same folder, data and seed)")
    cor.add_argument("--published", help="read the corrupted images from the published CIFAR-10-C .npy files or the "
                                          "ImageNet-C folder tree in this folder instead of making them")
    cor.add_argument("--baseline", help="a finished corruption run of the baseline model: print CE and mCE against it")
    cor.set_defaults(func=run_corruption_cmd)
    occ = ev_sub.add_parser("occlusion", help="random square occlusion and grid PatchDrop (Naseer et al. 2021)")
    add_common_options(occ)
    occ.add_argument("--areas", default="10,25,50,75", help="percent of the image one square covers, comma list "
                                                            "(default 10,25,50,75)")
    occ.add_argument("--fill", default="zeros,mean", help="zeros and/or mean (the dataset's mean colour), comma list")
    occ.add_argument("--drop", default="25,50,75", help="percent of grid cells dropped, comma list; 'none' for no "
                                                        "PatchDrop (default 25,50,75)")
    occ.add_argument("--drop-grid", type=int, default=4, help="PatchDrop grid: g x g cells (default 4)")
    occ.add_argument("--shift-seed", type=int, default=0, help="seed of the per-image positions (default 0)")
    occ.set_defaults(func=run_occlusion_cmd)
    shu = ev_sub.add_parser("shuffle", help="patch shuffling on a g x g grid (Naseer et al. 2021)")
    add_common_options(shu)
    shu.add_argument("--grids", default="1,2,4,8", help="grid sizes g, comma list; each must divide the image size "
                                                        "(default 1,2,4,8)")
    shu.add_argument("--shift-seed", type=int, default=0, help="seed of the per-image permutations (default 0)")
    shu.set_defaults(func=run_shuffle_cmd)


def _image_size(args) -> tuple[int, int]:
    from robust_attn.data import dataset_info

    size = dataset_info(args.dataset, root=args.root).image_size   # imagefolder: needs --root
    return size, size


def _source(args):
    """The corrupted-image source of ``eval corruption`` and its name in run.json."""
    from robust_attn.shifts.cache import CorruptionCache, OnTheFly

    if args.published and args.cache:
        raise UserError("--published reads the published files; --cache is for images made here: give one")
    if args.published:
        from robust_attn.data import build_dataset
        from robust_attn.data.splits import subset_indices
        from robust_attn.shifts.published import PublishedCorruptions, published_reader

        if not Path(args.published).is_dir():
            raise UserError(f"--published {args.published} is not a folder")
        reader = published_reader(args.dataset, args.published)
        full = len(build_dataset(args.dataset, root=args.root, split=args.split)) if args.limit else None
        positions = subset_indices(full, args.limit) if full else None
        return (lambda dataset: PublishedCorruptions(reader, positions)), \
            ("imagenet-c" if args.dataset == "imagenet" else f"{args.dataset}-c")
    if args.cache:
        key = {"name": args.dataset, "split": args.split, "limit": args.limit}
        return (lambda dataset: CorruptionCache(args.cache, dataset, key, seed=args.shift_seed,
                                                batch_size=args.batch_size)), "generated"
    return (lambda dataset: OnTheFly(args.shift_seed)), "generated"


@with_cleanup
def run_corruption_cmd(args) -> int:
    from robust_attn.protocols.corruption import check_frost, corruption_conditions, run_corruption, summarize_corruption
    from robust_attn.runs.store import load_records

    conditions = corruption_conditions(args.corruptions, parse_list(args.severities, int, "--severities"))
    make_source, images = _source(args)
    if images == "generated":
        check_frost(conditions)
    if args.baseline and not (Path(args.baseline) / "run.json").is_file():
        raise UserError(f"--baseline {args.baseline} is not a run directory (no run.json)")
    info, rank, world_size, device, model, dataset, out, run_info = setup_run(args, "corruption")
    source = make_source(dataset)
    if hasattr(source, "ensure"):
        source.ensure([(c["corruption"], c["severity"]) for c in conditions[1:]], repair=args.repair,
                      log=print if rank == 0 else None)
    store = run_corruption(model, dataset, out, conditions=conditions, seed=args.shift_seed, source=source,
                           images=images, batch_size=args.batch_size, device=device, run_info=run_info, rank=rank,
                           world_size=world_size, num_workers=args.num_workers, progress=not args.no_progress)
    if rank == 0:
        records = load_records(store.root)
        summary = summarize_corruption(records, conditions)
        corrupted = summary[summary["severity"] > 0]
        per_severity = corrupted.groupby("severity")["top1"].mean()
        print(f"corruption {run_info['model']} on {args.dataset}/{args.split} ({len(dataset)} images, {images}): clean "
              f"top-1 {summary.loc[0, 'top1']:.1f}; mean top-1 over {corrupted['corruption'].nunique()} corruption(s): "
              + ", ".join(f"s{s} {v:.1f}" for s, v in per_severity.items()) + f" -> {store.root}")
        if args.baseline:
            _print_mce(records, conditions, Path(args.baseline))
    return 0


def _print_mce(records, conditions, baseline: Path) -> None:
    from robust_attn.runs.store import load_description, load_records
    from robust_attn.shifts.metrics import error_table, mce_summary

    base_desc = load_description(baseline)
    if base_desc.get("protocol") != "corruption":
        raise UserError(f"--baseline {baseline} is a {base_desc.get('protocol')} run, not a corruption run")
    summary = mce_summary(error_table(records, conditions),
                          error_table(load_records(baseline), base_desc["conditions"]))
    print(f"against {base_desc.get('model')} ({baseline}): mCE {summary['mCE']:.1f}, relative mCE "
          f"{summary['relative_mCE']:.1f} over {summary['corruptions']} corruption(s)")


@with_cleanup
def run_occlusion_cmd(args) -> int:
    from robust_attn.protocols.occlusion import occlusion_conditions, run_occlusion, summarize_occlusion
    from robust_attn.runs.store import load_records

    drop = [] if str(args.drop).strip().lower() in ("none", "0", "") else parse_list(args.drop, float, "--drop")
    fills = [f.strip() for f in args.fill.split(",") if f.strip()]
    conditions = occlusion_conditions(parse_list(args.areas, float, "--areas"), fills, drop, args.drop_grid,
                                      image_size=_image_size(args))
    info, rank, world_size, device, model, dataset, out, run_info = setup_run(args, "occlusion")
    store = run_occlusion(model, dataset, out, conditions=conditions, mean=info.mean, seed=args.shift_seed,
                          batch_size=args.batch_size, device=device, run_info=run_info, rank=rank,
                          world_size=world_size, num_workers=args.num_workers, progress=not args.no_progress)
    if rank == 0:
        _print_top1("occlusion", args, run_info, len(dataset), summarize_occlusion(load_records(store.root), conditions),
                    store.root)
    return 0


@with_cleanup
def run_shuffle_cmd(args) -> int:
    from robust_attn.protocols.shuffle import run_shuffle, shuffle_conditions, summarize_shuffle
    from robust_attn.runs.store import load_records

    conditions = shuffle_conditions(parse_list(args.grids, int, "--grids"), image_size=_image_size(args))
    info, rank, world_size, device, model, dataset, out, run_info = setup_run(args, "shuffle")
    store = run_shuffle(model, dataset, out, conditions=conditions, seed=args.shift_seed, batch_size=args.batch_size,
                        device=device, run_info=run_info, rank=rank, world_size=world_size,
                        num_workers=args.num_workers, progress=not args.no_progress)
    if rank == 0:
        _print_top1("shuffle", args, run_info, len(dataset), summarize_shuffle(load_records(store.root), conditions),
                    store.root)
    return 0


def _print_top1(protocol: str, args, run_info: dict, n: int, summary, root) -> None:
    parts = [f"{row.condition} {row.top1:.1f}" for row in summary.itertuples()]
    print(f"{protocol} {run_info['model']} on {args.dataset}/{args.split} ({n} images): top-1 " + ", ".join(parts)
          + f" -> {root}")
