"""Whether a zoo entry can still be reproduced from the repository: its recipe, resolved as the
entry's ``command`` resolved it, must hash to what the trainer wrote into the checkpoint's
sidecar (``robust-attn zoo verify``).

The command is the manifest's record of how the checkpoint was trained (``robust-attn train
RECIPE KEY=VALUE ...``); its ``KEY=VALUE`` overrides (``epochs=40``, ``runtime.compile=true``) are
part of the recipe that trained it. ``data.root`` is not: where the data lay is taken from the
sidecar (the command names a placeholder), and ``model`` is the entry's architecture.
"""
from __future__ import annotations

import shlex
from pathlib import Path

from robust_attn.models.checkpoint import CheckpointError, read_sidecar

__all__ = ["REPO_ROOT", "project_recipe", "command_overrides", "recipe_error"]

REPO_ROOT = Path(__file__).resolve().parents[2]


def project_recipe(source: str) -> str:
    """The recipe path a manifest records for a trainer's ``recipe_source``: a project recipe
    (``.../zoo/recipes/NAME.toml``, e.g. given as an absolute path of another checkout) by its path in
    the repository, ``zoo/recipes/NAME.toml``, where this repository has that file; else as given."""
    parts = Path(source).parts
    if Path(source).is_absolute() and parts[-3:-1] == ("zoo", "recipes"):
        inside = Path(*parts[-3:])
        if (REPO_ROOT / inside).is_file():
            return inside.as_posix()
    return source


def command_overrides(command: str) -> list[str]:
    """The ``KEY=VALUE`` recipe overrides of a ``robust-attn train RECIPE ...`` command, without
    ``data.root``; none for another command or one that does not parse."""
    try:
        tokens = shlex.split(command)
    except ValueError:
        return []
    if "train" not in tokens:
        return []
    after_recipe = tokens[tokens.index("train") + 2:]
    return [t for t in after_recipe if "=" in t and not t.startswith("-") and t.partition("=")[0] != "data.root"]


def recipe_error(entry, weights: Path | None = None) -> str | None:
    """Why ``entry``'s recipe no longer resolves to the one that trained it, or None (also for an
    entry without a recipe)."""
    if not entry.recipe:
        return None
    from robust_attn.train.recipe import RecipeError, load_recipe, parse_overrides

    recipe_path = (REPO_ROOT / entry.recipe).resolve()
    if not recipe_path.is_file():
        return f"recipe {entry.recipe} of {entry.name} is missing"
    try:
        overrides = parse_overrides(command_overrides(entry.command))
    except RecipeError as err:
        return f"the command of {entry.name} does not parse as a training command ({err})"
    overrides["model"] = entry.arch.get("name", entry.name)
    if weights is not None:
        try:
            root = read_sidecar(weights).get("recipe", {}).get("data", {}).get("root")
        except CheckpointError:
            root = None   # verify names the unreadable sidecar itself
        if root:
            overrides.setdefault("data", {})["root"] = root
    recipe = load_recipe(recipe_path, overrides, check_data=False)
    if entry.recipe_sha256 and recipe.sha256() != entry.recipe_sha256:
        return (f"recipe {entry.recipe} changed since {entry.name} was trained (resolved-recipe sha256 "
                f"differs, with the overrides of its command: {' '.join(command_overrides(entry.command)) or 'none'}); "
                f"restore it, or retrain and re-add the checkpoint")
    return None
