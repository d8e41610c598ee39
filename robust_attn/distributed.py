"""torchrun helpers: one process group from the environment, rank and world size, shards.

Under ``torchrun --nproc_per_node=N`` the environment carries ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; :func:`init_distributed` joins the process group (NCCL when CUDA is there,
gloo otherwise). Run as a plain process it does nothing and returns ``(0, 1, device)``.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["init_distributed", "is_distributed", "rank", "world_size", "is_main_process", "barrier",
           "shard_indices", "cleanup"]


def _env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: str | torch.device | None = None) -> tuple[int, int, torch.device]:
    """Join the torchrun process group if there is one; return ``(rank, world_size, device)``.

    ``device``: ``None`` picks ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU; an
    explicit ``"cuda"`` under torchrun becomes ``cuda:LOCAL_RANK`` so ranks do not share a GPU.
    Calling it twice is harmless.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a device torch knows; give cpu, cuda, cuda:1 or mps") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {device} is not supported here; give cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} was asked for but CUDA is not available here; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(f"--device {device} was asked for but MPS is not available here; use --device cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank if _env_world_size() > 1 else torch.cuda.current_device())
    if _env_world_size() > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return rank(), world_size(), device


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def cleanup() -> None:
    if is_distributed():
        dist.destroy_process_group()


def shard_indices(n: int, rank: int, world_size: int) -> list[int]:
    """The items of ``range(n)`` that ``rank`` of ``world_size`` processes takes: every
    ``world_size``-th one starting at ``rank``. Shards are disjoint and together cover ``range(n)``;
    a rank may get one item fewer than another."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    return list(range(rank, n, world_size))
