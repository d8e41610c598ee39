"""What a checkpoint records of how it was made: library versions, the git commit of the code
(``-dirty`` when it had changes) and which form of the data was read."""
from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch

__all__ = ["versions", "git_commit", "data_variant"]


def versions() -> dict:
    """The versions a checkpoint records: Python, torch, torchvision and robust_attn."""
    import torchvision

    import robust_attn

    return {"python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "robust_attn": robust_attn.__version__}


def git_commit(folder: Path | None = None) -> str | None:
    """The commit of the checkout holding ``folder`` (default: this package), with ``-dirty`` appended
    when tracked files differ from it (as ``git describe --dirty``): the commit alone would not
    reproduce such a run. None outside a git checkout."""
    folder = folder or Path(__file__).parent

    def git(*args):
        try:
            out = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    changes = git("status", "--porcelain", "--untracked-files=no")
    return commit + ("-dirty" if changes else "")


def data_variant(dataset) -> str | None:
    """Which form of the data was read (e.g. "cifar10" or "cifar10-jpeg"), where the reader says."""
    while dataset is not None and not hasattr(dataset, "variant"):
        dataset = getattr(dataset, "dataset", None)
    return getattr(dataset, "variant", None)
