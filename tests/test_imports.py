"""Every module of the package imports on its own, first, in a fresh interpreter: an import cycle
that an earlier import happens to hide (``robust_attn.shifts.evaluate`` through
``robust_attn.protocols``' eager registration, before it moved to
:mod:`robust_attn.protocols.shift_runner`) fails a user's script that imports that module first."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# one interpreter: torch loaded once; before each module every robust_attn module is forgotten, so
# the module is imported first, with nothing of the package loaded before it
SCRIPT = """
import importlib, pkgutil, sys
import torch
import robust_attn
names = [m.name for m in pkgutil.walk_packages(robust_attn.__path__, "robust_attn.")]
failed = []
for name in names:
    for key in [k for k in sys.modules if k == "robust_attn" or k.startswith("robust_attn.")]:
        del sys.modules[key]
    try:
        importlib.import_module(name)
    except Exception as error:
        failed.append(f"{name}: {error!r}")
print(len(names))
print("\\n".join(failed))
"""


def test_every_module_imports_first_on_its_own():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT,
                         env={"OMP_NUM_THREADS": "1", "PATH": "", "PYTHONPATH": str(ROOT)}, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    count, *failed = out.stdout.strip().splitlines()
    assert int(count) > 100
    assert not failed, "\n".join(failed)
