"""The results store and the shared run loop: descriptions, atomic chunks, resumption, shards."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from torch.utils.data import TensorDataset

from robust_attn.distributed import shard_indices
from robust_attn.protocols.runner import chunk_grid, open_run, run_chunks
from robust_attn.reports.models import computed_on
from robust_attn.runs.migrations import SCHEMA_VERSION
from robust_attn.runs.store import RunMismatchError, RunStore, load_records
from robust_attn.utils.hardware import cpu_fingerprint


def _dataset(n=11):
    gen = torch.Generator().manual_seed(3)
    return TensorDataset(torch.rand(n, 3, 4, 4, generator=gen), torch.randint(0, 5, (n,), generator=gen))


class Counting:
    """An evaluate callback: per image, the rounded pixel sum times a per-condition factor;
    counts every (condition, chunk) it computes and can fail after ``fail_after`` of them."""

    factors = {"a": 1.0, "b": -2.0, "c": 0.5}

    def __init__(self, fail_after=None):
        self.calls = []
        self.fail_after = fail_after

    def __call__(self, images, labels, indices, todo):
        for cond in todo:
            if self.fail_after is not None and len(self.calls) >= self.fail_after:
                raise KeyboardInterrupt("injected interruption")
            self.calls.append((cond, int(indices[0])))
            value = (images.flatten(1).sum(1) * self.factors[cond]).round(decimals=4)
            yield cond, pd.DataFrame({"index": indices.numpy(), "label": labels.numpy(), "value": value.numpy()})


def _open(tmp_path, name="run", **changes):
    info = {"model": "m", "dataset": {"name": "d", "split": "test", "limit": None}, "command": ["x"]}
    info.update(changes)
    return open_run(tmp_path / name, info, protocol="p", parameters={"k": 1}, conditions=["a", "b", "c"],
                    num_images=11, chunk_size=4)


def test_chunk_grid_and_shards_cover_everything_once():
    assert chunk_grid(11, 4) == [(0, 4), (4, 8), (8, 11)]
    shards = [shard_indices(7, r, 3) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(7))
    assert shards[0] == [0, 3, 6]
    with pytest.raises(ValueError, match="batch size"):
        chunk_grid(5, 0)
    with pytest.raises(ValueError):
        shard_indices(5, 3, 3)


def test_run_writes_description_and_all_records(tmp_path):
    store = _open(tmp_path)
    stats = run_chunks(store, _dataset(), ["a", "b", "c"], Counting(), chunk_size=4, progress=False)
    assert stats.computed == 9 and stats.skipped == 0 and stats.chunks_loaded == 3
    desc = json.loads((tmp_path / "run" / "run.json").read_text())
    assert desc["protocol"] == "p" and desc["num_images"] == 11 and desc["chunk_size"] == 4
    assert "torch" in desc["versions"]
    records = load_records(tmp_path / "run")
    assert len(records) == 33
    assert list(records["condition"].unique()) == ["a", "b", "c"]  # the description's order
    images, labels = _dataset().tensors
    a = records[records["condition"] == "a"]
    assert a["index"].tolist() == list(range(11))
    assert a["label"].tolist() == labels.tolist()
    torch.testing.assert_close(torch.tensor(a["value"].to_numpy()), images.flatten(1).sum(1).double(),
                               atol=1e-4, rtol=0)


def test_resume_after_interruption_equals_uninterrupted_and_recomputes_nothing(tmp_path):
    full = _open(tmp_path, "full")
    run_chunks(full, _dataset(), ["a", "b", "c"], Counting(), chunk_size=4, progress=False)

    store = _open(tmp_path, "resumed")
    first = Counting(fail_after=4)
    with pytest.raises(KeyboardInterrupt):
        run_chunks(store, _dataset(), ["a", "b", "c"], first, chunk_size=4, progress=False)
    assert len(store.chunks()) == 4 and len(store.missing()) == 5
    with pytest.raises(ValueError, match="unfinished"):
        load_records(store.root)
    # no temporary files survive
    assert not [p for p in store.root.rglob("*.tmp")]
    store = _open(tmp_path, "resumed")  # the same command again
    second = Counting()
    stats = run_chunks(store, _dataset(), ["a", "b", "c"], second, chunk_size=4, progress=False)
    assert stats.skipped == 4 and stats.computed == 5
    assert not set(first.calls) & set(second.calls)  # nothing done twice
    assert set(first.calls) | set(second.calls) == {(c, s) for c in "abc" for s in (0, 4, 8)}
    assert stats.chunks_loaded == 2  # the chunk with every condition written is not loaded
    pd.testing.assert_frame_equal(load_records(store.root), load_records(full.root))


def test_shards_of_two_ranks_merge_to_the_single_process_records(tmp_path):
    single = _open(tmp_path, "single")
    run_chunks(single, _dataset(), ["a", "b", "c"], Counting(), chunk_size=4, progress=False)
    sharded = _open(tmp_path, "sharded")
    calls = []
    for rank in (1, 0):
        ev = Counting()
        run_chunks(sharded, _dataset(), ["a", "b", "c"], ev, chunk_size=4, rank=rank, world_size=2,
                   progress=False)
        calls.append({s for _, s in ev.calls})
    assert calls == [{4}, {0, 8}]  # rank 1 took the middle chunk only
    pd.testing.assert_frame_equal(load_records(sharded.root), load_records(single.root))


def test_mismatching_description_is_a_clear_error(tmp_path):
    _open(tmp_path)
    _open(tmp_path, command=["something", "else"])  # volatile keys may differ
    with pytest.raises(RunMismatchError, match="model.*new --out"):
        _open(tmp_path, model="other")
    with pytest.raises(RunMismatchError, match="chunk_size"):
        open_run(tmp_path / "run", {"model": "m", "dataset": {"name": "d", "split": "test", "limit": None}},
                 protocol="p", parameters={"k": 1}, conditions=["a", "b", "c"], num_images=11, chunk_size=5)


def test_a_mismatch_names_what_differs_briefly(tmp_path):
    """Long conditions and parameters: the message lists the items one side lacks, or the field
    of the item that changed, not both whole values."""
    cond = lambda name, eps: {"name": name, "attack": "autoattack", "eps": eps, "options": {"x": list(range(50))}}
    many = [cond(f"model{i}", 8) for i in range(30)]
    params = {"targets": list(range(200)), "seed": 0}
    open_run(tmp_path / "run", {"model": "m"}, protocol="p", parameters=params, conditions=many, num_images=4,
             chunk_size=4)
    with pytest.raises(RunMismatchError) as err:
        open_run(tmp_path / "run", {"model": "m"}, protocol="p", parameters=params, conditions=many[:2],
                 num_images=4, chunk_size=4)
    message = str(err.value)
    assert "conditions: 30 items stored, 2 now; only stored: 'model2', 'model3', 'model4', 'model5' and 24 more" in message
    assert len(message) < 400
    changed = many[:5] + [cond("model5", 4)] + many[6:]
    with pytest.raises(RunMismatchError, match=r"conditions: item 'model5': \{eps: stored 8, now 4\}\)"):
        open_run(tmp_path / "run", {"model": "m"}, protocol="p", parameters=params, conditions=changed,
                 num_images=4, chunk_size=4)
    with pytest.raises(RunMismatchError, match=r"parameters: \{seed: stored 0, now 1\}\)"):
        open_run(tmp_path / "run", {"model": "m"}, protocol="p", parameters={**params, "seed": 1},
                 conditions=many, num_images=4, chunk_size=4)
    with pytest.raises(RunMismatchError, match=r"in another order: stored \['model0', 'model1', "):
        open_run(tmp_path / "run", {"model": "m"}, protocol="p", parameters=params, conditions=many[::-1],
                 num_images=4, chunk_size=4)


def test_store_rejects_bad_chunks_and_reports_missing_run(tmp_path):
    store = RunStore(tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="robust-attn eval"):
        store.description()
    with pytest.raises(ValueError, match="expected 4"):
        store.write_chunk("a", 0, 4, pd.DataFrame({"index": [0, 1]}))
    with pytest.raises(ValueError, match="condition name"):
        store.chunk_path("a/b", 0, 1)


def test_packed_run_reads_like_the_original_and_is_reproducible(tmp_path):
    store = _open(tmp_path)
    run_chunks(store, _dataset(), ["a", "b"], Counting(), chunk_size=4, progress=False)
    with pytest.raises(ValueError, match="unfinished"):       # condition c is still missing
        store.pack(tmp_path / "packed")
    run_chunks(store, _dataset(), ["c"], Counting(), chunk_size=4, progress=False)
    (tmp_path / "run" / "targets.csv").write_text("index,label,target\n")
    packed = store.pack(tmp_path / "packed")
    assert sorted(p.name for p in packed.root.iterdir()) == ["checksums.json", "records.csv.gz", "run.json", "targets.csv"]
    pd.testing.assert_frame_equal(load_records(packed.root), load_records(store.root))
    assert packed.missing() == [] and packed.description() == store.description()
    again = store.pack(tmp_path / "packed2")
    assert (again.root / "records.csv.gz").read_bytes() == (packed.root / "records.csv.gz").read_bytes()
    stats = run_chunks(packed, _dataset(), ["a", "b", "c"], Counting(fail_after=0), chunk_size=4, progress=False)
    assert stats.computed == 0 and stats.skipped == 9        # nothing left to compute
    with pytest.raises(ValueError, match="packed run"):
        packed.write_chunk("a", 0, 4, pd.DataFrame({"index": range(4)}))


def test_runs_recorded_before_the_data_provenance_keys_resume_and_later_ones_are_compared(tmp_path):
    """A run.json written before data_source/data_variant existed (the Fashion-MNIST study's packed
    runs) resumes under a description that has them; once stored, another variant is refused."""
    base = {"model": "m", "protocol": "rotation", "num_images": 4, "chunk_size": 2, "conditions": ["none"]}
    old = RunStore(tmp_path / "old")
    old.open(base)
    now = {**base, "data_source": "/embedded/fashion_mnist_test", "data_variant": "fashion_mnist"}
    assert old.open(now) == {**base, "schema": SCHEMA_VERSION}   # what was stored, kept
    new = RunStore(tmp_path / "new")
    new.open({**base, "data_source": "/data/cifar-10-batches-py", "data_variant": "cifar10"})
    with pytest.raises(RunMismatchError, match="data_variant"):
        new.open({**base, "data_source": "/data/cifar-10-batches-py", "data_variant": "cifar10-jpeg"})


def test_a_run_resumes_when_its_data_was_read_from_another_folder(tmp_path):
    """``data_source`` is where the bytes were read (the package's embedded copy moves with every
    clone of the repository; a user may move a data folder): the same variant read elsewhere is the
    same run, and the stored path is kept."""
    base = {"model": "m", "protocol": "rotation", "num_images": 4, "chunk_size": 2, "conditions": ["none"],
            "data_variant": "cifar10-jpeg"}
    store = RunStore(tmp_path / "run")
    store.open({**base, "data_source": "/work/main/robust_attn/data/embedded/cifar10_jpeg_test.npz"})
    moved = store.open({**base, "data_source": "/home/user/robust-attn/robust_attn/data/embedded/cifar10_jpeg_test.npz"})
    assert moved["data_source"].startswith("/work/main/")
    with pytest.raises(RunMismatchError, match="data_variant"):
        store.open({**base, "data_source": "/data/cifar-10-batches-py", "data_variant": "cifar10"})


def test_runs_recorded_before_a_later_parameter_resume_with_its_old_value_only(tmp_path):
    """PGD runs written before ``exact`` existed ran the fast mode: they resume with exact=False
    (the Fashion-MNIST study's packed runs) and are refused with exact=True."""
    base = {"model": "m", "protocol": "pgd", "num_images": 4, "chunk_size": 2, "conditions": ["clean"],
            "parameters": {"backend": "native", "seed": 0}}
    store = RunStore(tmp_path / "old")
    store.open(base)
    resumed = store.open({**base, "parameters": {**base["parameters"], "exact": False}})
    assert resumed == {**base, "schema": SCHEMA_VERSION}
    with pytest.raises(RunMismatchError, match="parameters"):
        store.open({**base, "parameters": {**base["parameters"], "exact": True}})
    new = RunStore(tmp_path / "new")
    new.open({**base, "parameters": {**base["parameters"], "exact": False}})
    with pytest.raises(RunMismatchError, match="parameters"):
        new.open(base)   # once stored, compared as any other parameter


def test_each_chunk_names_the_hardware_that_computed_it_and_a_packed_run_keeps_the_counts(tmp_path):
    """A run started on one device and resumed on another (a GPU, then a CPU with one thread,
    then two) says which chunks each computed: run.json keeps the first start's device, the
    chunk entries each their own hardware (float rounding differs between them), and packing
    keeps the counts (checksums still verify)."""
    gpu = f"cuda {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "cuda"
    threads = torch.get_num_threads()
    try:
        store = _open(tmp_path, device="cuda:0")   # what --device cuda resolves to
        with pytest.raises(KeyboardInterrupt):
            run_chunks(store, _dataset(), ["a", "b", "c"], Counting(fail_after=2), chunk_size=4, progress=False)
        torch.set_num_threads(1)
        store = _open(tmp_path, device="cpu")   # resumed elsewhere: the same run (device is volatile)
        with pytest.raises(KeyboardInterrupt):
            run_chunks(store, _dataset(), ["a", "b", "c"], Counting(fail_after=3), chunk_size=4, progress=False)
        torch.set_num_threads(2)   # and again with two threads: another float environment
        run_chunks(store, _dataset(), ["a", "b", "c"], Counting(), chunk_size=4, progress=False)
    finally:
        torch.set_num_threads(threads)
    cpu = f"cpu {torch.backends.cpu.get_cpu_capability()} {cpu_fingerprint()}"
    expected = {f"{cpu} 1 thread": 3, f"{cpu} 2 threads": 4, gpu: 2}
    assert store.description()["device"] == "cuda:0"
    assert store.computed_on() == expected == RunStore(store.root).computed_on()
    assert store.verify() == []
    packed = store.pack(tmp_path / "packed")
    assert packed.verify() == [] and packed.computed_on() == expected
    # the report's model table, over a model's runs (here the run and its packed copy)
    where = f"{cpu} 1 thread: 6 chunks, {cpu} 2 threads: 8 chunks, {gpu}: 4 chunks"
    assert computed_on([SimpleNamespace(path=store.root), SimpleNamespace(path=packed.root)]) == where
    assert computed_on([SimpleNamespace(path=tmp_path / "nothing")]) == "not recorded"
    # a run whose first start put the attention layers on the reference path says so
    started = [SimpleNamespace(path=store.root, description={"attention_path": "reference"}),
               SimpleNamespace(path=packed.root, description={"attention_path": "lean"})]
    assert computed_on(started) == where + "; started on the reference attention path"
    first, second = sorted((store.root / "manifest").rglob("*.sha256"))[:2]
    entry = json.loads(first.read_text())
    entry.pop("hardware")   # a chunk written before entries named the hardware: its device type
    first.write_text(json.dumps(entry))
    entry = json.loads(second.read_text())
    entry.pop("hardware"), entry.pop("device")   # before entries named the device
    second.write_text(json.dumps(entry))
    counts = store.computed_on()
    assert sum(counts.values()) == 9 and counts.get("not recorded") == 1
    assert len(set(counts) & {"cpu", "cuda"}) == 1
    assert store.verify() == []


def test_records_follow_the_order_of_the_descriptions_conditions(tmp_path):
    """Records (and so every table built from them) list the conditions in the run's order, not
    alphabetically: a run of conditions c, a, b reads back as c, a, b."""
    store = open_run(tmp_path / "run", {"model": "m"}, protocol="p", parameters={"k": 1}, conditions=["c", "a", "b"],
                     num_images=11, chunk_size=4)
    run_chunks(store, _dataset(), ["c", "a", "b"], Counting(), chunk_size=4, progress=False)
    records = load_records(store.root)
    assert list(records["condition"].unique()) == ["c", "a", "b"]
    assert records[records["condition"] == "a"]["index"].tolist() == list(range(11))



def test_run_json_carries_its_schema_version_and_an_unversioned_one_reads_as_version_1(tmp_path):
    """A new run.json says its layout's version; one without ``schema`` (written before it existed)
    resumes without what MIGRATIONS says later versions added, and compares what it has."""
    import json

    from robust_attn.runs.migrations import MIGRATIONS
    from robust_attn.runs.store import DamagedRecordsError

    assert SCHEMA_VERSION == max(MIGRATIONS)
    base = {"model": "m", "protocol": "rotation", "num_images": 4, "chunk_size": 2, "conditions": ["none"]}
    store = RunStore(tmp_path / "run")
    assert store.open(base)["schema"] == SCHEMA_VERSION
    assert json.loads((tmp_path / "run" / "run.json").read_text())["schema"] == SCHEMA_VERSION
    (tmp_path / "run" / "run.json").write_text(json.dumps(base))   # as written before schema versions
    later = {key: "x" for number in MIGRATIONS for key in MIGRATIONS[number].keys}
    assert store.open({**base, **later}) == base
    with pytest.raises(RunMismatchError, match="protocol"):
        store.open({**base, "protocol": "pgd"})
    (tmp_path / "run" / "run.json").write_text(json.dumps({**base, "schema": "four"}))
    with pytest.raises(DamagedRecordsError, match="not a version number"):
        store.open(base)


def test_each_chunk_records_its_seconds_and_the_run_sums_them_over_a_kill_and_a_resume(tmp_path, monkeypatch,
                                                                                        capsys):
    """Every call of the run loop's clock advances it 2.5 s: each chunk's manifest entry keeps
    2.5 s, a run killed after four chunks and resumed sums all nine (what a study's per-call
    timing lost with the killed call), the packed copy keeps the sum, and status shows it."""
    import robust_attn.protocols.runner as runner
    from robust_attn.cli import main
    from robust_attn.commands.status import run_lines

    ticks = iter(range(10**6))
    monkeypatch.setattr(runner.time, "perf_counter", lambda: 2.5 * next(ticks))
    store = _open(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        run_chunks(store, _dataset(), ["a", "b", "c"], Counting(fail_after=4), chunk_size=4, progress=False)
    assert store.compute_time() == {"seconds": 10.0, "timed": 4, "chunks": 4}
    run_chunks(store, _dataset(), ["a", "b", "c"], Counting(), chunk_size=4, progress=False)
    assert {e["seconds"] for e in store.manifest_entries().values()} == {2.5}
    assert store.compute_time() == {"seconds": 22.5, "timed": 9, "chunks": 9}
    packed = store.pack(tmp_path / "packed")
    assert packed.compute_time() == {"seconds": 22.5, "timed": 9, "chunks": 9}
    assert main(["status", str(store.root), str(packed.root)]) == 0
    out = capsys.readouterr().out
    assert out.count(", compute time 0.01 h\n") == 2 and "(finished), compute time" in out
    # a chunk written without its time (by an earlier version) is counted as such
    entry = store.checksum_path(store.chunk_path("a", 0, 4))
    entry.write_text(json.dumps({k: v for k, v in json.loads(entry.read_text()).items() if k != "seconds"}))
    assert store.compute_time() == {"seconds": 20.0, "timed": 8, "chunks": 9}
    assert run_lines(store.root)[0].endswith(", compute time 0.01 h (the 8 of 9 chunks written that recorded it)")
