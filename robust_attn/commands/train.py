"""``robust-attn train RECIPE.toml [--out DIR] [--resume] [KEY=VALUE ...]``.

Trains the recipe's model (see :mod:`robust_attn.train`). The same command runs under
``torchrun --nproc_per_node=N -m robust_attn.cli train ...`` for DistributedDataParallel
(NCCL on GPUs, gloo on CPU); multi-node runs use torchrun's usual ``--nnodes``/``--rdzv-*`` flags.
Overrides use dotted keys, e.g. ``optim.lr=0.05 epochs=2 model=resnet38 model_args.width=0.5``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from robust_attn.cli import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model from a recipe (zoo/recipes/*.toml)",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("recipe", help="recipe TOML file, e.g. zoo/recipes/cifar100.toml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="recipe overrides with dotted keys, e.g. optim.lr=0.05 epochs=2")
    p.add_argument("--out", help="output directory (default: runs/<recipe>-<model>)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--stop-after", type=int, metavar="N",
                   help="stop after N epochs of this invocation (checkpoint written); continue with --resume")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--print-recipe", action="store_true", help="print the resolved recipe and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from robust_attn.train import load_recipe, train

    if args.stop_after is not None and args.stop_after < 1:
        raise UserError(f"--stop-after takes the number of epochs to train before stopping, at least 1; "
                        f"got {args.stop_after}")
    if not Path(args.recipe).is_file():
        what = "is a folder, not a recipe file" if Path(args.recipe).is_dir() else "does not exist"
        raise UserError(f"recipe {args.recipe} {what}; the shipped ones are zoo/recipes/*.toml in the repository")
    recipe = load_recipe(args.recipe, args.overrides, check_data=not args.print_recipe)
    if args.print_recipe:
        print(json.dumps(recipe.to_dict(), indent=2, sort_keys=True))
        print(f"sha256 {recipe.sha256()}")
        return 0
    out = Path(args.out) if args.out else Path("runs") / f"{Path(args.recipe).stem}-{recipe.model}"
    try:
        train(recipe, out, resume=args.resume, progress=not args.no_progress, stop_after=args.stop_after)
    finally:
        from robust_attn.distributed import cleanup

        cleanup()
    return 0
