"""The results store: one directory per run, per-image records, aggregates derived from them.

Layout of a run directory::

    run.json                          what ran (see :func:`describe_run`)
    records/<condition>/<start>-<stop>.csv
                                      per-image records of dataset items [start, stop) under
                                      one condition (e.g. ``cw90`` or ``pgd_eps8_step4_n2``)
    manifest/<condition>/<start>-<stop>.csv.sha256
                                      the chunk's manifest entry: ``{"sha256": ..., "rows": ...}``
    claims/<condition>/<start>-<stop>.csv.claim.<n>
                                      while a process computes the chunk: who (pid, host, time)
    targets.csv                       (PGD) the attack target of every image
    ...                               anything else a protocol saves (e.g. sanity checks)

A finished run can be *packed* (:meth:`RunStore.pack`, :mod:`robust_attn.runs.packing`): the same
directory with all records merged into one ``records.csv.gz`` instead of ``records/``, and a
``checksums.json``, small enough to commit beside a report so that the report can be derived
again, verified end to end, from what was saved. A packed run reads like the original and cannot
be written to.

A chunk file is written atomically (temporary file, fsync, rename), so its existence is the
completion marker: a run killed at any point leaves only whole chunks, and starting the same
command again computes exactly the missing ones. The chunk grid (``start``, ``stop``) depends
only on the batch size, never on the number of processes, so records written by ``torchrun``
ranks, by a single process, or by a mix across restarts are the same files.

Integrity. The manifest of a chunked run is one small sidecar per chunk
(``manifest/<condition>/<chunk>.sha256``), not one shared file: several processes write chunks of one run at once
(``torchrun`` ranks, or the same command started twice on purpose), and a shared manifest would
need a read-modify-write under a lock, where a writer killed while holding it, or two writers
racing, lose entries. A sidecar is written by the chunk's only writer (see claims below),
atomically, *before* the atomic rename of the chunk; so every chunk file that exists has its
entry, a kill between the two leaves an entry without a chunk (the chunk is simply missing and
is computed again, rewriting the entry), and no state has a chunk with a stale entry. Reading
records (:meth:`RunStore.records`, :func:`load_records`) checks every chunk against its entry
(sha256 of the bytes and the row count) and raises :class:`DamagedRecordsError` naming the
files and the fix: ``--repair`` (:meth:`RunStore.repair` deletes the damaged chunks so that the
command computes them again) or restoring the files. A deleted chunk is a missing chunk (the
run is unfinished; running the command again computes it). A report therefore never computes
from damaged records. Runs written before checksums existed are adopted with :func:`robust_attn.runs.sealing.seal`
(``python -m robust_attn.runs.sealing seal DIR...``; :mod:`robust_attn.runs.sealing`), which checks that the
records parse and are complete before it trusts them.

Where each chunk was computed. ``run.json`` keeps the description of the run's first start, so
its ``device`` says where that start ran; a run resumed elsewhere (started on a GPU, finished on
a CPU, where float rounding can flip a prediction) is more than that. So each chunk's manifest
entry also names the type of device of the process that wrote it (``"device"``: ``cpu``, ``cuda``; an AutoAttack chunk
resumed from its saved state may have run its first members on another) and the hardware
(``"hardware"``: the CPU's kernel level, fingerprint and threads, or the GPU's name; float rounding
differs between machines, :mod:`robust_attn.utils.hardware`), and a packed run's
``checksums.json`` keeps the count per hardware (``"computed_on"``): :meth:`RunStore.computed_on`,
shown in the report's model table. Chunks written before this existed count as ``"not recorded"``.
The entry also keeps the wall seconds its process spent on the chunk (``"seconds"``: from the
previous chunk it wrote, or from the start of its pass, to this one's write, loading included), so
what a run cost is summed from its chunks, :meth:`RunStore.compute_time`, however often it was
killed and resumed (the chunk under way at a kill is lost with its time; an attack resumed from its
saved state counts the resumed part).

Claims (concurrency): several processes share one run's chunks by claiming each before
computing it (:mod:`robust_attn.runs.claims`).

Layout versions: ``run.json`` says the version of the layout it was written in (``schema``);
a run of an earlier version reads in the current one (:mod:`robust_attn.runs.migrations`).

Aggregates (accuracies, success rates, drops) are always computed from the records
(:func:`load_records`), never stored on their own.
"""
from __future__ import annotations

import io
import json
import platform
import re
import sys
from collections import Counter
from pathlib import Path

import pandas as pd

from robust_attn.runs.claims import Claim, claim_chunk
from robust_attn.runs.identity import VOLATILE_KEYS, why_not_resumable
from robust_attn.runs.migrations import (SCHEMA_KEY, SCHEMA_VERSION,
                                         current_description, current_records, schema_version, to_stored_layout)
from robust_attn.runs.packing import (PACKED, csv_rows, is_packed, packed_compute_time, packed_computed_on,
                                      verify_packed, write_packed)
from robust_attn.utils.hardware import hardware_label
from robust_attn.utils.io import atomic_path, atomic_write_json, sha256_bytes

__all__ = ["RunStore", "RunMismatchError", "DamagedRecordsError", "Claim", "load_records", "load_description",
           "library_versions", "VOLATILE_KEYS"]

DESCRIPTION = "run.json"
RECORDS = "records"
CHECKSUM_SUFFIX = ".sha256"
MANIFEST = "manifest"
_CONDITION_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")
_CHUNK_RE = re.compile(r"^(\d+)-(\d+)\.csv$")
_SHOWN = 5  # damaged files named in one error message


class RunMismatchError(ValueError):
    """The run directory holds a different run from the one being started."""


class DamagedRecordsError(ValueError):
    """Stored records do not match their checksums (altered, truncated, or never checksummed).
    ``problems`` lists ``(path, what is wrong)``."""

    def __init__(self, message: str, problems: list[tuple[Path, str]] | None = None):
        super().__init__(message)
        self.problems = list(problems or [])


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


def damaged_message(root: Path, problems: list[tuple[Path, str]], packed: bool) -> str:
    """What is damaged in the run at ``root`` (the first few files) and how to fix it."""
    shown = "; ".join(f"{p}: {why}" for p, why in problems[:_SHOWN])
    more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
    if packed:
        fix = (f"restore the packed run's files (e.g. `git checkout -- {root}`), or pack it again from the "
               f"original run directory (RunStore(RUN).pack(DEST))")
    else:
        fix = ("run the same `robust-attn eval ...` command again with --repair (it recomputes only the damaged "
               "chunks), or restore the files from a copy")
    return f"run {root} has damaged records: {shown}{more}. Fix: {fix}."


class RunStore:
    """The directory of one run. ``open`` it with the run's description before writing."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.device: str | None = None   # where this process computes (open's description); in each chunk's entry
        self._stored: dict | None = None   # run.json as open found or wrote it: the layout of the chunks written

    # --- description -----------------------------------------------------------------------
    @property
    def description_path(self) -> Path:
        return self.root / DESCRIPTION

    def exists(self) -> bool:
        return self.description_path.is_file()

    def description(self) -> dict:
        """The run's description in the current layout (:mod:`robust_attn.runs.migrations`: a run
        of an earlier schema version converted as it is read; :meth:`stored_description`: as stored)."""
        stored = self.stored_description()
        _schema_version(stored)   # a damaged version number: DamagedRecordsError
        return current_description(stored)

    def stored_description(self) -> dict:
        """``run.json`` as stored (the layout of its schema version)."""
        if not self.exists():
            raise FileNotFoundError(f"{self.root} is not a run directory (no {DESCRIPTION}); "
                                    f"make one with `robust-attn eval rotation|pgd --out {self.root}`")
        try:
            description = json.loads(self.description_path.read_text())
        except ValueError as err:   # JSONDecodeError, UnicodeDecodeError
            raise DamagedRecordsError(f"{self.description_path} is damaged ({err}); restore it from a copy "
                                      f"(a committed run: `git checkout -- {self.description_path}`) or run "
                                      f"its command again into a new folder",
                                      [(self.description_path, "unreadable")]) from None
        if not isinstance(description, dict):
            raise DamagedRecordsError(f"{self.description_path} holds a JSON {type(description).__name__}, not a "
                                      f"run description (an object); restore it from a copy",
                                      [(self.description_path, "not an object")])
        return description

    def open(self, description: dict, write: bool = True) -> dict:
        """Start or resume the run described by ``description``.

        A new directory gets ``run.json``; an existing one must describe the same run
        (:func:`robust_attn.runs.identity.why_not_resumable`), otherwise :class:`RunMismatchError`
        names the keys that differ. ``write=False`` (non-main ranks) only checks. Returns the
        stored description (as stored); the chunks this store writes follow its layout
        (:func:`robust_attn.runs.migrations.to_stored_layout`).
        """
        description = _jsonable(description)
        if description.get("device") is not None:   # its type: "cuda:0" and "cuda" count as one
            self.device = str(description["device"]).split(":")[0]
        if self.exists():
            stored = self.stored_description()
            detail = why_not_resumable(stored, _schema_version(stored), description)
            if detail:
                raise RunMismatchError(
                    f"{self.root} holds a different run ({detail}). Resume it with the same model, "
                    f"data and protocol settings, or pass a new --out directory.")
            self._stored = stored
            return stored
        description = {SCHEMA_KEY: SCHEMA_VERSION, **description}
        if write:
            atomic_write_json(self.description_path, description)
        self._stored = description
        return description

    # --- records -----------------------------------------------------------------------------
    def chunk_path(self, condition: str, start: int, stop: int) -> Path:
        if not _CONDITION_RE.match(condition):
            raise ValueError(f"condition name {condition!r} must be letters, digits and _.+-")
        return self.root / RECORDS / condition / f"{start:09d}-{stop:09d}.csv"

    @staticmethod
    def checksum_path(chunk: Path) -> Path:
        """The manifest entry (sha256 and rows) of a chunk file ``<run>/records/<cond>/<chunk>``:
        ``<run>/manifest/<cond>/<chunk>.sha256`` (outside ``records/``, whose condition folders
        hold chunk files only)."""
        return chunk.parents[2] / MANIFEST / chunk.parent.name / (chunk.name + CHECKSUM_SUFFIX)

    @property
    def packed(self) -> bool:
        return is_packed(self.root)

    def has_chunk(self, condition: str, start: int, stop: int) -> bool:
        return self.packed or self.chunk_path(condition, start, stop).is_file()

    def claim(self, condition: str, start: int, stop: int, timeout: float | None = None) -> Claim | None:
        """Claim (condition, chunk) before computing it; None: written already or a live process
        computes it."""
        if self.packed:
            return None
        return claim_chunk(self.chunk_path(condition, start, stop), timeout)

    def write_chunk(self, condition: str, start: int, stop: int, records: pd.DataFrame,
                    seconds: float | None = None) -> Path:
        """Write the records of items [start, stop) under ``condition``, atomically, after their
        manifest entry (sha256, row count and, given, the ``seconds`` spent on it)."""
        if self.packed:
            raise ValueError(f"{self.root} is a packed run (finished, {PACKED}); run into another --out")
        if len(records) != stop - start:
            raise ValueError(f"chunk {condition}[{start}:{stop}) has {len(records)} records, "
                             f"expected {stop - start}")
        path = self.chunk_path(condition, start, stop)
        frame = records.copy() if self._stored is None else to_stored_layout(self._stored, records).copy()
        frame.insert(0, "condition", condition)
        data = frame.to_csv(index=False, lineterminator="\n").encode()
        entry = {"rows": len(frame), "sha256": sha256_bytes(data)}
        if self.device is not None:
            entry["device"] = self.device
            entry["hardware"] = hardware_label(self.device)
        if seconds is not None:
            entry["seconds"] = round(float(seconds), 3)
        atomic_write_json(self.checksum_path(path), entry)
        with atomic_path(path) as tmp:
            tmp.write_bytes(data)
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

    def _read_chunk(self, condition: str, start: int, stop: int) -> tuple[bytes | None, str | None]:
        """The chunk's bytes and what is wrong with them (None: intact)."""
        path = self.chunk_path(condition, start, stop)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None, "deleted"
        try:
            entry = json.loads(self.checksum_path(path).read_text())
        except FileNotFoundError:
            return data, (f"no checksum ({self.checksum_path(path).name} missing: written before checksums "
                          f"existed, or deleted; `python -m robust_attn.runs.sealing seal {self.root}` adopts "
                          f"intact old chunks)")
        except ValueError:
            return data, f"unreadable checksum file {self.checksum_path(path).name}"
        if not isinstance(entry, dict):
            return data, (f"checksum file {self.checksum_path(path).name} holds a JSON "
                          f"{type(entry).__name__}, not an object")
        if sha256_bytes(data) != entry.get("sha256"):
            rows, recorded = csv_rows(data), entry.get("rows")
            how = "truncated" if rows < 0 or (isinstance(recorded, int) and rows < recorded) else "altered"
            shown = "a cut line" if rows < 0 else f"{rows} rows"
            return data, f"sha256 differs from the recorded one ({how}: {shown}, recorded {recorded} rows)"
        if entry.get("rows") != stop - start:
            return data, f"the checksum file records {entry.get('rows')!r} rows, expected {stop - start}"
        if csv_rows(data) != stop - start:
            return data, f"{csv_rows(data)} rows, expected {stop - start}"
        return data, None

    def verify(self) -> list[tuple[Path, str]]:
        """Every damaged file of the run as ``(path, what is wrong)``; empty when intact."""
        if self.packed:
            return self._verify_packed()[0]
        problems = []
        for c, a, b in self.chunks():
            _, problem = self._read_chunk(c, a, b)
            if problem:
                problems.append((self.chunk_path(c, a, b), problem))
        return problems

    def check_chunks(self, chunks, repair: bool = False) -> list[Path]:
        """Verify the written chunks among ``chunks`` ((condition, start, stop) triples); a damaged
        one raises :class:`DamagedRecordsError`, or with ``repair`` is deleted (it is missing then
        and gets computed again). Returns the deleted files."""
        if self.packed:
            return []
        problems = []
        for c, a, b in chunks:
            path = self.chunk_path(c, a, b)
            if path.is_file():
                _, problem = self._read_chunk(c, a, b)
                if problem and problem != "deleted":
                    problems.append((path, problem))
        if problems and not repair:
            raise DamagedRecordsError(damaged_message(self.root, problems, packed=False), problems)
        for path, _ in problems:
            path.unlink(missing_ok=True)
            self.checksum_path(path).unlink(missing_ok=True)
        return [p for p, _ in problems]

    def repair(self) -> list[Path]:
        """Delete every damaged chunk (and its manifest entry) so that the run's command computes
        it again; returns the deleted chunk files. A packed run cannot be recomputed: damage is a
        :class:`DamagedRecordsError` naming the files to restore."""
        if self.packed:
            problems = self.verify()
            if problems:
                raise DamagedRecordsError(damaged_message(self.root, problems, packed=True), problems)
            return []
        return self.check_chunks(self.chunks(), repair=True)

    def records(self) -> pd.DataFrame:
        """All complete chunks merged (from any number of processes), sorted by condition in
        the order of the description's ``conditions`` and then by image index, in the current
        layout (a run of an earlier schema version converted as it is read,
        :mod:`robust_attn.runs.migrations`). Every chunk (or the packed file) is checked against
        its checksum first: :class:`DamagedRecordsError`."""
        records = self.stored_records()
        if not self.exists():
            return records
        stored = self.stored_description()
        _schema_version(stored)
        return current_records(stored, records)

    def stored_records(self) -> pd.DataFrame:
        """:meth:`records` in the layout of the run's schema version, as stored."""
        if self.packed:
            problems, data = self._verify_packed()
            if problems:
                raise DamagedRecordsError(damaged_message(self.root, problems, packed=True), problems)
            return pd.read_csv(io.BytesIO(data), compression="gzip")
        frames, problems = [], []
        for c, a, b in self.chunks():
            data, problem = self._read_chunk(c, a, b)
            if problem == "deleted":  # deleted between listing and reading: missing, not damaged
                continue
            if problem:
                problems.append((self.chunk_path(c, a, b), problem))
            elif not problems:
                frames.append(pd.read_csv(io.BytesIO(data)))
        if problems:
            raise DamagedRecordsError(damaged_message(self.root, problems, packed=False), problems)
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

    def finished_records(self, missing=None) -> tuple[pd.DataFrame, tuple[str, ...]]:
        """The records of the conditions whose every chunk is written (each over all of its
        images), and the names of the others, in order; ``missing``: :meth:`missing` if the
        caller has it already. Checksums are verified as in :meth:`records`."""
        missing = self.missing() if missing is None else missing
        unfinished = tuple(dict.fromkeys(c for c, _, _ in missing))
        records = self.records()
        return records[~records["condition"].isin(unfinished)].reset_index(drop=True), unfinished

    def _condition_names(self) -> list[str]:
        return condition_names(self.description()) if self.exists() else []

    def missing(self) -> list[tuple[str, int, int]]:
        """Chunks the description asks for that are not written yet."""
        desc = self.description()
        if self.packed:
            return []
        n, size = desc["num_images"], desc["chunk_size"]
        done = set(self.chunks())
        return [(c, a, min(a + size, n)) for c in self._condition_names() for a in range(0, n, size)
                if (c, a, min(a + size, n)) not in done]

    # --- packed runs (robust_attn.runs.packing) ------------------------------------------------------
    def _verify_packed(self) -> tuple[list[tuple[Path, str]], bytes | None]:
        """Problems of a packed run against its ``checksums.json``, and the verified records bytes."""
        return verify_packed(self.root, f"python -m robust_attn.runs.sealing seal {self.root}")

    def computed_on(self) -> dict[str, int]:
        """How many record chunks each device computed (module docstring), by the hardware the
        entry names (:func:`robust_attn.utils.hardware.hardware_label`, e.g. ``{"cpu AVX512
        96ccc860eb 1 thread": 4, "cuda NVIDIA H200": 1}``), else by its device type (entries
        written before they named the hardware: ``{"cpu": 4}``); chunks whose entry names neither
        count as ``"not recorded"``. A packed run answers from its ``checksums.json`` (empty for a
        run packed before this existed)."""
        if self.packed:
            return packed_computed_on(self.root)
        counts = Counter(str(entry.get("hardware") or entry.get("device") or "not recorded")
                         for entry in self.manifest_entries().values())
        return dict(sorted(counts.items()))

    def compute_time(self) -> dict:
        """``{"seconds", "timed", "chunks"}``: the wall seconds the run's chunks recorded (module
        docstring), summed over the ``timed`` of its ``chunks`` written that recorded them. A packed
        run answers from its ``checksums.json`` (``{}`` for a run packed before it kept them)."""
        if self.packed:
            return packed_compute_time(self.root)
        times = [e["seconds"] for e in self.manifest_entries().values() if isinstance(e.get("seconds"), (int, float))]
        return {"seconds": round(float(sum(times)), 3), "timed": len(times), "chunks": len(self.chunks())}

    def manifest_entries(self) -> dict[tuple[str, int, int], dict]:
        """Each record chunk's manifest entry (module docstring), by ``(condition, start, stop)``;
        ``{}`` for a chunk whose entry is missing or unreadable (:meth:`verify` reports those)."""
        entries = {}
        for c, a, b in self.chunks():
            try:
                entry = json.loads(self.checksum_path(self.chunk_path(c, a, b)).read_text())
            except (FileNotFoundError, ValueError):
                entry = {}
            entries[(c, a, b)] = entry if isinstance(entry, dict) else {}
        return entries

    def pack(self, dest: str | Path) -> "RunStore":
        """Write this finished run to ``dest`` packed (:func:`robust_attn.runs.packing.write_packed`:
        its other files copied, the records merged into one gzip CSV, then ``checksums.json``).
        Returns the packed store."""
        missing = self.missing()
        if missing:
            raise ValueError(f"{self.root} is unfinished ({len(missing)} chunks missing); finish it before packing")
        dest = Path(dest)
        if dest.resolve() == self.root.resolve():
            raise ValueError("pack into another directory than the run itself")
        # the records verified, as stored
        write_packed(self.root, dest, self.stored_records(), self.computed_on(), self.compute_time())
        return RunStore(dest)



def condition_names(description: dict) -> list[str]:
    """The names of a run description's conditions, in order."""
    return [c["name"] if isinstance(c, dict) else c for c in description.get("conditions", [])]


def condition_definitions(description: dict) -> dict[str, dict]:
    """Each named condition of a run description, by name (its attack, eps, seed, ...)."""
    return {c["name"]: c for c in description.get("conditions", []) if isinstance(c, dict) and "name" in c}


def _schema_version(description: dict) -> int:
    """:func:`robust_attn.runs.migrations.schema_version`; a ``schema`` that is no version number is
    damage (:class:`DamagedRecordsError`)."""
    try:
        return schema_version(description)
    except ValueError as err:
        raise DamagedRecordsError(f"{err}; restore run.json from a copy", []) from None


def load_description(run_dir: str | Path) -> dict:
    return RunStore(run_dir).description()


def load_records(run_dir: str | Path, require_complete: bool = True) -> pd.DataFrame:
    """The merged per-image records of a run, verified against their checksums
    (:class:`DamagedRecordsError`); an unfinished run is an error unless
    ``require_complete=False``."""
    store = RunStore(run_dir)
    if require_complete:
        missing = store.missing()
        if missing:
            c, a, b = missing[0]
            raise ValueError(f"run {run_dir} is unfinished ({len(missing)} chunks missing, e.g. "
                             f"{store.chunk_path(c, a, b)}); finish it by running its command again (it computes "
                             f"only the missing chunks) or restore the files: "
                             f"{' '.join(store.description().get('command', []))}")
    return store.records()
