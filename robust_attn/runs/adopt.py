"""Adopting records: a run takes the finished chunks of the same computation from another run.

Two studies often ask some of the same questions: the same model, on the same seeded images,
under the same attack. The CIFAR-10 adversarial study and the efficient-recipe study, for
example, both run Square at 8/255 and APGD-CE at 1-4/255 on the same 1,000 images of each
standard model. A record chunk is a function of the run's description (model and its weights,
images, protocol parameters, chunk grid) and of its condition's definition (attack, radius,
steps, seed; each chunk's randomness is seeded by the chunk's start), so a chunk written by one
run is the chunk the other would compute. Adopting it saves the computation and changes nothing.

What is compared, before any chunk is copied:

* every key of the two ``run.json`` but the volatile ones (:data:`~robust_attn.runs.identity.VOLATILE_KEYS`:
  command line, versions, device, ...) and ``conditions``: equal, as on resumption; the stored
  layout's ``schema`` too (the chunk's bytes are copied as they are);
* each condition: adopted only where both runs define it identically (same name, same definition);
  conditions only one run has are computed as usual.

A chunk is copied only if its checksum verifies in the source (a damaged source chunk, or a source
whose ``run.json`` is damaged, is left alone) and it is missing in the destination, under a claim
on it (:mod:`robust_attn.runs.claims`), so a process computing that chunk at the same time is never
overwritten. The chunk's manifest
entry goes with it, so the hardware that computed it stays recorded
(:meth:`~robust_attn.runs.store.RunStore.computed_on`), with ``"adopted_from"`` added: the run it
came from (each chunk's own entry, so processes adopting into one run at once never race).

Where the sources are: a folder of runs (a study's ``--runs``) may hold ``reuse.json``,
``{"runs": [FOLDER, ...]}`` (written by ``robust-attn study --reuse-runs FOLDER``; relative
folders are relative to the folder of runs); every run opened in that folder
(:func:`robust_attn.protocols.runner.open_run`) adopts from the run of the same name in each.
"""
from __future__ import annotations

import json
from pathlib import Path

from robust_attn.runs.migrations import SCHEMA_KEY
from robust_attn.runs.identity import VOLATILE_KEYS, differing_keys
from robust_attn.runs.store import DamagedRecordsError, RunStore, condition_definitions
from robust_attn.utils.io import atomic_path, atomic_write_json

__all__ = ["REUSE_FILE", "reuse_folders", "reuse_sources", "check_reuse_folders", "write_reuse_sources",
           "adopt_records", "adopted_chunks", "why_not_the_same_run"]

REUSE_FILE = "reuse.json"


def reuse_folders(runs_dir: str | Path) -> list[Path]:
    """The folders of runs that the ``reuse.json`` in ``runs_dir`` names (module docstring); []
    without one."""
    path = Path(runs_dir) / REUSE_FILE
    if not path.is_file():
        return []
    try:
        folders = json.loads(path.read_text())["runs"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path} is not a reuse file ({{\"runs\": [FOLDER, ...]}}); write it again with "
                         f"`robust-attn study ... --reuse-runs FOLDER` or delete it") from None
    return [(path.parent / f).resolve() for f in folders]


def reuse_sources(run_dir: str | Path) -> list[Path]:
    """The runs ``run_dir`` may adopt from: the run of its name in each folder that the
    ``reuse.json`` beside it names (module docstring); [] without one."""
    run_dir = Path(run_dir)
    return [folder / run_dir.name for folder in reuse_folders(run_dir.parent)]


def check_reuse_folders(runs_dir: str | Path, folders) -> list[Path]:
    """``folders`` (folders of runs, --reuse-runs) resolved, each once; a folder that does not
    exist, or the study's own ``runs_dir``, is an error (a typo would silently adopt nothing)."""
    checked: list[Path] = []
    for folder in folders:
        folder = Path(folder).resolve()
        if folder == Path(runs_dir).resolve():
            raise ValueError(f"--reuse-runs {folder} is this study's own folder of runs")
        if not folder.is_dir():
            raise FileNotFoundError(f"--reuse-runs {folder}: no such folder of runs (a study's --runs folder)")
        if folder not in checked:
            checked.append(folder)
    return checked


def write_reuse_sources(runs_dir: str | Path, folders) -> list[str]:
    """Add ``folders`` (folders of runs, checked by :func:`check_reuse_folders`) to the
    ``reuse.json`` of ``runs_dir``; returns them all."""
    runs_dir = Path(runs_dir)
    path = runs_dir / REUSE_FILE
    have = json.loads(path.read_text())["runs"] if path.is_file() else []
    for folder in check_reuse_folders(runs_dir, folders):
        if str(folder) not in have:
            have.append(str(folder))
    runs_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"runs": have})
    return have


def why_not_the_same_run(mine: dict, theirs: dict) -> str | None:
    """None if the two stored descriptions describe one computation but for their conditions;
    else the keys that differ (module docstring)."""
    keys = (set(mine) | set(theirs)) - VOLATILE_KEYS - {"conditions"}
    differ = differing_keys(mine, theirs, keys)
    return ", ".join(differ) if differ else None


def adopt_records(store: RunStore, source_dir: str | Path, log=None) -> list[tuple[str, int, int]]:
    """Copy into ``store`` the finished chunks of ``source_dir`` that ``store`` would compute
    identically and lacks (module docstring); returns them. ``log``: told what was adopted, and
    why nothing was from a run of the same name that differs."""
    source = RunStore(source_dir)
    if not source.exists() or source.root.resolve() == store.root.resolve() or source.packed or store.packed:
        return []
    mine = store.stored_description()
    try:
        theirs = source.stored_description()
    except DamagedRecordsError as err:   # the source's problem: this run computes its chunks itself
        if log:
            log(f"{store.root.name}: nothing adopted from {source.root} ({err})")
        return []
    differ = SCHEMA_KEY if mine.get(SCHEMA_KEY) != theirs.get(SCHEMA_KEY) else why_not_the_same_run(mine, theirs)
    if differ:
        if log:
            log(f"{store.root.name}: nothing adopted from {source.root} (another computation: {differ} differ)")
        return []
    wanted, offered = condition_definitions(mine), condition_definitions(theirs)
    shared = {name for name, definition in wanted.items() if offered.get(name) == definition}
    adopted = []
    for condition, start, stop in source.chunks():
        if condition not in shared or store.has_chunk(condition, start, stop):
            continue
        data, problem = source._read_chunk(condition, start, stop)
        if problem:
            continue
        claim = store.claim(condition, start, stop, timeout=None)
        if claim is None:
            continue
        try:
            if not store.has_chunk(condition, start, stop):
                _copy_chunk(source, store, condition, start, stop, data)
                adopted.append((condition, start, stop))
        finally:
            claim.release()
    if adopted and log:
        names = ", ".join(dict.fromkeys(c for c, _, _ in adopted))
        log(f"{store.root.name}: adopted {len(adopted)} record chunk(s) of {names} from {source.root} "
            f"(the same computation there)")
    return adopted


def _copy_chunk(source: RunStore, store: RunStore, condition: str, start: int, stop: int, data: bytes) -> None:
    """The manifest entry (with where the chunk came from) first, then the chunk, atomically (the
    order of ``write_chunk``)."""
    src = source.chunk_path(condition, start, stop)
    dst = store.chunk_path(condition, start, stop)
    entry = json.loads(source.checksum_path(src).read_text())
    atomic_write_json(store.checksum_path(dst), {**entry, "adopted_from": str(source.root.resolve())})
    with atomic_path(dst) as tmp:
        tmp.write_bytes(data)


def adopted_chunks(store: RunStore) -> int:
    """How many of the run's chunks were adopted rather than computed (their manifest entry names
    the run they came from)."""
    return sum("adopted_from" in entry for entry in store.manifest_entries().values())
