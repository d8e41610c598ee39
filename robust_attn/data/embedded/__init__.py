"""Test sets shipped inside the package, so the zoo can be evaluated after a plain install.

* ``cifar10_jpeg_test.npz``: the 10,000 CIFAR-10 test images of the quality-75 JPEG copy
  (``test/<class>/NNNN.jpg`` in sorted path order), the files' bytes unchanged: arrays ``data``
  (uint8, the files concatenated), ``offsets`` (int64, N + 1) and ``labels`` (uint8). Made with
  :func:`pack_jpeg_folder` from that folder.
* ``fashion_mnist_test/``: Fashion-MNIST's two gzipped test IDX files as Debian's
  ``dataset-fashion-mnist`` ships them.

``SHA256SUMS`` lists every file's digest; :func:`path` checks it before a file is used, so a
damaged copy is an error naming the file, never silently different data.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

import numpy as np

__all__ = ["HERE", "path", "read_jpeg_set", "pack_jpeg_folder", "checksums"]

HERE = Path(__file__).resolve().parent


def checksums() -> dict[str, str]:
    """``{relative path: sha256}`` from ``SHA256SUMS`` (``sha256sum`` format)."""
    sums = {}
    for line in (HERE / "SHA256SUMS").read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            sums[name.strip().lstrip("*")] = digest
    return sums


@lru_cache(maxsize=None)
def _verified(relative: str) -> Path:
    sums = checksums()
    target = HERE / relative
    members = [name for name in sums if name == relative or name.startswith(relative + "/")]
    if not members:
        raise FileNotFoundError(f"no embedded data named {relative!r}; have {sorted(sums)}")
    for name in members:
        file = HERE / name
        if not file.is_file():
            raise FileNotFoundError(f"embedded data file {file} is missing: reinstall robust-attn "
                                    f"(pip install --force-reinstall) or restore it from the repository")
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        if digest != sums[name]:
            raise ValueError(f"embedded data file {file} has sha256 {digest[:12]}..., expected {sums[name][:12]}...: "
                             f"it is damaged; reinstall robust-attn or restore it from the repository")
    return target


def path(name: str) -> Path:
    """The verified path of embedded data ``name`` (a file stem like ``cifar10_jpeg_test`` or a folder)."""
    sums = checksums()
    for candidate in (name, name + ".npz"):
        if any(n == candidate or n.startswith(candidate + "/") for n in sums):
            return _verified(candidate)  # listed in SHA256SUMS: a missing file is an error, not "unknown"
    return _verified(name)


def read_jpeg_set(name: str) -> tuple[list[bytes], "torch.Tensor"]:  # noqa: F821
    """The JPEG byte strings and int64 labels of a packed set."""
    import torch

    with np.load(path(name), allow_pickle=False) as packed:
        data, offsets, labels = packed["data"], packed["offsets"], packed["labels"]
    blobs = [data[offsets[i]:offsets[i + 1]].tobytes() for i in range(len(offsets) - 1)]
    return blobs, torch.from_numpy(labels.astype(np.int64))


def pack_jpeg_folder(folder: str | Path, out: str | Path, classes: tuple[str, ...]) -> str:
    """Pack ``folder/<class>/*`` (``classes`` in label order, files in sorted order) into ``out``
    (.npz, no pickles); returns its sha256."""
    folder = Path(folder)
    blobs, labels = [], []
    for label, name in enumerate(classes):
        for file in sorted(p for p in (folder / name).iterdir() if p.is_file()):
            blobs.append(file.read_bytes())
            labels.append(label)
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(b) for b in blobs])
    np.savez(out, data=np.frombuffer(b"".join(blobs), dtype=np.uint8), offsets=offsets,
             labels=np.asarray(labels, dtype=np.uint8))
    return hashlib.sha256(Path(out).read_bytes()).hexdigest()
