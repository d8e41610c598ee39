"""The run loop every protocol shares: chunks, shards, resumption, progress.

The dataset is cut into chunks of ``chunk_size`` consecutive items (one batch each). Under
``torchrun`` rank ``r`` of ``W`` takes chunks ``r, r + W, r + 2W, ...``
(:func:`robust_attn.distributed.shard_indices` over the chunk list). For each chunk the
protocol's ``evaluate`` callback gets the batch and the conditions still missing for it and
yields ``(condition, records)`` pairs, each written at once as an atomic chunk file; a chunk
with every condition written is not even loaded again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from robust_attn.distributed import shard_indices
from robust_attn.results import RunStore, library_versions

__all__ = ["RunStats", "chunk_grid", "run_chunks", "topk_hits", "open_run"]

Evaluate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list], Iterable[tuple[str, pd.DataFrame]]]


@dataclass
class RunStats:
    """What one call of :func:`run_chunks` did (for this rank)."""

    computed: int = 0  # (condition, chunk) pairs written now
    skipped: int = 0  # (condition, chunk) pairs found already written
    chunks_loaded: int = 0  # batches read from the dataset


def chunk_grid(n: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[(0, c), (c, 2c), ..., (.., n)]``: the chunk boundaries; independent of the world size."""
    if chunk_size < 1:
        raise ValueError(f"batch size must be positive, got {chunk_size}")
    return [(a, min(a + chunk_size, n)) for a in range(0, n, chunk_size)]


def run_chunks(store: RunStore, dataset: Dataset, conditions: list[str], evaluate: Evaluate, *,
               chunk_size: int, rank: int = 0, world_size: int = 1, num_workers: int = 0,
               progress: bool = True, desc: str = "eval") -> RunStats:
    """Evaluate every missing (condition, chunk) of this rank's shard and write its records."""
    grid = chunk_grid(len(dataset), chunk_size)
    mine = [grid[i] for i in shard_indices(len(grid), rank, world_size)]
    stats = RunStats()
    pending: list[tuple[int, int, list[str]]] = []
    for start, stop in mine:
        todo = [c for c in conditions if not store.has_chunk(c, start, stop)]
        stats.skipped += len(conditions) - len(todo)
        if todo:
            pending.append((start, stop, todo))
    if not pending:
        return stats
    loader = DataLoader(dataset, batch_sampler=[list(range(a, b)) for a, b, _ in pending],
                        num_workers=num_workers)
    bar = tqdm(total=sum(len(t) for _, _, t in pending), desc=desc, unit="chunk",
               disable=not progress, leave=False)
    try:
        for (start, stop, todo), (images, labels) in zip(pending, _batches(loader)):
            stats.chunks_loaded += 1
            indices = torch.arange(start, stop)
            for condition, records in evaluate(images, torch.as_tensor(labels), indices, todo):
                if condition not in todo:
                    raise RuntimeError(f"evaluate yielded condition {condition!r} it was not asked for")
                store.write_chunk(condition, start, stop, records)
                stats.computed += 1
                bar.update(1)
    finally:
        bar.close()
    return stats


def _batches(loader: DataLoader) -> Iterator:
    for batch in loader:
        yield batch[0], batch[1]


def topk_hits(logits: torch.Tensor, labels: torch.Tensor, k: int = 5) -> torch.Tensor:
    """1 where ``labels`` is among the ``k`` largest logits (all classes when fewer than ``k``)."""
    k = min(k, logits.shape[1])
    return (logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).long()


def open_run(out_dir, run_info: dict, *, protocol: str, parameters: dict, conditions: list,
             num_images: int, chunk_size: int, rank: int = 0, extra: dict | None = None) -> RunStore:
    """Create or resume the run directory ``out_dir``: rank 0 writes (or checks) ``run.json``,
    the other ranks wait for it and check it. ``run_info`` is the caller's part of the
    description (model, checkpoint, dataset, seed, command line, versions)."""
    from robust_attn.distributed import barrier

    description = dict(run_info)
    description.update(protocol=protocol, parameters=parameters, conditions=conditions,
                       num_images=int(num_images), chunk_size=int(chunk_size), **(extra or {}))
    description.setdefault("versions", library_versions())
    store = RunStore(out_dir)
    if num_images == 0:
        raise ValueError("the dataset is empty; check --split and --limit")
    if rank == 0:
        store.open(description)
    barrier()
    if rank != 0:
        store.open(description, write=False)
    return store
