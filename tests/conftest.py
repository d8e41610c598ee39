import os
from pathlib import Path

import pytest
import torch

# Each test single-threaded and seeded; the suite's parallelism is pytest-xdist's workers (`-n auto`,
# the README's test command: one per core, at most MAX_WORKERS, since every worker imports torch and
# builds its own module-scoped fixtures).
torch.set_num_threads(1)
MAX_WORKERS = 8

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("ROBUST_ATTN_SHARED", REPO.parent / "shared"))


def pytest_xdist_auto_num_workers(config):
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def shared_dir() -> Path:
    """The ../shared folder beside the checkout (papers, reference, data); skip when absent."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} not present (a user's clone has no ../shared)")
    return SHARED
