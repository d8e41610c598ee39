"""Where a corruption protocol gets its corrupted images: made on the fly, or read from a
corrupted copy of the test set made once per study and checksummed.

Every model of a study sees the same corrupted images (the corruptions are seeded per image,
:mod:`robust_attn.shifts.corruptions`), so a study makes them once: :class:`CorruptionCache`
keeps one uint8 file per (corruption, severity), ``<name>-s<severity>.npy`` of shape
(N, H, W, 3), beside its manifest entry ``<file>.sha256`` (sha256 and shape), in a folder keyed by
the dataset (name, split, limit) and the seed. The folder's ``meta.json`` records the image
count and shape and a sha256 of the clean images, checked whenever files are added to it.

Concurrency: several processes (study workers, torchrun ranks) may fill one cache. Each file is
made under an exclusive ``flock`` on ``.<file>.lock``: a process takes up to
``pairs_per_pass`` locks it can get without waiting, makes those files in one pass over the
dataset, and repeats; then it waits for the files others are making (a lock dies with its process, so a killed maker's file is made again by the
next process). A file is written to a temporary name and renamed after its manifest entry, so
it exists only whole. Every file is checked against its manifest entry once per process before
it is read; a damaged file is an error naming it (``repair=True``: made again).

:class:`OnTheFly` makes the same images per chunk instead (``robust-attn eval corruption``
without ``--cache``); both are bit-identical, so a run may be resumed with either.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from robust_attn.shifts.corruptions import check_corruption, check_severity, corrupt_batch
from robust_attn.utils.io import atomic_write_json, sha256_file

__all__ = ["to_uint8", "to_float", "OnTheFly", "CorruptionCache", "cache_folder"]


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """Float (N, 3, H, W) in [0, 1] -> uint8 (N, H, W, 3), rounded (exact for images read from
    8-bit files)."""
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"corruptions take RGB images (N, 3, H, W), got shape {tuple(images.shape)}")
    return (images.detach().cpu().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def to_float(images: np.ndarray, device=None) -> torch.Tensor:
    """uint8 (N, H, W, 3) -> float (N, 3, H, W) in [0, 1]."""
    return torch.from_numpy(np.ascontiguousarray(images)).to(device).permute(0, 3, 1, 2).float().div_(255)


class OnTheFly:
    """Corrupt each chunk as it is evaluated."""

    def __init__(self, seed: int = 0):
        self.seed = int(seed)

    def __call__(self, name: str, severity: int, images: torch.Tensor, indices: torch.Tensor) -> np.ndarray:
        return corrupt_batch(to_uint8(images), name, severity, indices=indices.tolist(), seed=self.seed)


def cache_folder(root, dataset_key: dict, seed: int) -> Path:
    """``root/<name>-<split>-<limit or all>-seed<seed>``, plus ``-pp<hash>`` when the images went
    through a model's own preprocessing (``dataset_key["preprocessing"]``): models of one study
    that resize or crop differently see different clean images, so they get different caches."""
    limit = dataset_key.get("limit")
    name = f"{dataset_key['name']}-{dataset_key.get('split', 'test')}-{limit or 'all'}-seed{seed}"
    if dataset_key.get("preprocessing"):
        text = json.dumps(dataset_key["preprocessing"], sort_keys=True)
        name += f"-pp{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    return Path(root) / name


@contextlib.contextmanager
def _try_lock(path: Path, block: bool):
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "w")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        handle.close()   # releases the lock


class CorruptionCache:
    """The corrupted copies of ``dataset`` (items: float (3, H, W) in [0, 1], label) for one seed,
    in ``cache_folder(root, dataset_key, seed)``."""

    #: (corruption, severity) files one process makes per pass over the dataset
    pairs_per_pass = 8

    def __init__(self, root, dataset, dataset_key: dict, seed: int = 0, batch_size: int = 250):
        self.dataset, self.seed, self.batch_size = dataset, int(seed), int(batch_size)
        self.key = {k: dataset_key.get(k) for k in ("name", "split", "limit", "preprocessing")}
        self.root = cache_folder(root, self.key, self.seed)
        self._verified: set[Path] = set()
        self._open: dict[Path, np.ndarray] = {}

    def path(self, name: str, severity: int) -> Path:
        return self.root / f"{check_corruption(name)}-s{check_severity(severity)}.npy"

    @staticmethod
    def manifest(path: Path) -> Path:
        return path.with_name(path.name + ".sha256")

    def _meta(self) -> dict:
        return {**self.key, "seed": self.seed, "num_images": len(self.dataset)}

    def _check_meta(self, fingerprint: str | None = None, shape=None) -> None:
        meta_path = self.root / "meta.json"
        if not meta_path.is_file():
            if fingerprint is not None:
                atomic_write_json(meta_path, {**self._meta(), "image_shape": list(shape), "clean_sha256": fingerprint})
            return
        stored = json.loads(meta_path.read_text())
        expected = {**self._meta(), **({"clean_sha256": fingerprint} if fingerprint else {})}
        differ = [k for k, v in expected.items() if stored.get(k) != v]
        if differ:
            raise ValueError(f"the corrupted-image cache {self.root} was made from other images ({', '.join(differ)} "
                             f"differ: stored {[stored.get(k) for k in differ]}, now {[expected[k] for k in differ]}); "
                             f"delete it or use another runs folder")

    def missing(self, pairs: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
        return [(n, s) for n, s in pairs if not self.path(n, s).is_file()]

    def ensure(self, pairs: Sequence[tuple[str, int]], repair: bool = False, log=None) -> None:
        """Make every (corruption, severity) of ``pairs`` not in the cache yet, sharing the work
        with other processes; then check every file against its manifest entry."""
        pairs = list(dict.fromkeys((check_corruption(n), check_severity(s)) for n, s in pairs))
        self._check_meta()
        while True:
            todo = self.missing(pairs)
            if not todo:
                break
            with contextlib.ExitStack() as stack:
                mine = []
                for pair in todo:   # a few per pass, so that other processes take the rest meanwhile
                    if len(mine) < self.pairs_per_pass and stack.enter_context(_try_lock(self._lock(*pair), False)) \
                            and not self.path(*pair).is_file():
                        mine.append(pair)
                if mine:
                    if log:
                        log(f"corruptions: making {len(mine)} corrupted copies of {len(self.dataset)} images in {self.root}")
                    self._make(mine)
                    continue
            with _try_lock(self._lock(*todo[0]), block=True):   # another process makes it: wait for it
                pass
        for pair in pairs:
            self._verify(self.path(*pair), repair)

    def _lock(self, name: str, severity: int) -> Path:
        path = self.path(name, severity)
        return path.with_name(f".{path.name}.lock")

    def _make(self, pairs: list[tuple[str, int]]) -> None:
        n = len(self.dataset)
        loader = DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False)
        outputs, temps = {}, {}
        digest, label_digest = hashlib.sha256(), hashlib.sha256()   # apart, so the batch size does not matter
        shape = None
        start = 0
        try:
            for images, labels in loader:
                clean = to_uint8(images)
                digest.update(clean.tobytes())
                label_digest.update(np.asarray(labels, dtype=np.int64).tobytes())
                if shape is None:
                    shape = clean.shape[1:]
                    for pair in pairs:
                        temps[pair] = self.path(*pair).with_name(f".{self.path(*pair).name}.{os.getpid()}.tmp")
                        outputs[pair] = np.lib.format.open_memmap(temps[pair], mode="w+", dtype=np.uint8,
                                                                  shape=(n, *shape))
                stop = start + len(clean)
                indices = list(range(start, stop))
                for (name, severity), out in outputs.items():
                    out[start:stop] = corrupt_batch(clean, name, severity, indices=indices, seed=self.seed)
                start = stop
            self._check_meta(hashlib.sha256((digest.hexdigest() + label_digest.hexdigest()).encode()).hexdigest(), shape)
            for pair, out in outputs.items():
                out.flush()
                del out
                path = self.path(*pair)
                atomic_write_json(self.manifest(path), {"sha256": sha256_file(temps[pair]), "shape": [n, *shape]})
                os.replace(temps[pair], path)
        finally:
            outputs.clear()
            for tmp in temps.values():
                if tmp.exists():
                    tmp.unlink()

    def _verify(self, path: Path, repair: bool = False) -> None:
        if path in self._verified:
            return
        manifest = self.manifest(path)
        problem = None
        if not manifest.is_file():
            problem = "its manifest entry is missing"
        else:
            entry = json.loads(manifest.read_text())
            if sha256_file(path) != entry["sha256"]:
                problem = "its sha256 differs from its manifest entry"
            elif list(np.load(path, mmap_mode="r").shape) != entry["shape"]:
                problem = "its shape differs from its manifest entry"
        if problem:
            if repair:
                path.unlink()
                name, _, severity = path.stem.rpartition("-s")
                self.ensure([(name, int(severity))])
                return
            raise ValueError(f"corrupted-image cache file {path} is damaged ({problem}); delete it (or pass --repair) "
                             f"and run again to make it anew")
        self._verified.add(path)

    def __call__(self, name: str, severity: int, images: torch.Tensor, indices: torch.Tensor) -> np.ndarray:
        path = self.path(name, severity)
        if path not in self._open:
            if not path.is_file():
                self.ensure([(name, severity)])
            self._verify(path)
            self._open[path] = np.load(path, mmap_mode="r")
        return np.asarray(self._open[path][indices.numpy()])
