import os
from pathlib import Path

import pytest
import torch

# Two cores are shared by the whole suite: keep each test single-threaded and seeded.
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("ROBUST_ATTN_SHARED", REPO.parent / "shared"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def shared_dir() -> Path:
    """The ../shared folder beside the checkout (papers, reference, data); skip when absent."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} not present (a user's clone has no ../shared)")
    return SHARED
