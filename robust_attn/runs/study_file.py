"""A study's ``study.json``, beside its report: the config it ran with, its packed runs and the
library versions, under a schema version of its own with a migration table, as ``run.json``'s
(:data:`robust_attn.runs.migrations.MIGRATIONS`).

:func:`load_study_file` reads a ``study.json`` of any version as the current version holds it,
so a committed report's config compares with today's configs and presets. A migration converts
what one version changed; the keys it converts are named in it, not looked up in the code of the
day (a saved file's meaning is fixed when it is written).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from robust_attn.runs.migrations import SCHEMA_KEY
from robust_attn.utils.io import atomic_path

__all__ = ["STUDY_SCHEMA_VERSION", "STUDY_MIGRATIONS", "StudyMigration", "load_study_file", "migrate_study",
           "write_study_file"]

#: the version of study.json's layout this code writes (key ``schema``; without it: version 1)
STUDY_SCHEMA_VERSION = 2


@dataclass(frozen=True)
class StudyMigration:
    """What one version changed: ``convert(config) -> config`` from the version before."""

    convert: Callable[[dict], dict]
    what: str = ""


#: the config keys that held attack radii in 1/255 units up to version 1
_RADII_V1 = ("sweep_eps", "autoattack_eps", "apgd_eps", "square_eps")


def _radii_in_image_units(config: dict) -> dict:
    def image_units(value):
        if isinstance(value, list):
            return [v / 255 for v in value]
        return None if value is None else value / 255

    return {k: image_units(v) if k in _RADII_V1 else v for k, v in config.items()}


STUDY_MIGRATIONS: dict[int, StudyMigration] = {
    2: StudyMigration(_radii_in_image_units,
                      what="attack radii in image units (8/255 is 0.0314), as on every command line; before it the "
                           "study's radii were in 1/255 units (8 meant 8/255)"),
}


def migrate_study(document: dict) -> dict:
    """``document`` (a study.json's content) at :data:`STUDY_SCHEMA_VERSION`."""
    version = document.get(SCHEMA_KEY, 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= STUDY_SCHEMA_VERSION:
        raise ValueError(f"study.json's {SCHEMA_KEY!r} is {version!r}, not a version this code reads (1 to "
                         f"{STUDY_SCHEMA_VERSION}); use a newer robust-attn or restore the file")
    config = dict(document.get("config", {}))
    for number, migration in sorted(STUDY_MIGRATIONS.items()):
        if number > version:
            config = migration.convert(config)
    return {**document, SCHEMA_KEY: STUDY_SCHEMA_VERSION, "config": config}


def load_study_file(path: str | Path) -> dict:
    """A study.json (``config``, ``runs``, ``versions``), migrated to the current version."""
    path = Path(path)
    try:
        return migrate_study(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from None


def write_study_file(path: str | Path, config: dict, runs: list[str], versions: dict) -> None:
    with atomic_path(Path(path)) as tmp:
        tmp.write_text(json.dumps({SCHEMA_KEY: STUDY_SCHEMA_VERSION, "config": config, "runs": runs,
                                   "versions": versions}, indent=2) + "\n")
