"""Integrity of stored results and concurrency: checksummed chunks and packed runs,
damage is a clear error naming the file and the fix (exit code 2 through the CLI), ``--repair``
recomputes only damaged chunks, claims keep processes sharing a run folder from computing a
chunk twice, and a killed claimant's claim is taken over."""
from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.utils.data import TensorDataset

from robust_attn.cli import main
from robust_attn.protocols.runner import open_run, run_chunks
from robust_attn.runs.store import DamagedRecordsError, RunStore, load_records
from robust_attn.runs.sealing import main as results_main, seal
from helpers import subprocess_env

REPO = Path(__file__).resolve().parents[1]
CONDITIONS = ["a", "b", "c"]
N, SIZE = 11, 4  # chunks [0, 4), [4, 8), [8, 11)
TINY = ["--model", "resnet26", "--model-args", "width=0.25", "stem_downsample=4", "--dataset", "synthetic",
        "--no-progress"]


@pytest.fixture(autouse=True)
def _only_the_commands_tested(monkeypatch):
    """Build the CLI with the subcommands used here only (another command's parser is its own
    tests' business)."""
    monkeypatch.setattr("robust_attn.cli.COMMANDS", ["eval", "report"])


def _dataset():
    gen = torch.Generator().manual_seed(3)
    return TensorDataset(torch.rand(N, 3, 4, 4, generator=gen), torch.randint(0, 5, (N,), generator=gen))


def _records(images, labels, indices, cond):
    factor = {"a": 1.0, "b": -2.0, "c": 0.5}[cond]
    value = (images.flatten(1).sum(1) * factor).round(decimals=4)
    return pd.DataFrame({"index": indices.numpy(), "label": labels.numpy(), "value": value.numpy()})


class Counting:
    """An evaluate callback that logs every (condition, chunk start) it computes, in memory and,
    with ``log``, as one line per computation appended to a file (shared across processes);
    ``delay`` seconds per condition; ``hang_at``: block forever on that chunk start (to be killed)
    after touching ``hang_at_marker``."""

    def __init__(self, log=None, delay=0.0, hang_at=None, marker=None):
        self.calls, self.log, self.delay, self.hang_at, self.marker = [], log, delay, hang_at, marker

    def __call__(self, images, labels, indices, todo):
        for cond in todo:
            start = int(indices[0])
            if start == self.hang_at:
                Path(self.marker).write_text(str(os.getpid()))
                while True:
                    time.sleep(1)
            time.sleep(self.delay)
            self.calls.append((cond, start))
            if self.log:
                with open(self.log, "a") as f:
                    f.write(f"{os.getpid()} {cond} {start}\n")
            yield cond, _records(images, labels, indices, cond)


def _open(root):
    info = {"model": "m", "dataset": {"name": "d", "split": "test", "limit": None}, "command": ["x"]}
    return open_run(root, info, protocol="p", parameters={"k": 1}, conditions=CONDITIONS, num_images=N,
                    chunk_size=SIZE)


def _run(root, evaluate=None, **kw):
    evaluate = evaluate or Counting()
    stats = run_chunks(_open(root), _dataset(), CONDITIONS, evaluate, chunk_size=SIZE, progress=False, **kw)
    return stats, evaluate


@pytest.fixture
def finished(tmp_path):
    _run(tmp_path / "run")
    return RunStore(tmp_path / "run")


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _drop_last_line(path: Path) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]))


def _chunk_files(store):
    return {p.relative_to(store.root): p.read_bytes() for p in (store.root / "records").rglob("*.csv")}


# --- damaged chunks ------------------------------------------------------------------------------
@pytest.mark.parametrize("damage, words", [
    (lambda p: _flip_byte(p, len(p.read_bytes()) - 3), "altered"),          # a digit of the last value
    (_drop_last_line, "truncated: 3 rows, recorded 4"),                     # lost a whole line
    (lambda p: p.write_bytes(p.read_bytes()[:-5]), "truncated: a cut line"),  # cut mid-line
    (lambda p: RunStore.checksum_path(p).unlink(), "no checksum"),
], ids=["byte flipped", "lost a line", "cut mid-line", "checksum deleted"])
def test_a_damaged_chunk_is_an_error_naming_the_file_and_the_fix(finished, damage, words, tmp_path, capsys):
    good = load_records(finished.root)
    path = finished.chunk_path("b", 4, 8)
    damage(path)
    with pytest.raises(DamagedRecordsError, match="--repair") as err:
        load_records(finished.root)
    assert str(path) in str(err.value) and words in str(err.value)
    assert [p for p, _ in err.value.problems] == [path] and isinstance(err.value, ValueError)
    # the report never computes from it: exit code 2, the file and the fix named, no traceback
    assert main(["report", str(finished.root), "--out", str(tmp_path / "rep"), "--no-plots", "--bootstrap", "10"]) == 2
    message = capsys.readouterr().err
    assert str(path) in message and "--repair" in message and "Traceback" not in message
    assert not (tmp_path / "rep" / "report.md").exists()
    # resuming without repair refuses to build on it; with repair it recomputes only that chunk
    with pytest.raises(DamagedRecordsError, match="--repair"):
        _run(finished.root)
    stats, ev = _run(finished.root, repair=True)
    assert ev.calls == [("b", 4)] and stats.repaired == 1 and stats.computed == 1 and stats.skipped == 8
    pd.testing.assert_frame_equal(load_records(finished.root), good)
    assert finished.verify() == []


def test_a_deleted_chunk_is_missing_names_its_file_and_is_recomputed_alone(finished):
    good = load_records(finished.root)
    path = finished.chunk_path("c", 8, 11)
    path.unlink()
    with pytest.raises(ValueError, match="unfinished") as err:
        load_records(finished.root)
    assert str(path) in str(err.value) and "running its command again" in str(err.value)
    stats, ev = _run(finished.root)
    assert ev.calls == [("c", 8)] and stats.computed == 1
    pd.testing.assert_frame_equal(load_records(finished.root), good)


def test_repair_deletes_only_damaged_chunks_and_the_rest_is_kept(finished):
    before = _chunk_files(finished)
    _flip_byte(finished.chunk_path("a", 0, 4), 40)
    _drop_last_line(finished.chunk_path("c", 4, 8))
    removed = finished.repair()
    assert sorted(removed) == sorted([finished.chunk_path("a", 0, 4), finished.chunk_path("c", 4, 8)])
    assert sorted(finished.missing()) == [("a", 0, 4), ("c", 4, 8)]
    _, ev = _run(finished.root)
    assert sorted(ev.calls) == [("a", 0), ("c", 4)]
    assert _chunk_files(finished) == before  # byte for byte the original chunks


# --- packed runs -----------------------------------------------------------------------------------
def test_pack_records_checksums_and_a_cut_packed_file_is_an_error(finished, tmp_path, capsys):
    packed = finished.pack(tmp_path / "packed")
    manifest = json.loads((packed.root / "checksums.json").read_text())["files"]
    assert set(manifest) == {"records.csv.gz", "run.json"} and manifest["records.csv.gz"]["rows"] == 33
    pd.testing.assert_frame_equal(load_records(packed.root), load_records(finished.root))
    gz = packed.root / "records.csv.gz"
    good = gz.read_bytes()
    # cut mid-line: gzip of the first lines, the last one cut (what a broken copy leaves)
    text = gzip.decompress(good)
    gz.write_bytes(gzip.compress(text[: text.rindex(b"\n", 0, len(text) - 1) - 3], mtime=0))
    with pytest.raises(DamagedRecordsError, match="restore") as err:
        load_records(packed.root)
    assert str(gz) in str(err.value)
    assert main(["report", str(packed.root), "--out", str(tmp_path / "rep"), "--no-plots"]) == 2
    assert str(gz) in capsys.readouterr().err
    gz.write_bytes(good[: len(good) // 2])  # the compressed file itself truncated
    with pytest.raises(DamagedRecordsError, match="sha256 differs"):
        load_records(packed.root)
    with pytest.raises(DamagedRecordsError, match="restore"):  # a packed run cannot be recomputed
        packed.repair()
    gz.write_bytes(good)
    assert packed.verify() == []
    run_json = packed.root / "run.json"  # the description is covered too
    run_json.write_text(run_json.read_text().replace('"m"', '"other"'))
    with pytest.raises(DamagedRecordsError, match="run.json"):
        load_records(packed.root)
    gz.unlink()
    with pytest.raises(DamagedRecordsError, match="records.csv.gz: deleted"):
        load_records(packed.root)


def test_seal_adopts_an_intact_old_packed_run_and_refuses_a_damaged_one(finished, tmp_path):
    packed = finished.pack(tmp_path / "packed")
    (packed.root / "checksums.json").unlink()  # as packed before checksums existed
    with pytest.raises(DamagedRecordsError, match="seal"):
        load_records(packed.root)
    assert seal(packed) == [packed.root / "checksums.json"]
    pd.testing.assert_frame_equal(load_records(packed.root), load_records(finished.root))
    # an old packed file that lost lines is not adopted
    (packed.root / "checksums.json").unlink()
    gz = packed.root / "records.csv.gz"
    lines = gzip.decompress(gz.read_bytes()).splitlines(keepends=True)
    gz.write_bytes(gzip.compress(b"".join(lines[:-2]), mtime=0))
    with pytest.raises(DamagedRecordsError, match="once"):
        seal(packed)
    assert not (packed.root / "checksums.json").exists()


def test_seal_adopts_old_chunks_without_checksums(finished):
    good = load_records(finished.root)
    for side in (finished.root / "manifest").rglob("*.sha256"):
        side.unlink()
    with pytest.raises(DamagedRecordsError, match="no checksum"):
        load_records(finished.root)
    _drop_last_line(finished.chunk_path("a", 0, 4))
    with pytest.raises(DamagedRecordsError, match=r"not the images \[0, 4\)"):
        seal(finished)
    finished.chunk_path("a", 0, 4).unlink()
    assert len(seal(finished)) == 8
    _run(finished.root)
    pd.testing.assert_frame_equal(load_records(finished.root), good)


def test_seal_verifies_the_checksums_already_there(finished):
    """Sealing a run whose chunks have checksums must not call an altered one sealed: it names
    the damage and writes nothing, also for the chunks still to adopt."""
    finished.checksum_path(finished.chunk_path("b", 4, 8)).unlink()  # one old chunk to adopt
    path = finished.chunk_path("a", 0, 4)
    intact = path.read_bytes()
    path.write_bytes(intact.replace(b",", b";", 1))
    with pytest.raises(DamagedRecordsError, match=r"000000000-000000004.csv: sha256 differs.*--repair"):
        seal(finished)
    assert results_main(["seal", str(finished.root)]) == 2  # the command says so too, not "sealed"
    assert not finished.checksum_path(finished.chunk_path("b", 4, 8)).exists()
    path.write_bytes(intact)  # restored from a copy
    assert seal(finished) == [finished.checksum_path(finished.chunk_path("b", 4, 8))]
    assert finished.verify() == []


def test_overlapping_chunks_are_an_error_not_an_image_counted_twice(tmp_path):
    """Chunks of two batch sizes in one folder ([0, 4) and [2, 6)), each intact: reading them must
    refuse, since images 2 and 3 would count twice in every aggregate."""
    store = _open(tmp_path / "run")
    data = _dataset()
    for start, stop in ((0, 4), (2, 6)):
        images = torch.stack([data[i][0] for i in range(start, stop)])
        labels = torch.stack([data[i][1] for i in range(start, stop)])
        store.write_chunk("a", start, stop, _records(images, labels, torch.arange(start, stop), "a"))
    assert store.verify() == []   # each file matches its checksum
    with pytest.raises(ValueError, match="overlapping chunks"):
        load_records(store.root, require_complete=False)


def test_committed_packed_runs_carry_checksums_and_verify():
    runs = sorted((REPO / "reports").glob("*/runs/*/records.csv.gz"))
    if not runs:
        pytest.skip("no committed packed runs")
    for gz in runs:
        store = RunStore(gz.parent)
        assert (gz.parent / "checksums.json").is_file(), f"{gz.parent}: run `python -m robust_attn.runs.sealing seal`"
        assert store.verify() == [], gz.parent


# --- claims and concurrency -----------------------------------------------------------------------
def _worker(root, log, delay):
    torch.set_num_threads(1)
    stats, _ = _run(Path(root), Counting(log=log, delay=delay), poll=0.05)
    Path(f"{log}.{os.getpid()}.stats").write_text(json.dumps(stats.__dict__))


def _hanging_worker(root, marker):
    torch.set_num_threads(1)
    _run(Path(root), Counting(hang_at=4, marker=marker))


def _log(path):
    lines = [line.split() for line in Path(path).read_text().splitlines()]
    return [(int(pid), cond, int(start)) for pid, cond, start in lines]


def test_two_processes_sharing_a_run_folder_compute_disjoint_chunks(tmp_path):
    _open(tmp_path / "run")  # as the study does: the folder exists before both start
    log = tmp_path / "log"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(str(tmp_path / "run"), str(log), 0.3)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    done = _log(log)
    pairs = [(c, s) for _, c, s in done]
    assert sorted(pairs) == sorted((c, s) for c in CONDITIONS for s in (0, 4, 8))  # each exactly once
    assert len({pid for pid, _, _ in done}) == 2  # both did a share
    for p in procs:  # both finished with the whole run: what they did not compute, the other did
        stats = json.loads(Path(f"{log}.{p.pid}.stats").read_text())
        assert stats["computed"] == sum(pid == p.pid for pid, _, _ in done)
        assert stats["computed"] + stats["by_others"] + stats["skipped"] == 9
    single = tmp_path / "single"
    _run(single)
    pd.testing.assert_frame_equal(load_records(tmp_path / "run"), load_records(single))
    assert not list((tmp_path / "run").rglob("*.claim.*"))  # claims gone with their chunks
    # condition folders hold chunk files only (manifest entries and claims live beside records/)
    assert {p.suffix for p in (tmp_path / "run" / "records").rglob("*") if p.is_file()} == {".csv"}


def _one_chunk_worker(root, log, each_condition):
    """A process running the whole dataset as one chunk (as the study's attacks do, at
    ``--attack-batch-size 1000``)."""
    torch.set_num_threads(1)
    store = open_run(Path(root), {"model": "m", "dataset": {"name": "d", "split": "test", "limit": None},
                                  "command": ["x"]}, protocol="p", parameters={"k": 1}, conditions=CONDITIONS,
                     num_images=N, chunk_size=N)
    run_chunks(store, _dataset(), CONDITIONS, Counting(log=log, delay=0.5), chunk_size=N, progress=False,
               poll=0.05, claim_each_condition=each_condition)


@pytest.mark.parametrize("each_condition", [False, True])
def test_processes_split_one_chunks_conditions_only_when_claimed_one_by_one(tmp_path, each_condition):
    """One chunk, three conditions, two processes: claimed together, one process computes all
    three and the other waits; claimed one by one (``claim_each_condition``, the attacks'
    setting), both compute, each condition exactly once, with the records of a single process."""
    log = tmp_path / "log"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_one_chunk_worker, args=(str(tmp_path / "run"), str(log), each_condition))
             for _ in range(2)]
    for p in procs:
        p.start()
        time.sleep(0.2)   # the first has claimed before the second starts
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    done = _log(log)
    assert sorted(c for _, c, _ in done) == CONDITIONS   # each exactly once
    assert len({pid for pid, _, _ in done}) == (2 if each_condition else 1)
    single = tmp_path / "single"
    _one_chunk_worker(single, None, False)
    pd.testing.assert_frame_equal(load_records(tmp_path / "run"), load_records(single))
    assert not list((tmp_path / "run").rglob("*.claim.*"))


def test_a_killed_claimant_is_taken_over_and_a_live_one_is_respected(tmp_path):
    root = tmp_path / "run"
    _open(root)
    marker = tmp_path / "marker"
    proc = multiprocessing.get_context("fork").Process(target=_hanging_worker, args=(str(root), str(marker)))
    proc.start()
    deadline = time.time() + 60
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.02)
    assert marker.exists(), "the worker never reached its chunk"
    store = RunStore(root)
    claim_file = root / "claims" / "a" / "000000004-000000008.csv.claim.0"
    held = json.loads(claim_file.read_text())
    assert held["pid"] == proc.pid and held["host"] and held["time"]
    assert store.claim("a", 4, 8) is None  # alive: nobody else computes it
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert claim_file.exists()  # the killed writer left its claim behind
    stats, ev = _run(root)  # the same command again
    assert ("a", 4) in ev.calls and stats.computed == 9 - stats.skipped
    assert load_records(root)["value"].notna().all() and len(load_records(root)) == 33
    assert not list(root.rglob("*.claim.*"))


def test_a_claim_whose_pid_is_reused_or_a_zombie_is_taken_over_and_a_live_one_is_not(tmp_path):
    """On this host a claim's process is identified by pid and start time: a live pid with another
    start time (the pid reused), a zombie (killed, not yet reaped) or a claim in this process's own
    pid that it did not make holds nothing."""
    import socket

    from robust_attn.runs.claims import _process_start, claim_chunk

    chunk = tmp_path / "run" / "records" / "a" / "000000000-000000004.csv"
    folder = tmp_path / "run" / "claims" / "a"
    folder.mkdir(parents=True)

    def claimed_by(pid, start):
        for old in folder.iterdir():
            old.unlink()
        (folder / f"{chunk.name}.claim.0").write_text(json.dumps(
            {"pid": pid, "host": socket.gethostname(), "start": start, "token": "t", "time": "then"}))
        return claim_chunk(chunk, timeout=3600)

    parent = os.getppid()
    assert claimed_by(parent, _process_start(parent)) is None            # alive: respected
    taken = claimed_by(parent, "1")                                       # its pid, another start time
    assert taken is not None and taken.path.name == f"{chunk.name}.claim.1"
    taken.release()
    # this process's own pid and start time, but a token it never issued: a claim left by an earlier
    # process that had this pid (a restarted container numbers its processes anew), not one of ours
    mine = claimed_by(os.getpid(), _process_start(os.getpid()))
    assert mine is not None and mine.path.name == f"{chunk.name}.claim.1"
    mine.release()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.time() + 10
        while _process_start(pid) != "Z" and time.time() < deadline:
            time.sleep(0.01)
        assert _process_start(pid) == "Z"
        zombie = claimed_by(pid, None)
        assert zombie is not None and zombie.path.name == f"{chunk.name}.claim.1"
        zombie.release()
    finally:
        os.waitpid(pid, 0)


class Stopping(Counting):
    """:class:`Counting` that is stopped by a signal (StopRequested: the attack saved its progress)
    in the middle of its second chunk, after writing condition "a" of it."""

    def __call__(self, images, labels, indices, todo):
        for cond, records in super().__call__(images, labels, indices, todo):
            if int(indices[0]) == SIZE and cond == "b":
                from robust_attn.attacks.stopping import StopRequested

                raise StopRequested(signal.SIGTERM)
            yield cond, records


def test_a_run_stopped_by_a_signal_drops_its_claims_and_resumes_anywhere_at_once(tmp_path):
    """Unlike a killed process (above), a stopped one leaves no claim: its run folder can be copied
    to another host, where a claim would be honoured for hours, and resumed there at once."""
    from robust_attn.attacks.stopping import StopRequested

    root = tmp_path / "run"
    with pytest.raises(StopRequested):
        _run(root, Stopping())
    assert RunStore(root).chunks() == [("a", 0, 4), ("a", 4, 8), ("b", 0, 4), ("c", 0, 4)]
    assert not list(root.rglob("*.claim.*"))
    stats, ev = _run(root, claim_timeout=1e9)   # another host's claim would block for 1e9 s
    assert stats.computed == 5 and sorted(ev.calls) == [("a", 8), ("b", 4), ("b", 8), ("c", 4), ("c", 8)]
    assert len(load_records(root)) == 33


def test_a_claim_from_another_host_expires_after_the_timeout(tmp_path):
    store = _open(tmp_path / "run")
    foreign = tmp_path / "run" / "claims" / "a" / "000000000-000000004.csv.claim.0"
    foreign.parent.mkdir(parents=True)
    foreign.write_text(json.dumps({"pid": 1, "host": "another-host", "time": "then"}))
    assert store.claim("a", 0, 4, timeout=60) is None  # recent heartbeat: held
    old = time.time() - 120
    os.utime(foreign, (old, old))
    claim = store.claim("a", 0, 4, timeout=60)
    assert claim is not None and claim.path.name.endswith(".claim.1")  # taken over, not deleted
    assert store.claim("a", 0, 4, timeout=60) is None  # ours now (we are alive)
    claim.release()
    assert foreign.exists() and not claim.path.exists()


# --- through the CLI --------------------------------------------------------------------------------
def test_cli_damaged_run_exits_2_naming_repair_and_repair_recomputes_it(tmp_path, capsys):
    args = ["eval", "rotation", *TINY, "--limit", "4", "--batch-size", "2", "--angle-step", "0"]
    assert main([*args, "--out", str(tmp_path / "run")]) == 0
    store = RunStore(tmp_path / "run")
    good = _chunk_files(store)
    path = store.chunk_path("cw90", 2, 4)
    _drop_last_line(path)
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "--repair" in err and "Traceback" not in err
    assert main([*args, "--repair", "--out", str(tmp_path / "run")]) == 0
    assert str(path) in capsys.readouterr().err
    assert _chunk_files(store) == good




@pytest.mark.slow
def test_two_identical_cli_commands_into_one_out_compute_each_chunk_once(tmp_path):
    args = [sys.executable, "-m", "robust_attn.cli", "eval", "rotation", *TINY, "--limit", "16", "--batch-size", "1",
            "--angle-step", "0", "--out", str(tmp_path / "run")]
    procs = [subprocess.Popen(args, env=subprocess_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    # each chunk file was written once: its manifest entry and the chunk agree, no leftovers
    store = RunStore(tmp_path / "run")
    assert store.verify() == [] and store.missing() == []
    assert not list((tmp_path / "run").rglob("*.claim.*")) and not list((tmp_path / "run").rglob("*.tmp"))
    assert len(list((tmp_path / "run" / "records").rglob("*.csv"))) == 16 * 6


@pytest.mark.slow
def test_sigkill_at_20_random_points_then_resume_equals_an_uninterrupted_run_byte_for_byte(tmp_path):
    args = ["eval", "rotation", *TINY, "--limit", "80", "--batch-size", "2", "--angle-step", "90"]
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    assert subprocess.run([sys.executable, "-m", "robust_attn.cli", *args, "--out", str(clean)], env=subprocess_env(),
                          cwd=REPO, capture_output=True).returncode == 0
    rng = random.Random(18)
    count = lambda: len(list((killed / "records").rglob("*.csv")))  # noqa: E731
    kills, written = 0, []
    for _ in range(20):
        before = count()
        proc = subprocess.Popen([sys.executable, "-m", "robust_attn.cli", *args, "--out", str(killed)], env=subprocess_env(),
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while proc.poll() is None and count() == before and time.time() < deadline:
            time.sleep(0.01)  # until it computes: then a random point within the next few chunks
        time.sleep(rng.uniform(0, 0.25))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        written.append(count())
    total = len(list((clean / "records").rglob("*.csv")))
    # killed at least 10 times with work left, and the kill points spread over the run
    assert kills >= 10 and len({w for w in written if 0 < w < total}) >= 5, written
    assert subprocess.run([sys.executable, "-m", "robust_attn.cli", *args, "--out", str(killed)], env=subprocess_env(),
                          cwd=REPO, capture_output=True).returncode == 0
    a, b = RunStore(clean), RunStore(killed)
    assert _chunk_files(b) == _chunk_files(a)
    sidecars = {p.relative_to(killed): p.read_bytes() for p in (killed / "manifest").rglob("*.sha256")}
    assert sidecars == {p.relative_to(clean): p.read_bytes() for p in (clean / "manifest").rglob("*.sha256")}
    assert not list(killed.rglob("*.claim.*"))  # stale claims go once their chunks are written
    assert a.pack(tmp_path / "pa").root.joinpath("records.csv.gz").read_bytes() == \
        b.pack(tmp_path / "pb").root.joinpath("records.csv.gz").read_bytes()


# --- mutation review: sealing, packed manifests, the verify command, claims ---------------------------
@pytest.mark.parametrize("copied_from", [("b", 0, 4), ("a", 4, 8)], ids=["other images", "other condition"])
def test_seal_refuses_an_old_chunk_holding_another_chunks_records(finished, copied_from):
    """Sealing must not adopt a chunk file whose rows are other images or another condition (a
    misplaced copy): its records would count as the chunk's in every aggregate."""
    path = finished.chunk_path("b", 4, 8)
    finished.checksum_path(path).unlink()   # an old chunk, written before checksums existed
    path.write_bytes(finished.chunk_path(*copied_from).read_bytes())
    with pytest.raises(DamagedRecordsError, match=r"not the images \[4, 8\) of b"):
        seal(finished)
    assert not finished.checksum_path(path).exists()


def test_seal_refuses_an_old_chunk_without_a_condition_column(finished):
    """An old chunk file whose header lost its condition column cannot be adopted: the refusal
    names the file and the fix, not a KeyError."""
    path = finished.chunk_path("b", 4, 8)
    finished.checksum_path(path).unlink()
    frame = pd.read_csv(path)
    path.write_text(frame.drop(columns="condition").to_csv(index=False))
    with pytest.raises(DamagedRecordsError, match=r"not the images \[4, 8\) of b; delete it"):
        seal(finished)
    assert not finished.checksum_path(path).exists()


def _old_packed(finished, tmp_path, edit):
    """``finished`` packed, then made an old packed run (no checksums.json) whose records text
    went through ``edit`` (bytes -> bytes)."""
    packed = finished.pack(tmp_path / "packed")
    (packed.root / "checksums.json").unlink()
    gz = packed.root / "records.csv.gz"
    gz.write_bytes(gzip.compress(edit(gzip.decompress(gz.read_bytes())), mtime=0))
    return packed


def test_seal_refuses_an_old_packed_run_holding_a_record_twice(finished, tmp_path):
    """A packed file with one record repeated (every image still present) is not adopted: the image
    would count twice in its condition's accuracy."""
    packed = _old_packed(finished, tmp_path, lambda text: text + text.splitlines(keepends=True)[5])
    with pytest.raises(DamagedRecordsError, match="once"):
        seal(packed)
    assert not (packed.root / "checksums.json").exists()


def test_seal_refuses_an_old_packed_run_whose_last_line_is_cut(finished, tmp_path):
    """A packed file cut inside its last value still parses as every record once, but the value is
    wrong: sealing must refuse it rather than checksum the damage."""
    packed = _old_packed(finished, tmp_path, lambda text: text[:-2])
    with pytest.raises(DamagedRecordsError, match="last line is cut"):
        seal(packed)
    assert not (packed.root / "checksums.json").exists()


@pytest.mark.parametrize("edit, words", [
    (lambda files: files.pop("records.csv.gz"), "lists no records.csv.gz"),
    (lambda files: files["records.csv.gz"].update(rows=34), "33 rows, recorded 34"),
], ids=["records not listed", "row count edited"])
def test_an_edited_packed_manifest_is_damage(finished, tmp_path, edit, words):
    """checksums.json that no longer covers the records (their entry deleted, or its row count
    changed) makes the packed run damaged, not silently unchecked."""
    packed = finished.pack(tmp_path / "packed")
    manifest = json.loads((packed.root / "checksums.json").read_text())
    edit(manifest["files"])
    (packed.root / "checksums.json").write_text(json.dumps(manifest))
    with pytest.raises(DamagedRecordsError, match=words):
        load_records(packed.root)
    assert any(words in why for _, why in packed.verify())


def test_packing_writes_the_same_bytes_whatever_the_time(finished, tmp_path, monkeypatch):
    """A packed run committed beside a report must be byte-reproducible: packing again later gives
    the same records.csv.gz (no timestamp in the gzip header)."""
    from types import SimpleNamespace

    monkeypatch.setattr(gzip, "time", SimpleNamespace(time=lambda: 1_000_000_000.0))
    first = (finished.pack(tmp_path / "first").root / "records.csv.gz").read_bytes()
    monkeypatch.setattr(gzip, "time", SimpleNamespace(time=lambda: 1_700_000_000.0))
    again = (finished.pack(tmp_path / "again").root / "records.csv.gz").read_bytes()
    assert first == again


def test_a_chunk_entry_whose_row_count_was_edited_is_damage(finished):
    """A manifest entry whose sha256 matches but whose row count is not the chunk's (edited or
    copied from another run) must not pass as intact."""
    path = finished.chunk_path("b", 4, 8)
    side = finished.checksum_path(path)
    side.write_text(json.dumps(dict(json.loads(side.read_text()), rows=5)))
    with pytest.raises(DamagedRecordsError) as err:
        load_records(finished.root)
    assert [p for p, _ in err.value.problems] == [path]
    assert [p for p, _ in finished.verify()] == [path]
    assert "records 5 rows, expected 4" in str(err.value)   # the recorded count, not the chunk's


@pytest.mark.parametrize("content", ["[]", '"sha256"', "4"])
def test_a_checksum_file_that_is_not_a_json_object_is_damage(finished, content):
    """A chunk's checksum file holding valid JSON that is not an object is damage named by file,
    not an AttributeError from the reader."""
    path = finished.chunk_path("b", 4, 8)
    finished.checksum_path(path).write_text(content)
    with pytest.raises(DamagedRecordsError, match="not an object") as err:
        load_records(finished.root)
    assert [p for p, _ in err.value.problems] == [path]


@pytest.mark.parametrize("files", [[], {"records.csv.gz": "0" * 64}], ids=["a list", "entry a string"])
def test_a_packed_manifest_whose_files_are_not_objects_is_damage(finished, tmp_path, files):
    """checksums.json whose "files" is a list, or whose entry is not an object, is an unreadable
    manifest (DamagedRecordsError naming it), not an AttributeError."""
    packed = finished.pack(tmp_path / "packed")
    manifest = json.loads((packed.root / "checksums.json").read_text())
    manifest["files"] = files
    (packed.root / "checksums.json").write_text(json.dumps(manifest))
    with pytest.raises(DamagedRecordsError, match="unreadable"):
        load_records(packed.root)
    assert [p.name for p, _ in packed.verify()] == ["checksums.json"]


def test_results_verify_command_exits_2_naming_a_damaged_chunk(finished, capsys):
    """``python -m robust_attn.runs.sealing verify RUN`` says intact only for an intact run; a damaged
    chunk is exit code 2 naming the file and --repair."""
    assert results_main(["verify", str(finished.root)]) == 0
    assert f"{finished.root}: intact" in capsys.readouterr().out
    path = finished.chunk_path("c", 8, 11)
    _drop_last_line(path)
    assert results_main(["verify", str(finished.root)]) == 2
    captured = capsys.readouterr()
    assert str(path) in captured.err and "--repair" in captured.err and "intact" not in captured.out


def test_a_chunk_finished_by_another_process_while_claiming_is_not_claimed(tmp_path, monkeypatch):
    """When another process writes the chunk between our look and our claim, the claim is dropped
    (None: nothing to compute) and no claim file stays behind."""
    from robust_attn.runs import claims

    store = _open(tmp_path / "run")
    chunk = store.chunk_path("a", 0, 4)
    listed = claims._claim_files

    def finished_meanwhile(path):
        found = listed(path)
        chunk.parent.mkdir(parents=True, exist_ok=True)
        chunk.write_text("condition,index\n")   # the other process's rename lands now
        return found

    monkeypatch.setattr(claims, "_claim_files", finished_meanwhile)
    assert store.claim("a", 0, 4) is None
    monkeypatch.undo()
    assert not list((tmp_path / "run").rglob("*.claim.*"))
