"""The run loop every protocol shares: chunks, shards, claims, resumption, progress.

The dataset is cut into chunks of ``chunk_size`` consecutive items (one batch each). Under
``torchrun`` rank ``r`` of ``W`` takes chunks ``r, r + W, r + 2W, ...``
(:func:`robust_attn.distributed.shard_indices` over the chunk list). For each chunk the
protocol's ``evaluate`` callback gets the batch and the conditions still missing for it and
yields ``(condition, records)`` pairs, each written at once as an atomic chunk file; a chunk
with every condition written is not even loaded again.

Several processes may share one run directory (the same command started twice, a restart
beside a still-running process): each (condition, chunk) is *claimed* just before it is
computed (:meth:`robust_attn.runs.store.RunStore.claim`; stale claims of killed processes are
taken over), so no chunk is computed twice, and a process that finds the rest of its shard
claimed by live processes waits for them (polling) rather than returning an unfinished run.
The chunks already written are checked against their checksums first: a damaged one is a
:class:`~robust_attn.runs.store.DamagedRecordsError`, or, with ``repair=True``, deleted and
computed again.
"""
from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from robust_attn.runs.claims import Claim
from robust_attn.distributed import shard_indices
from robust_attn.runs.adopt import adopt_records, reuse_sources
from robust_attn.runs.store import RunStore, library_versions

__all__ = ["RunStats", "chunk_grid", "run_chunks", "topk_hits", "open_run"]

Evaluate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list], Iterable[tuple[str, pd.DataFrame]]]


@dataclass
class RunStats:
    """What one call of :func:`run_chunks` did (for this rank)."""

    computed: int = 0  # (condition, chunk) pairs written now
    skipped: int = 0  # (condition, chunk) pairs found already written
    chunks_loaded: int = 0  # batches read from the dataset
    by_others: int = 0  # pairs written meanwhile by other processes sharing the run directory
    repaired: int = 0  # damaged chunk files deleted (``repair=True``) and computed again


def chunk_grid(n: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[(0, c), (c, 2c), ..., (.., n)]``: the chunk boundaries; independent of the world size."""
    if chunk_size < 1:
        raise ValueError(f"batch size must be positive, got {chunk_size}")
    return [(a, min(a + chunk_size, n)) for a in range(0, n, chunk_size)]


class _ClaimingSampler:
    """Batch sampler over the pending chunks that claims each chunk's missing conditions as
    the loader asks for it (so claims are taken just ahead of the computation) and yields only
    chunks with at least one condition claimed; ``claimed`` queues what each batch is for.
    ``each_condition``: claim one condition per batch (the chunk is then loaded once per
    condition), so that processes sharing the run split one chunk's conditions between them."""

    def __init__(self, store: RunStore, pending, claim_timeout, each_condition: bool = False):
        self.store, self.pending, self.timeout = store, pending, claim_timeout
        self.each_condition = each_condition
        self.claimed: deque[tuple[int, int, dict[str, Claim]]] = deque()

    def __iter__(self):
        for start, stop, todo in self.pending:
            groups = [[c] for c in todo] if self.each_condition else [todo]
            for group in groups:
                claims = {}
                for condition in group:
                    claim = self.store.claim(condition, start, stop, timeout=self.timeout)
                    if claim is not None:
                        claims[condition] = claim
                if claims:
                    self.claimed.append((start, stop, claims))
                    yield list(range(start, stop))

    def release_all(self) -> None:
        while self.claimed:
            for claim in self.claimed.popleft()[2].values():
                claim.release()


def run_chunks(store: RunStore, dataset: Dataset, conditions: list[str], evaluate: Evaluate, *,
               chunk_size: int, rank: int = 0, world_size: int = 1, num_workers: int = 0,
               progress: bool = True, desc: str = "eval", repair: bool = False, poll: float = 1.0,
               claim_timeout: float | None = None, claim_each_condition: bool = False) -> RunStats:
    """Evaluate every missing (condition, chunk) of this rank's shard and write its records.

    Written chunks of the shard are verified first (``repair``: damaged ones are deleted and
    recomputed, else :class:`~robust_attn.runs.store.DamagedRecordsError`). Each pair is claimed
    before it is computed; pairs claimed by other live processes are awaited, polling every
    ``poll`` seconds. ``claim_timeout``: seconds after which another host's silent claim counts
    as stale (default ``$ROBUST_ATTN_CLAIM_TIMEOUT`` or 6 hours). ``claim_each_condition``: claim
    and compute a chunk's conditions one at a time (its batch is loaded for each), so that
    processes sharing the run can split the conditions of one chunk; for protocols whose
    conditions each cost far more than loading a batch (an attack at one radius can take an
    hour on a CPU), and whose records do not depend on which conditions share a pass."""
    grid = chunk_grid(len(dataset), chunk_size)
    mine = [grid[i] for i in shard_indices(len(grid), rank, world_size)]
    stats = RunStats()
    stats.repaired = len(store.check_chunks([(c, a, b) for a, b in mine for c in conditions], repair=repair))
    bar = None
    first = True
    try:
        while True:
            pending = []
            for start, stop in mine:
                todo = [c for c in conditions if not store.has_chunk(c, start, stop)]
                if todo:
                    pending.append((start, stop, todo))
            left = sum(len(t) for _, _, t in pending)
            if first:
                stats.skipped = len(mine) * len(conditions) - left
                bar = tqdm(total=left, desc=desc, unit="chunk", disable=not progress, leave=False)
                first = False
            if not pending:
                break
            if _one_pass(store, dataset, pending, evaluate, num_workers, claim_timeout, stats, bar,
                         claim_each_condition) == 0:
                time.sleep(poll)  # the rest is claimed by live processes: wait for them
    finally:
        if bar is not None:
            bar.close()
    stats.by_others = len(mine) * len(conditions) - stats.skipped - stats.computed
    return stats


def _one_pass(store, dataset, pending, evaluate, num_workers, claim_timeout, stats, bar,
              each_condition: bool = False) -> int:
    """Claim and compute what can be claimed of ``pending``; returns the pairs computed."""
    sampler = _ClaimingSampler(store, pending, claim_timeout, each_condition)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers)
    computed = 0
    claims: dict[str, Claim] = {}
    mark = time.perf_counter()   # each chunk's seconds: since the previous write (or the pass's start)
    try:
        for images, labels in _batches(loader):
            start, stop, claims = sampler.claimed.popleft()
            stats.chunks_loaded += 1
            indices = torch.arange(start, stop)
            for condition, records in evaluate(images, torch.as_tensor(labels), indices, list(claims)):
                if condition not in claims:
                    raise RuntimeError(f"evaluate yielded condition {condition!r} it was not asked for")
                now = time.perf_counter()
                store.write_chunk(condition, start, stop, records, seconds=now - mark)
                mark = now
                claims.pop(condition).release()
                for claim in claims.values():  # heartbeat of the conditions still to come
                    claim.touch()
                stats.computed += 1
                computed += 1
                bar.update(1)
            for claim in claims.values():  # asked for but not yielded: left for a later run
                claim.release()
            claims = {}
    finally:
        for claim in claims.values():
            claim.release()
        sampler.release_all()
    return computed


def _batches(loader: DataLoader) -> Iterator:
    for batch in loader:
        yield batch[0], batch[1]


class NonFiniteLogitsError(ValueError):
    """The model returned NaN or infinite logits: a prediction (an argmax over them) would be
    arbitrary, so no record is written from them."""


def finite_logits(logits: torch.Tensor, indices: torch.Tensor, what: str) -> torch.Tensor:
    """``logits`` unchanged when every row is finite; else :class:`NonFiniteLogitsError` naming
    how many images, the first dataset indices and ``what`` was evaluated (e.g. a condition)."""
    bad = ~torch.isfinite(logits.detach()).all(dim=1)
    if bool(bad.any()):
        shown = torch.as_tensor(indices).cpu()[bad.cpu()][:5].tolist()
        raise NonFiniteLogitsError(
            f"the model returned NaN or infinite logits on {int(bad.sum())} of {len(bad)} images ({what}; "
            f"dataset indices {shown}{' ...' if int(bad.sum()) > 5 else ''}): their predictions would be "
            f"arbitrary, so nothing of this batch is recorded. Check the model on clean images: a "
            f"checkpoint that does not load as trained (`robust-attn zoo verify`) or a model whose "
            f"BatchNorm statistics were not trained (e.g. saved after a few steps) gives such outputs")
    return logits


def topk_hits(logits: torch.Tensor, labels: torch.Tensor, k: int = 5) -> torch.Tensor:
    """1 where ``labels`` is among the ``k`` largest logits (all classes when fewer than ``k``)."""
    k = min(k, logits.shape[1])
    return (logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).long()


def open_run(out_dir, run_info: dict, *, protocol: str, parameters: dict, conditions: list,
             num_images: int, chunk_size: int, rank: int = 0, extra: dict | None = None,
             repair: bool = False, device=None) -> RunStore:
    """Create or resume the run directory ``out_dir``: rank 0 writes (or checks) ``run.json``,
    the other ranks wait for it and check it. ``run_info`` is the caller's part of the
    description (model, checkpoint, dataset, seed, command line, versions). ``repair``: rank 0
    deletes damaged record chunks (:meth:`~robust_attn.runs.store.RunStore.repair`) so that they
    are computed again. Rank 0 then adopts the finished chunks of the same computation from the
    runs of this name that a ``reuse.json`` beside ``out_dir`` names (:mod:`robust_attn.runs.adopt`).
    ``device``: where this process computes, recorded in ``run.json`` (unless ``run_info`` names
    one) and in each chunk it writes
    (:meth:`~robust_attn.runs.store.RunStore.computed_on`)."""
    from robust_attn.distributed import barrier

    description = dict(run_info)
    if device is not None:
        description.setdefault("device", str(device))
    description.update(protocol=protocol, parameters=parameters, conditions=conditions,
                       num_images=int(num_images), chunk_size=int(chunk_size), **(extra or {}))
    description.setdefault("versions", library_versions())
    store = RunStore(out_dir)
    if num_images == 0:
        raise ValueError("the dataset is empty; check --split and --limit")
    if rank == 0:
        store.open(description)
        if repair:
            store.repair()
        for source in reuse_sources(out_dir):   # the same computation in another folder of runs
            adopt_records(store, source, log=lambda line: print(line, file=sys.stderr, flush=True))
    barrier()
    if rank != 0:
        store.open(description, write=False)
    return store
