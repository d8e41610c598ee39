"""Packed runs (:mod:`robust_attn.runs.store`): a finished run's records merged into one gzip CSV
(``records.csv.gz``) beside its ``run.json`` and other files, and ``checksums.json``, written
last and atomically: the sha256 of every file, the row count of the records and the record
chunks each device computed. Small enough to commit beside a report, so that the report can be
derived again, verified end to end, from what was saved.

:meth:`RunStore.pack <robust_attn.runs.store.RunStore.pack>` writes one (:func:`write_packed`); a
packed run reads like the original (:func:`verify_packed` checks it first) and cannot be written to.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd

from robust_attn.utils.io import atomic_path, atomic_write_json, sha256_bytes, sha256_file

__all__ = ["PACKED", "PACKED_MANIFEST", "is_packed", "verify_packed", "write_packed", "write_packed_manifest",
           "packed_computed_on", "packed_compute_time", "csv_rows"]

PACKED = "records.csv.gz"
PACKED_MANIFEST = "checksums.json"


def csv_rows(data: bytes) -> int:
    """Data rows of a CSV written by pandas (one header line, no embedded newlines); -1 when its
    last line is cut."""
    return max(data.count(b"\n") - 1, 0) if data.endswith(b"\n") else -1


def is_packed(root: Path) -> bool:
    return (root / PACKED).is_file() or (root / PACKED_MANIFEST).is_file()


def verify_packed(root: Path, seal_hint: str) -> tuple[list[tuple[Path, str]], bytes | None]:
    """Problems of the packed run in ``root`` against its ``checksums.json`` (``(path, what is
    wrong)``; ``seal_hint``: the command that adopts a run packed before checksums existed), and
    the verified records bytes (None unless intact)."""
    manifest_path = root / PACKED_MANIFEST
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except FileNotFoundError:
        return [(manifest_path, f"missing: the packed run has no checksums (packed before checksums "
                                f"existed, or deleted); `{seal_hint}` checks and adopts an intact old packed run")], None
    except (ValueError, KeyError, TypeError):
        return [(manifest_path, "unreadable")], None
    if not isinstance(files, dict) or not all(isinstance(e, dict) for e in files.values()):
        return [(manifest_path, "unreadable: \"files\" must map each file's name to its "
                                "{\"sha256\", \"rows\"}")], None
    problems, records = [], None
    if PACKED not in files:
        problems.append((manifest_path, f"lists no {PACKED}"))
    for name, entry in sorted(files.items()):
        path = root / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            problems.append((path, "deleted"))
            continue
        if sha256_bytes(data) != entry.get("sha256"):
            problems.append((path, "sha256 differs from the recorded one (altered or truncated)"))
            continue
        if name == PACKED:
            rows = csv_rows(gzip.decompress(data))
            if rows != entry.get("rows"):
                problems.append((path, f"{rows} rows, recorded {entry.get('rows')}"))
            else:
                records = data
    return problems, records


def packed_computed_on(root: Path) -> dict[str, int]:
    """The record chunks per hardware (or device) the packed run's ``checksums.json`` keeps
    (empty for a run packed before it kept them)."""
    try:
        return dict(json.loads((root / PACKED_MANIFEST).read_text()).get("computed_on", {}))
    except (FileNotFoundError, ValueError):
        return {}


def packed_compute_time(root: Path) -> dict:
    """The run's compute time as its ``checksums.json`` keeps it
    (:meth:`~robust_attn.runs.store.RunStore.compute_time`; ``{}`` for a run packed before it kept it)."""
    try:
        return dict(json.loads((root / PACKED_MANIFEST).read_text()).get("compute_time", {}))
    except (FileNotFoundError, ValueError):
        return {}


def write_packed_manifest(root: Path, rows: int, computed_on: dict[str, int] | None = None,
                          compute_time: dict | None = None) -> None:
    """``checksums.json`` of the packed run in ``root``: every file's sha256, the records' ``rows``,
    and where given the chunks per hardware and the compute time."""
    files = {}
    for item in sorted(root.iterdir()):
        if item.is_file() and item.name != PACKED_MANIFEST and not item.name.startswith("."):
            files[item.name] = {"sha256": sha256_file(item)}
    files[PACKED]["rows"] = rows
    manifest = {"files": files}
    if computed_on:
        manifest["computed_on"] = computed_on
    if compute_time and compute_time.get("timed"):
        manifest["compute_time"] = compute_time
    atomic_write_json(root / PACKED_MANIFEST, manifest)


def write_packed(source: Path, dest: Path, records: pd.DataFrame, computed_on: dict[str, int],
                 compute_time: dict | None = None) -> None:
    """Pack the finished run in ``source`` (its verified ``records``) into ``dest``: its other
    files copied, the records as one gzip CSV (byte-reproducible: no timestamp in the gzip
    header), then ``checksums.json``, so that a half-rewritten pack never passes as sealed
    (``dest``: another directory than ``source``)."""
    (dest / PACKED_MANIFEST).unlink(missing_ok=True)
    for item in sorted(source.iterdir()):
        if item.is_file() and item.name not in (PACKED, PACKED_MANIFEST) and not item.name.startswith("."):
            with atomic_path(dest / item.name) as tmp:
                tmp.write_bytes(item.read_bytes())
    with atomic_path(dest / PACKED) as tmp:
        tmp.write_bytes(gzip.compress(records.to_csv(index=False).encode(), mtime=0))
    write_packed_manifest(dest, len(records), computed_on, compute_time)
