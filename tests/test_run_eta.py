"""The time left of a run, from the pace of its last chunks (robust_attn/runs/eta.py), as
`robust-attn status` prints it."""
import os

import pandas as pd

from robust_attn.runs.eta import RECENT, chunk_pace, eta_line
from robust_attn.protocols.runner import open_run
from robust_attn.runs.store import RunStore


def test_pace_is_taken_over_the_last_chunks():
    assert chunk_pace([5.0]) is None and chunk_pace([]) is None
    assert chunk_pace([0.0, 10.0, 20.0]) == 10.0
    # an interrupted earlier call (a day's gap) does not count once RECENT chunks came after it
    early = [0.0, 1.0]
    recent = [86400.0 + 3 * k for k in range(RECENT)]
    assert chunk_pace(early + recent) == 3.0


def test_status_line_gives_the_time_left(tmp_path):
    store = open_run(tmp_path / "run", {"model": "m"}, protocol="rotation", parameters={},
                     conditions=[{"name": "none"}], num_images=10, chunk_size=2, device="cpu")
    for k, start in enumerate((0, 2, 4)):
        path = store.write_chunk("none", start, start + 2, pd.DataFrame({"index": [start, start + 1],
                                                                         "top1": [1, 0]}))
        os.utime(path, (1000.0 + 60 * k, 1000.0 + 60 * k))
    store = RunStore(tmp_path / "run")
    missing = store.missing()
    assert len(missing) == 2
    line = eta_line(store, missing, now=1000.0 + 120 + 30)
    # one chunk a minute, two to go
    assert "about 2 min left" in line and "one every 60 s" in line and "written 30 s ago" in line
    assert eta_line(store, [], now=0.0) is None
