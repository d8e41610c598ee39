"""Adopting runs written before checksums existed (:mod:`robust_attn.runs.store`):
``python -m robust_attn.runs.sealing seal DIR...`` checks that a run's records parse and are complete
and consistent before it trusts them, then writes the checksums it lacks (a packed run's
``checksums.json``, a chunk's manifest entry). Existing checksums are verified, never rewritten.
"""
from __future__ import annotations

import gzip
import io
import sys
from pathlib import Path

import pandas as pd

from robust_attn.runs.packing import PACKED, PACKED_MANIFEST, csv_rows, write_packed_manifest
from robust_attn.runs.store import DamagedRecordsError, RunStore, condition_names, damaged_message
from robust_attn.utils.io import atomic_write_json, sha256_bytes

__all__ = ["seal"]


def seal(store: RunStore) -> list[Path]:
    """Adopt the run of ``store`` (module docstring); returns the checksum files written."""
    desc = store.description()
    if store.packed:
        return _seal_packed(store, desc)
    chunks = store.chunks()
    sealed = [(c, a, b) for c, a, b in chunks if store.checksum_path(store.chunk_path(c, a, b)).is_file()]
    store.check_chunks(sealed)  # the checksums already there are verified first; damage raises
    written = []
    for c, a, b in chunks:
        path = store.chunk_path(c, a, b)
        side = store.checksum_path(path)
        if (c, a, b) in sealed:
            continue
        data = path.read_bytes()
        try:
            frame = pd.read_csv(io.BytesIO(data))
        except ValueError as err:
            raise DamagedRecordsError(f"cannot seal {path}: {err}; delete it and run the command again",
                                      [(path, str(err))]) from None
        ok = (len(frame) == b - a == csv_rows(data) and {"index", "condition"} <= set(frame)
              and sorted(frame["index"].tolist()) == list(range(a, b)) and (frame["condition"] == c).all())
        if not ok:
            raise DamagedRecordsError(f"cannot seal {path}: its rows are not the images [{a}, {b}) of {c}; "
                                      f"delete it and run the command again", [(path, "incomplete")])
        atomic_write_json(side, {"rows": len(frame), "sha256": sha256_bytes(data)})
        written.append(side)
    return written


def _seal_packed(store: RunStore, desc: dict) -> list[Path]:
    manifest = store.root / PACKED_MANIFEST
    if manifest.is_file():
        store.repair()  # verifies; raises on damage
        return []
    try:
        frame = pd.read_csv(store.root / PACKED)
    except (OSError, EOFError, ValueError) as err:
        raise DamagedRecordsError(f"cannot seal {store.root}: {PACKED} does not read ({err}); restore it "
                                  f"or pack it again", [(store.root / PACKED, str(err))]) from None
    _check_complete(frame, desc, store.root / PACKED)
    rows = csv_rows(gzip.decompress((store.root / PACKED).read_bytes()))
    if rows < 0:
        raise DamagedRecordsError(f"cannot seal {store.root}: {PACKED}'s last line is cut ({len(frame)} "
                                  f"records parse); restore it or pack it again")
    if rows != len(frame):
        raise DamagedRecordsError(f"cannot seal {store.root}: {PACKED} has {rows} lines but {len(frame)} "
                                  f"records; restore it or pack it again")
    write_packed_manifest(store.root, rows)
    return [manifest]


def _check_complete(frame: pd.DataFrame, desc: dict, path: Path) -> None:
    """Every (condition, image) of the description once, no NaN index."""
    names = condition_names(desc)
    n = int(desc.get("num_images", 0))
    want = {(c, i) for c in names for i in range(n)}
    have = list(zip(frame["condition"], frame["index"])) if {"condition", "index"} <= set(frame) else []
    if len(have) != len(set(have)) or set(have) != want:
        raise DamagedRecordsError(f"cannot seal {path}: it does not hold each of the {len(names)} conditions x "
                                  f"{n} images once ({len(have)} records); restore it or pack it again",
                                  [(path, "incomplete")])


def main(argv: list[str] | None = None) -> int:
    """``python -m robust_attn.runs.sealing verify|seal|repair RUN_DIR...``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m robust_attn.runs.sealing",
                                     description="check, adopt (seal) or repair stored runs")
    parser.add_argument("action", choices=["verify", "seal", "repair"])
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args(argv)
    status = 0
    for run in args.runs:
        store = RunStore(run)
        try:
            if args.action == "seal":
                done = seal(store)
                print(f"{run}: sealed ({len(done)} checksum file(s) written)")
            elif args.action == "repair":
                done = store.repair()
                print(f"{run}: {len(done)} damaged chunk(s) deleted; run its command again to recompute them")
            else:
                problems = store.verify()
                if problems:
                    raise DamagedRecordsError(damaged_message(store.root, problems, store.packed), problems)
                print(f"{run}: intact")
        except (ValueError, FileNotFoundError) as err:
            print(f"{run}: error: {err}", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
