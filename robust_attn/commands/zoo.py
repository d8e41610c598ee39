"""``robust-attn zoo list``: every architecture with parameters and multiply-adds at both
resolutions, beside the papers' figures where ../reports/reference has them."""
from __future__ import annotations

import argparse

from robust_attn.complexity import model_complexity
from robust_attn.reference import imagenet_reference
from robust_attn.registry import list_models, model_info


def add_parser(sub: argparse._SubParsersAction) -> None:
    zoo = sub.add_parser("zoo", help="list, verify and extend the model zoo")
    zoo_sub = zoo.add_subparsers(dest="zoo_command", required=True, metavar="ZOO_COMMAND")
    lst = zoo_sub.add_parser("list", help="architectures with parameters and multiply-adds")
    lst.add_argument("pattern", nargs="?", default="*", help="shell-style filter, e.g. 'san*'")
    lst.set_defaults(func=run_list)
    try:  # verify / add live with the checkpoint manifest
        from robust_attn.commands import zoo_manifest
    except ModuleNotFoundError:
        return
    zoo_manifest.add_parsers(zoo_sub)


def run_list(args: argparse.Namespace) -> int:
    reference = imagenet_reference()
    header = (f"{'model':<18} {'family':<7} {'params(224)':>11} {'MACs(224)':>9} {'paper':>13} "
              f"{'params(32)':>10} {'MACs(32)':>8}")
    print(header)
    print("-" * len(header))
    for name in list_models(args.pattern):
        big = model_complexity(name, 1000, "imagenet")
        small = model_complexity(name, 100, "cifar")
        ref = reference.get(name)
        paper = f"{ref['params_M']:.1f}M/{ref['flops_G']:.1f}G" if ref else "-"
        print(f"{name:<18} {model_info(name).family:<7} {big['params'] / 1e6:>10.2f}M {big['macs'] / 1e9:>8.2f}G "
              f"{paper:>13} {small['params'] / 1e6:>9.2f}M {small['macs'] / 1e9:>7.3f}G")
    print("params(224)/MACs(224): 1000 classes at 224x224; params(32)/MACs(32): 100 classes at 32x32. "
          "paper: the publication's params/FLOPs (see reports/reference; SASA, GSA and AA count "
          "multiplies and adds separately, i.e. 2x MACs).")
    return 0
