"""Reading the CIFAR "python version" pickles safely.

The CIFAR-10 and CIFAR-100 archives (Krizhevsky 2009) store each batch as a pickled dict of numpy
arrays. :func:`load_pickle` reads one with a restricted unpickler that resolves only the numpy
globals those files use (``_reconstruct``, ``ndarray``, ``dtype``; plus ``_codecs.encode``, which a
Python 3 re-pickled copy needs), so reading a tampered file cannot run code. With ``md5`` given,
the file's digest is checked first.
"""
from __future__ import annotations

import codecs
import hashlib
import io
import pickle
from pathlib import Path

import numpy as np

__all__ = ["load_pickle", "text_list"]


class _Refused(pickle.UnpicklingError):
    """A global a genuine CIFAR pickle never refers to (kept apart from a damaged file's errors)."""


def _numpy_global(module: str, name: str):
    try:
        from numpy._core import multiarray  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core import multiarray
    allowed = {("numpy.core.multiarray", "_reconstruct"): multiarray._reconstruct,
               ("numpy._core.multiarray", "_reconstruct"): multiarray._reconstruct,
               ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
               # what Python 3 writes for bytes at protocol 2 (a re-pickled copy); harmless
               ("_codecs", "encode"): codecs.encode}
    if (module, name) not in allowed:
        raise _Refused(f"CIFAR pickle refers to {module}.{name}, which a genuine file never "
                       f"does; refusing to load it")
    return allowed[(module, name)]


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        return _numpy_global(module, name)


def load_pickle(path: str | Path, md5: str | None = None) -> dict:
    """The dict in CIFAR pickle ``path`` with ``str`` keys; ``ValueError`` if ``md5`` is given and differs,
    or if the file is not a readable pickle (truncated, another format)."""
    path = Path(path)
    raw = path.read_bytes()
    if md5 is not None:
        digest = hashlib.md5(raw).hexdigest()
        if digest != md5:
            raise ValueError(f"{path} has md5 {digest}, expected the canonical {md5}: the file is corrupt "
                             f"or truncated; delete it and download again (download=True)")
    try:
        obj = _RestrictedUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except _Refused:
        raise
    except (EOFError, ValueError, IndexError, KeyError, TypeError, pickle.UnpicklingError) as exc:
        raise ValueError(f"{path} is not a readable CIFAR pickle ({type(exc).__name__}: {exc}): truncated or "
                         f"another format; delete it and download again (download=True)") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a {type(obj).__name__}, not the dict of a CIFAR pickle")
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in obj.items()}


def text_list(values) -> list[str]:
    """Byte strings (as the files store names) to ``str``."""
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]
