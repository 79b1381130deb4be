"""Who takes part: whether a process group exists, this rank's place in it, and the gloo groups with a
bound that the tiers agree over.

Every other module asks here, never ``torch.distributed`` itself. Without a process group (a single-device
Trainer has none) a rank is rank 0 of a world of one.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["ProcessGroup", "bounded_group", "bounded_groups", "control_device", "group_alive", "group_ranks",
           "is_distributed", "rank", "world_size"]


def is_distributed() -> bool:
    """(any rank, local) True once the training's process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """(any rank, local) This process's global rank; 0 without a process group."""
    return dist.get_rank() if is_distributed() else 0


def world_size(group: ProcessGroup | None = None) -> int:
    """(any rank, local) The number of ranks in ``group`` (the default group when None); 1 without a process
    group."""
    return dist.get_world_size(group) if is_distributed() else 1


def group_ranks(group: ProcessGroup) -> list[int]:
    """(a member of ``group``, local) The global ranks of ``group``, in group-rank order."""
    return dist.get_process_group_ranks(group)


def group_alive(group: ProcessGroup | None) -> bool:
    """(any rank, local) False for a group of a process group destroyed since (and perhaps made anew): its size
    still reads, but it can no longer be used. None (the default group): whether one exists."""
    if group is None:
        return is_distributed()
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def control_device(group: ProcessGroup | None = None) -> torch.device:
    """(any rank, local) The device that small agreement tensors must live on for ``group``'s backend (gloo:
    the CPU; NCCL: this rank's CUDA device)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def bounded_group(timeout_s: float, ranks: list[int] | None = None) -> ProcessGroup:
    """(all ranks of the default group, same order: making a group is collective, also for a rank outside
    ``ranks``) A gloo group over ``ranks`` (every rank when None) whose collectives fail after ``timeout_s``
    instead of waiting forever for a rank that is gone. It works beside NCCL, and its tensors live on the CPU."""
    return dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def bounded_groups(rank_lists: list[list[int]], timeout_s: float) -> list[ProcessGroup]:
    """(all ranks of the default group, same order) One :func:`bounded_group` per list of ``rank_lists`` (the
    tier's cliques), every rank making every group in the same order as ``torch.distributed`` requires."""
    return [bounded_group(timeout_s, ranks) for ranks in rank_lists]
