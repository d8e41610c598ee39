"""The study command's size options: ``--preset NAME`` (:mod:`robust_attn.study.presets`) and
``--plan`` (print what would run and its estimated time, then stop)."""
from __future__ import annotations

import argparse

__all__ = ["add_size_options", "chosen_preset", "with_preset", "preset_suffix", "NO_PRESET"]

#: ``--preset none``: the study config's own defaults, nothing from a preset
NO_PRESET = "none"


def add_size_options(p: argparse.ArgumentParser) -> None:
    from robust_attn.study.presets import DEFAULT_CPU, DEFAULT_GPU, list_presets

    p.add_argument("--preset", choices=[*list_presets(), NO_PRESET],
                   help=f"the study's size; options given beside it override its values. {DEFAULT_CPU}: about 20 "
                        f"minutes on a 2-core CPU (the default on a CPU); {DEFAULT_GPU}: the default on a GPU; full: "
                        f"the committed report's settings (reports/study-DATASET; days on a CPU); {NO_PRESET}: the "
                        f"defaults listed here. With CONFIG.toml: none unless given")
    p.epilog = (f"Sizes: the defaults the options list are the study config's own (--preset {NO_PRESET}); without a "
                f"config file the preset in force ({DEFAULT_CPU} on a CPU, {DEFAULT_GPU} on a GPU) sets its values "
                f"first, and the options given override them. --plan prints what would run and its estimated time.")
    p.add_argument("--plan", action="store_true",
                   help="load the models, time each on a few images and print what the study would run with the "
                        "estimated time per protocol and model; run nothing")


def chosen_preset(args) -> str | None:
    """The preset in force: ``--preset``, else (no config file) the device's default; None: none."""
    from robust_attn.study.presets import DEFAULT_CPU, DEFAULT_GPU

    if args.preset is not None:
        return None if args.preset == NO_PRESET else args.preset
    if getattr(args, "config", None):
        return None
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return DEFAULT_CPU if device.startswith("cpu") else DEFAULT_GPU


def with_preset(args, given: dict, dataset: str | None = None) -> dict:
    """``given`` (the config values the command line set) over the chosen preset's values for
    ``dataset`` (default: ``given``'s, else the study's default dataset)."""
    from robust_attn.study.config import StudySettings
    from robust_attn.study.presets import preset_values

    name = chosen_preset(args)
    if name is None:
        return given
    dataset = dataset or given.get("dataset") or StudySettings.dataset
    return {**preset_values(name, dataset), **given}


def preset_suffix(args) -> str:
    """What the preset adds to the default runs folder's name: nothing for the CPU's default
    preset (and a config file without ``--preset``), ``-NAME`` for another (so two sizes of one
    dataset do not share run folders)."""
    from robust_attn.study.presets import DEFAULT_CPU

    name = chosen_preset(args)
    return "" if name == DEFAULT_CPU or (name is None and getattr(args, "config", None)) else f"-{name or NO_PRESET}"
