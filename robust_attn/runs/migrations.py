"""The versions of run.json's layout and what each changed (:mod:`robust_attn.runs.store`).

A run.json says its layout's version (key ``schema``; a run.json without one is version 1).
A version changes the layout in one of two ways:

* it adds ``keys`` to run.json, or ``parameters`` to a protocol, with the value every run of an
  earlier version had. A stored run of an earlier version resumes without them: a key it lacks
  is not compared, and a parameter it lacks is not compared while the value asked for is the one
  every earlier run had (any other value is a different run);
* it stores a value in other units (:attr:`Migration.convert`). Reading converts: the run's
  description (:meth:`RunStore.description <robust_attn.runs.store.RunStore.description>`) and
  records (:meth:`~robust_attn.runs.store.RunStore.records`) of an earlier version come back in
  the current layout, so reports, comparisons and resumption see one layout. The stored files
  are never rewritten (a committed packed run keeps its bytes and checksums). A run of an
  earlier version resumed by this code gets its new record chunks in its own, stored layout
  (:func:`to_stored_layout`), so one run never holds two.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd

__all__ = ["SCHEMA_VERSION", "SCHEMA_KEY", "MIGRATIONS", "Migration", "Conversion", "IMAGE_UNITS", "schema_version",
           "added_after", "current_description", "current_records", "to_stored_layout"]

#: The version of run.json's layout this code writes.
SCHEMA_VERSION = 6
SCHEMA_KEY = "schema"
#: ``parameters["units"]`` of a run whose radii and perturbation norms are in [0, 1] image units
IMAGE_UNITS = "[0, 1] image units"


@dataclass(frozen=True)
class Conversion:
    """A change of units: ``applies`` (a stored description) says whether a run is concerned;
    ``description`` and ``records`` convert it to the new layout, ``records_back`` converts
    records of the new layout to the old one (for the chunks of an old run resumed)."""

    applies: Callable[[dict], bool]
    description: Callable[[dict], dict]
    records: Callable[[pd.DataFrame], pd.DataFrame]
    records_back: Callable[[pd.DataFrame], pd.DataFrame]


@dataclass(frozen=True)
class Migration:
    """What one schema version changed in run.json: top-level ``keys`` added, protocol
    ``parameters`` added with the value every run of an earlier version had, or values
    converted (``convert``)."""

    keys: frozenset = frozenset()
    parameters: dict = field(default_factory=dict)
    what: str = ""
    convert: Conversion | None = None


# --- version 6: Table 10's PGD in image units -------------------------------------------------
_PGD_OLD_UNITS = "1/255"


def _pgd_in_255(description: dict) -> bool:
    parameters = description.get("parameters")
    return (description.get("protocol") == "pgd" and isinstance(parameters, dict)
            and parameters.get("units") == _PGD_OLD_UNITS)


def _pgd_description(description: dict) -> dict:
    """Conditions' ``eps`` and ``step`` divided by 255; ``parameters["units"]`` the image units."""
    out = copy.deepcopy(description)
    out["parameters"]["units"] = IMAGE_UNITS
    for condition in out.get("conditions", []):
        if isinstance(condition, dict):
            for key in ("eps", "step"):
                if isinstance(condition.get(key), (int, float)) and not isinstance(condition[key], bool):
                    condition[key] = float(condition[key]) / 255
    return out


def _pgd_records(records: pd.DataFrame) -> pd.DataFrame:
    """The per-image ``linf`` (largest pixel change) divided by 255."""
    if "linf" not in records:
        return records
    return records.assign(linf=records["linf"] / 255)


def _pgd_records_back(records: pd.DataFrame) -> pd.DataFrame:
    """``linf`` in 1/255 units, to 4 decimals (as runs of version 5 and before recorded it)."""
    if "linf" not in records:
        return records
    return records.assign(linf=(records["linf"] * 255).round(4))


#: Every schema version after the first, by number: what it changed.
MIGRATIONS: dict[int, Migration] = {
    2: Migration(frozenset({"source", "spec", "weights_origin", "weights_sha256", "params", "preprocessing",
                            "weights_preprocessing", "dataset"}),
                 what="where the model came from (robust_attn.sources.provenance) and the dataset of a "
                      "Python-API run that named none"),
    3: Migration(frozenset({"data_variant"}),
                 what="the data's variant (e.g. the canonical CIFAR-10 pickles against the JPEG copy); "
                      "before it every dataset had one variant"),
    4: Migration(parameters={"exact": False},
                 what="PGD's exact mode; before it the native backend always ran its fast mode"),
    5: Migration(frozenset({"input_contract"}),
                 what="the model's input contract (robust_attn.sources.contract); before it every model took "
                      "normalized input"),
    6: Migration(convert=Conversion(_pgd_in_255, _pgd_description, _pgd_records, _pgd_records_back),
                 what="Table 10's PGD (protocol pgd) records its conditions' eps and step and each image's linf "
                      "in [0, 1] image units, as every other protocol; before it in 1/255 units "
                      "(parameters[\"units\"] == \"1/255\"). The condition names keep Table 10's 1/255 numbers "
                      "(pgd_eps8_step2_n4)"),
}


def schema_version(description: dict) -> int:
    """The version of a stored run.json's layout: its ``schema`` (1 without one), or the version
    before the first migration whose keys or parameters it lacks (a run.json edited by hand, or
    written by a copy of the code between two versions, is read as what it holds). ``ValueError``
    when ``schema`` is not a version number."""
    version = description.get(SCHEMA_KEY, 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"run.json's {SCHEMA_KEY!r} is {version!r}, not a version number")
    parameters = description.get("parameters")
    parameters = parameters if isinstance(parameters, dict) else {}
    for number, migration in sorted(MIGRATIONS.items()):
        if number <= version and (migration.keys - set(description) or set(migration.parameters) - set(parameters)):
            return number - 1
    return version


def added_after(version: int) -> Migration:
    """Everything the versions after ``version`` added, as one migration."""
    later = [m for v, m in sorted(MIGRATIONS.items()) if v > version]
    return Migration(frozenset().union(*(m.keys for m in later)),
                     {k: d for m in later for k, d in m.parameters.items()})


def _conversions(stored: dict) -> list[Conversion]:
    """The conversions that apply to the stored description ``stored``, oldest first."""
    version = schema_version(stored)
    return [m.convert for v, m in sorted(MIGRATIONS.items())
            if v > version and m.convert is not None and m.convert.applies(stored)]


def current_description(stored: dict) -> dict:
    """The stored run.json ``stored`` in the current layout (unchanged when no conversion applies)."""
    out = stored
    for conversion in _conversions(stored):
        out = conversion.description(out)
    return out


def current_records(stored: dict, records: pd.DataFrame) -> pd.DataFrame:
    """The records of the run whose stored run.json is ``stored``, in the current layout."""
    for conversion in _conversions(stored):
        records = conversion.records(records)
    return records


def to_stored_layout(stored: dict, records: pd.DataFrame) -> pd.DataFrame:
    """Records computed by this code, in the layout of the run whose stored run.json is ``stored``
    (a run of an earlier version resumed: its new chunks match its old ones)."""
    for conversion in reversed(_conversions(stored)):
        records = conversion.records_back(records)
    return records
