"""Which computation a run.json describes: the keys compared when a run is resumed
(:meth:`robust_attn.runs.store.RunStore.open`) or its records adopted by another study
(:mod:`robust_attn.runs.adopt`), and those that are left out because they say where and how a run
ran rather than what it computes (:data:`VOLATILE_KEYS`).

A run resumes when every other key of its stored ``run.json`` equals the one asked for, with three
allowances: a run of an earlier layout version is read converted to the current one
(:func:`robust_attn.runs.migrations.current_description`), and keys or protocol parameters that a
later version added are compared only where the stored run has them (or where the value asked
for differs from the one every earlier run had); provenance entries of ``parameters``
(:data:`PROVENANCE_PARAMETERS`) are not compared; and a study's attack-subset run recorded before
such runs recorded the subset's limit resumes as the same images (:func:`_subset_recorded_as_the_study`).
"""
from __future__ import annotations

from robust_attn.runs.migrations import SCHEMA_KEY, added_after, current_description
from robust_attn.utils.differences import describe_difference

__all__ = ["VOLATILE_KEYS", "PROVENANCE_PARAMETERS", "differing_keys", "why_not_resumable"]

# Keys of run.json that may differ between a run and its resumption (where and how it ran,
# not what it computes). ``data_source`` is the folder or file the images were read from: the
# same data moved, or a clone of the repository elsewhere (the embedded test sets live inside the
# package), is the same run; what the data is stays compared as ``data_variant`` and ``dataset``.
# ``attention_path``: the implementation the SAN and SASA layers computed with
# (:mod:`robust_attn.layers.paths`), the same function on either path, as on any device; so is
# ``attack_copy``, the model the attacks queried (:func:`robust_attn.attacks.fast_model.attack_copy`).
VOLATILE_KEYS = frozenset({"command", "versions", "device", "world_size", "num_workers", "created",
                           "host", "data_root", "data_source", "attention_path", "input_contract_from",
                           "attack_copy"})
# Entries of run.json's "parameters" that record where an input came from rather than what it is:
# the PGD targets may be drawn from a seed or read from another run's targets.csv; the targets
# themselves are compared by content (the run's targets.csv) when a run is resumed.
PROVENANCE_PARAMETERS = frozenset({"targets"})


def differing_keys(a: dict, b: dict, keys) -> list[str]:
    """Those of ``keys`` whose values differ between the run descriptions ``a`` and ``b``, compared
    as on resumption (provenance entries dropped), sorted."""
    return sorted(k for k in keys if _comparable(k, a.get(k)) != _comparable(k, b.get(k)))


def _comparable(key: str, value):
    """``value`` of run.json's ``key`` as compared on resumption (provenance entries dropped)."""
    if key == "parameters" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in PROVENANCE_PARAMETERS}
    return value


def why_not_resumable(stored: dict, version: int, description: dict) -> str | None:
    """None if the stored ``run.json`` (of layout ``version``) describes the run ``description``
    asks for (module docstring); else the differing keys with their values, at most four."""
    later = added_after(version)
    current = current_description(stored)
    keys = (set(current) | set(description)) - VOLATILE_KEYS - {SCHEMA_KEY} - (later.keys - set(current))
    now = _with_later_defaults(current, description, later.parameters)
    differ = differing_keys(current, now, keys)
    if differ == ["dataset"] and _subset_recorded_as_the_study(current, now):
        return None
    return "; ".join(f"{k}: {describe_difference(_comparable(k, current.get(k)), _comparable(k, now.get(k)))}"
                     for k in differ[:4]) or None


def _with_later_defaults(stored: dict, description: dict, later_parameters: dict) -> dict:
    """``description`` without the parameters of ``later_parameters`` that ``stored`` lacks and
    that take the value every run had before they existed."""
    params, old = description.get("parameters"), stored.get("parameters")
    if not isinstance(params, dict) or not isinstance(old, dict):
        return description
    drop = {k for k, default in later_parameters.items() if k not in old and params.get(k, default) == default}
    return {**description, "parameters": {k: v for k, v in params.items() if k not in drop}} if drop else description


def _subset_recorded_as_the_study(stored: dict, description: dict) -> bool:
    """Whether ``stored`` is a study's run on its seeded attack subset as recorded before such runs
    recorded the subset's limit (:func:`robust_attn.study.run._on_its_images`): its dataset then
    named the study's limit (None: every image; else larger than the subset), on the same number of
    images. A seeded subset depends only on the split's size and the limit, so both are the images
    of ``description``'s limit, and the run resumes."""
    old, new = stored.get("dataset"), description.get("dataset")
    if not isinstance(old, dict) or not isinstance(new, dict) or new.get("limit") is None:
        return False
    if {k: v for k, v in old.items() if k != "limit"} != {k: v for k, v in new.items() if k != "limit"}:
        return False
    return stored.get("num_images") == description.get("num_images") and (
        old.get("limit") is None or old["limit"] > new["limit"])
