"""The results store: one directory per run, per-image records, aggregates derived from them.

Layout of a run directory::

    run.json                          what ran (see :func:`describe_run`)
    records/<condition>/<start>-<stop>.csv
                                      per-image records of dataset items [start, stop) under
                                      one condition (e.g. ``cw90`` or ``pgd_eps8_step4_n2``)
    targets.csv                       (PGD) the attack target of every image
    ...                               anything else a protocol saves (e.g. sanity checks)

A finished run can be *packed* (:meth:`RunStore.pack`): the same directory with all records
merged into one ``records.csv.gz`` instead of ``records/``, small enough to commit beside a
report so that the report can be derived again from what was saved. A packed run reads like
the original and cannot be written to.

A chunk file is written atomically (temporary file, fsync, rename), so its existence is the
completion marker: a run killed at any point leaves only whole chunks, and starting the same
command again computes exactly the missing ones. The chunk grid (``start``, ``stop``) depends
only on the batch size, never on the number of processes, so records written by ``torchrun``
ranks, by a single process, or by a mix across restarts are the same files.

Aggregates (accuracies, success rates, drops) are always computed from the records
(:func:`load_records`), never stored on their own.
"""
from __future__ import annotations

import gzip
import json
import platform
import re
import sys
from pathlib import Path

import pandas as pd

from robust_attn.utils.io import atomic_path, atomic_write_json

__all__ = ["RunStore", "RunMismatchError", "load_records", "load_description", "library_versions",
           "VOLATILE_KEYS"]

DESCRIPTION = "run.json"
RECORDS = "records"
PACKED = "records.csv.gz"
# Keys of run.json that may differ between a run and its resumption (where and how it ran,
# not what it computes).
VOLATILE_KEYS = frozenset({"command", "versions", "device", "world_size", "num_workers", "created",
                           "host", "data_root"})
# Entries of run.json's "parameters" that record where an input came from rather than what it is:
# the PGD targets may be drawn from a seed or read from another run's targets.csv; the targets
# themselves are compared by content (the run's targets.csv) when a run is resumed.
PROVENANCE_PARAMETERS = frozenset({"targets"})
_CONDITION_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")
_CHUNK_RE = re.compile(r"^(\d+)-(\d+)\.csv$")


class RunMismatchError(ValueError):
    """The run directory holds a different run from the one being started."""


def library_versions() -> dict[str, str]:
    """Versions of the libraries that can change a result."""
    import numpy
    import torch
    import torchvision

    import robust_attn

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "torchvision": torchvision.__version__, "numpy": numpy.__version__,
                "pandas": pd.__version__, "robust_attn": robust_attn.__version__}
    for name in ("torchattacks", "foolbox"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = getattr(module, "__version__", "unknown")
    return versions


def _jsonable(obj):
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


class RunStore:
    """The directory of one run. ``open`` it with the run's description before writing."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    # --- description -----------------------------------------------------------------------
    @property
    def description_path(self) -> Path:
        return self.root / DESCRIPTION

    def exists(self) -> bool:
        return self.description_path.is_file()

    def description(self) -> dict:
        if not self.exists():
            raise FileNotFoundError(f"{self.root} is not a run directory (no {DESCRIPTION}); "
                                    f"make one with `robust-attn eval rotation|pgd --out {self.root}`")
        return json.loads(self.description_path.read_text())

    def open(self, description: dict, write: bool = True) -> dict:
        """Start or resume the run described by ``description``.

        A new directory gets ``run.json``; an existing one must describe the same run (all keys
        but :data:`VOLATILE_KEYS` equal), otherwise :class:`RunMismatchError` names the keys that
        differ. ``write=False`` (non-main ranks) only checks. Returns the stored description.
        """
        description = _jsonable(description)
        if self.exists():
            stored = self.description()
            keys = (set(stored) | set(description)) - VOLATILE_KEYS
            differ = sorted(k for k in keys if _comparable(k, stored.get(k)) != _comparable(k, description.get(k)))
            if differ:
                detail = "; ".join(f"{k}: stored {stored.get(k)!r}, now {description.get(k)!r}"
                                   for k in differ[:4])
                raise RunMismatchError(
                    f"{self.root} holds a different run ({detail}). Resume it with the same model, "
                    f"data and protocol settings, or pass a new --out directory.")
            return stored
        if write:
            atomic_write_json(self.description_path, description)
        return description

    # --- records -----------------------------------------------------------------------------
    def chunk_path(self, condition: str, start: int, stop: int) -> Path:
        if not _CONDITION_RE.match(condition):
            raise ValueError(f"condition name {condition!r} must be letters, digits and _.+-")
        return self.root / RECORDS / condition / f"{start:09d}-{stop:09d}.csv"

    @property
    def packed(self) -> bool:
        return (self.root / PACKED).is_file()

    def has_chunk(self, condition: str, start: int, stop: int) -> bool:
        return self.packed or self.chunk_path(condition, start, stop).is_file()

    def write_chunk(self, condition: str, start: int, stop: int, records: pd.DataFrame) -> Path:
        """Write the records of items [start, stop) under ``condition``, atomically."""
        if self.packed:
            raise ValueError(f"{self.root} is a packed run (finished, {PACKED}); run into another --out")
        if len(records) != stop - start:
            raise ValueError(f"chunk {condition}[{start}:{stop}) has {len(records)} records, "
                             f"expected {stop - start}")
        path = self.chunk_path(condition, start, stop)
        frame = records.copy()
        frame.insert(0, "condition", condition)
        with atomic_path(path) as tmp:
            frame.to_csv(tmp, index=False)
        return path

    def chunks(self) -> list[tuple[str, int, int]]:
        """Every complete chunk as ``(condition, start, stop)``."""
        found = []
        base = self.root / RECORDS
        if not base.is_dir():
            return found
        for cond_dir in sorted(p for p in base.iterdir() if p.is_dir()):
            for f in sorted(cond_dir.iterdir()):
                m = _CHUNK_RE.match(f.name)
                if m:
                    found.append((cond_dir.name, int(m.group(1)), int(m.group(2))))
        return found

    def records(self) -> pd.DataFrame:
        """All complete chunks merged (from any number of processes), sorted by condition in
        the order of the description's ``conditions`` and then by image index."""
        if self.packed:
            return pd.read_csv(self.root / PACKED)
        frames = [pd.read_csv(self.chunk_path(c, a, b)) for c, a, b in self.chunks()]
        if not frames:
            return pd.DataFrame(columns=["condition", "index"])
        frame = pd.concat(frames, ignore_index=True)
        if frame.duplicated(["condition", "index"]).any():
            raise ValueError(f"{self.root}: overlapping chunks (an image recorded twice under one "
                             f"condition); the run directory was written with different batch sizes")
        order = {c: i for i, c in enumerate(self._condition_names())}
        frame["_order"] = frame["condition"].map(lambda c: order.get(c, len(order)))
        frame = frame.sort_values(["_order", "condition", "index"], kind="stable")
        return frame.drop(columns="_order").reset_index(drop=True)

    def _condition_names(self) -> list[str]:
        if not self.exists():
            return []
        return [c["name"] if isinstance(c, dict) else c for c in self.description().get("conditions", [])]

    def missing(self) -> list[tuple[str, int, int]]:
        """Chunks the description asks for that are not written yet."""
        desc = self.description()
        if self.packed:
            return []
        n, size = desc["num_images"], desc["chunk_size"]
        done = set(self.chunks())
        return [(c, a, min(a + size, n)) for c in self._condition_names() for a in range(0, n, size)
                if (c, a, min(a + size, n)) not in done]


    def pack(self, dest: str | Path) -> "RunStore":
        """Write this finished run to ``dest`` packed: ``run.json`` and the protocol's other
        files copied, the records merged into one gzip CSV (byte-reproducible: no timestamp in
        the gzip header). Returns the packed store."""
        missing = self.missing()
        if missing:
            raise ValueError(f"{self.root} is unfinished ({len(missing)} chunks missing); finish it before packing")
        dest = Path(dest)
        if dest.resolve() == self.root.resolve():
            raise ValueError("pack into another directory than the run itself")
        for item in sorted(self.root.iterdir()):
            if item.is_file() and item.name != PACKED and not item.name.startswith("."):
                with atomic_path(dest / item.name) as tmp:
                    tmp.write_bytes(item.read_bytes())
        with atomic_path(dest / PACKED) as tmp:
            tmp.write_bytes(gzip.compress(self.records().to_csv(index=False).encode(), mtime=0))
        return RunStore(dest)


def _comparable(key: str, value):
    """``value`` of run.json's ``key`` as compared on resumption (provenance entries dropped)."""
    if key == "parameters" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in PROVENANCE_PARAMETERS}
    return value


def load_description(run_dir: str | Path) -> dict:
    return RunStore(run_dir).description()


def load_records(run_dir: str | Path, require_complete: bool = True) -> pd.DataFrame:
    """The merged per-image records of a run; an unfinished run is an error unless
    ``require_complete=False``."""
    store = RunStore(run_dir)
    if require_complete:
        missing = store.missing()
        if missing:
            raise ValueError(f"run {run_dir} is unfinished ({len(missing)} chunks missing, e.g. "
                             f"{missing[0]}); finish it by running its command again: "
                             f"{' '.join(store.description().get('command', []))}")
    return store.records()
