"""``robust-attn zoo list``: every architecture with parameters and multiply-adds at both
resolutions, beside the papers' figures where ../reports/reference has them."""
from __future__ import annotations

import argparse

from robust_attn.cli import UserError
from robust_attn.importers import IMPORTERS
from robust_attn.models.complexity import model_complexity
from robust_attn.models.manifest import (Manifest, ZooEntry, copy_into_zoo, entry_from_checkpoint, outside_manifest,
                                         training_label, verify_zoo)
from robust_attn.models.reference import imagenet_reference
from robust_attn.models.registry import list_models, model_info


def add_parser(sub: argparse._SubParsersAction) -> None:
    zoo = sub.add_parser("zoo", help="list, verify and extend the model zoo")
    zoo_sub = zoo.add_subparsers(dest="zoo_command", required=True, metavar="ZOO_COMMAND")
    lst = zoo_sub.add_parser("list", help="architectures with parameters and multiply-adds")
    lst.add_argument("pattern", nargs="?", default="*", help="shell-style filter, e.g. 'san*'")
    lst.add_argument("--manifest", default=None, help="manifest whose trained entries are listed after the "
                                                     "architectures (default zoo/manifest.json)")
    lst.set_defaults(func=run_list)

    verify = zoo_sub.add_parser("verify", help="check every manifest entry: file, sha256, architecture")
    verify.add_argument("--manifest", default=None, help="manifest file (default zoo/manifest.json)")
    verify.set_defaults(func=run_verify)

    add = zoo_sub.add_parser("add", help="register a trained checkpoint or a torchvision model in the manifest")
    add.add_argument("name", help="name of the entry, e.g. resnet26 or my_resnet26")
    add.add_argument("--dataset", required=True, help="dataset it was trained on, e.g. fashion_mnist")
    source = add.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a robust-attn checkpoint (.safetensors with its .json sidecar)")
    source.add_argument("--torchvision", metavar="MODEL", help="a torchvision model name, e.g. resnet50")
    add.add_argument("--weights", default="DEFAULT", help="torchvision weights enum member (with --torchvision)")
    add.add_argument("--command", dest="reproduce_command", default="",
                     help="the command that reproduces the checkpoint")
    add.add_argument("--log", default="", help="the training log (metrics.csv)")
    add.add_argument("--manifest", default=None, help="manifest file (default zoo/manifest.json)")
    add.add_argument("--force", action="store_true", help="replace an entry of the same name and dataset")
    add.add_argument("--copy", action="store_true",
                     help="copy the checkpoint, its sidecar and --log into the manifest's folder "
                          "(checkpoints/DATASET/NAME.safetensors, .json, _metrics.csv) and list the copies; "
                          "other files already there under those names are replaced only with --force")
    add.add_argument("--evaluate", action="store_true",
                     help="record the float32 test-set accuracy measured now (the whole test split and its "
                          "seeded fifth) instead of the trainer's, which under a bf16 recipe is under autocast")
    add.add_argument("--root", default=None, help="data root for --evaluate (default: where the dataset is found)")
    add.set_defaults(func=run_add)

    imp = zoo_sub.add_parser("import", help="convert another project's checkpoint into a robust-attn checkpoint")
    imp.add_argument("kind", choices=IMPORTERS.names(),
                     help="; ".join(f"{name}: {importer.summary}" for name, importer in IMPORTERS.items()))
    imp.add_argument("path", help="the source checkpoint (torch.save file)")
    imp.add_argument("--arch", required=True, help="our architecture, e.g. san10_pairwise or resnet50")
    imp.add_argument("--out", default=None, help="output .safetensors (default: PATH with suffix .safetensors)")
    imp.add_argument("--force", action="store_true", help="replace an existing output")
    imp.set_defaults(func=run_import)


def run_list(args: argparse.Namespace) -> int:
    reference = imagenet_reference()
    header = (f"{'model':<18} {'family':<7} {'params(224)':>11} {'MACs(224)':>9} {'paper':>13} "
              f"{'params(32)':>10} {'MACs(32)':>8}")
    print(header)
    print("-" * len(header))
    names = list_models(args.pattern)
    if not names:
        raise UserError(f"no architecture matches {args.pattern!r}; `robust-attn zoo list` lists them all")
    for name in names:
        big = model_complexity(name, 1000, "imagenet")
        small = model_complexity(name, 100, "cifar")
        ref = reference.get(name)
        paper = f"{ref['params_M']:.1f}M/{ref['macs_G']:.2f}G" if ref else "-"
        print(f"{name:<18} {model_info(name).family:<7} {big['params'] / 1e6:>10.2f}M {big['macs'] / 1e9:>8.2f}G "
              f"{paper:>13} {small['params'] / 1e6:>9.2f}M {small['macs'] / 1e9:>7.3f}G")
    print("params(224)/MACs(224): 1000 classes at 224x224; params(32)/MACs(32): 100 classes at 32x32. "
          "paper: the publication's params/multiply-adds at 224 (reports/reference; SASA, GSA and AA "
          "FLOPs, which count multiplies and adds separately, are halved).")
    _list_entries(Manifest(args.manifest), args.pattern)
    return 0


def _list_entries(manifest: Manifest, pattern: str) -> None:
    """The manifest's trained entries matching ``pattern``: name, dataset and how each was trained."""
    from fnmatch import fnmatch

    entries = [e for key, e in sorted(manifest.entries.items()) if fnmatch(e.name, pattern)]
    if not entries:
        return
    print(f"\ntrained entries of {manifest.path}:")
    for entry in entries:
        print(f"{entry.name:<18} {entry.dataset:<14} {training_label(entry.adversarial)}")


def run_verify(args: argparse.Namespace) -> int:
    manifest = Manifest(args.manifest)
    if not manifest.path.is_file():
        raise UserError(f"no manifest at {manifest.path}; give --manifest the path of one (the zoo's is "
                        f"zoo/manifest.json in the repository)")
    results = verify_zoo(manifest)
    for entry, error in results:
        shown = error or f"{entry.sha256[:16] or entry.source:<16} {training_label(entry.adversarial)}"
        print(f"{'FAIL' if error else 'ok':<4} {entry.name:<18} {entry.dataset:<14} {shown}")
    failed = sum(error is not None for _, error in results)
    print(f"{len(results) - failed}/{len(results)} entries verified in {manifest.path}")
    return 1 if failed else 0


def run_add(args: argparse.Namespace) -> int:
    from robust_attn.data import dataset_info

    manifest = Manifest(args.manifest)
    if (args.name, args.dataset) in manifest.entries and not args.force:
        raise UserError(f"{manifest.path} already has {args.name} ({args.dataset}); give the new entry another "
                        f"name, or pass --force to replace it")
    if args.checkpoint:
        entry = entry_from_checkpoint(args.name, args.dataset, args.checkpoint, manifest,
                                      command=args.reproduce_command, log=args.log)
        if args.copy:
            copy_into_zoo(manifest, entry, force=args.force)
            print(f"copied {args.checkpoint} into {manifest.resolve(entry.weights)}")
        elif outside_manifest(manifest, args.checkpoint):
            print(f"note: {args.checkpoint} lies outside {manifest.path.parent}, so a copy of that folder (a clone) "
                  f"will not have it; add --copy to copy it into {manifest.path.parent / 'checkpoints' / args.dataset}")
        if args.evaluate:
            from robust_attn.models.checkpoint import load_checkpoint
            from robust_attn.models.zoo_accuracy import measure_test_accuracy, with_measured_accuracy

            measured = measure_test_accuracy(load_checkpoint(manifest.resolve(entry.weights)), args.dataset, args.root)
            entry.metrics = with_measured_accuracy(entry.metrics, measured)
            print(f"measured on the {args.dataset} test set in float32: top-1 {measured['eval_top1']:.2f}%, "
                  f"top-5 {measured['eval_top5']:.2f}%, {measured['seeded_fifth_top1_correct']} correct on its "
                  f"seeded fifth")
    else:
        if args.evaluate:
            raise UserError("--evaluate measures a checkpoint (--checkpoint); a torchvision entry is not measured here")
        try:
            classes = dataset_info(args.dataset).num_classes
        except ValueError:   # imagefolder: its class count comes from a root, checked when it is loaded
            classes = None
        if classes not in (None, 1000):
            raise UserError(f"--torchvision models carry ImageNet's 1000 classes, but --dataset {args.dataset} "
                            f"has {classes}; register them with --dataset imagenet")
        entry = ZooEntry(name=args.name, dataset=args.dataset, source="torchvision",
                         torchvision={"model": args.torchvision, "weights": _torchvision_weights(args)},
                         notes="ImageNet weights through torchvision's weights API (needs network on first load)")
    manifest.add(entry)
    manifest.save()
    print(f"added {entry.name} ({entry.dataset}, {training_label(entry.adversarial)}) to {manifest.path}")
    return 0


def _torchvision_weights(args: argparse.Namespace) -> str:
    """The weights enum member ``--weights`` names, checked now rather than at the first load;
    ``DEFAULT`` is resolved to the member it means in this torchvision (an alias that moves)."""
    from robust_attn.sources.torchvision_source import weights_enum

    enum = weights_enum(args.torchvision, f"--torchvision {args.torchvision}")
    if args.weights not in enum.__members__:
        raise UserError(f"--weights {args.weights}: {enum.__name__} has {', '.join(enum.__members__)}")
    return enum[args.weights].name


def run_import(args: argparse.Namespace) -> int:
    from robust_attn.importers import import_checkpoint

    out, sha = import_checkpoint(args.kind, args.path, args.arch, args.out, overwrite=args.force)
    print(f"wrote {out} ({args.arch}, sha256 {sha[:16]}) from {args.path}; sidecar {out.with_suffix('.json')}")
    return 0
