"""The only module of the persistent pipeline that runs collectives (the local tier runs its own, on
gloo groups of its own, in :mod:`lightning_asyncckpt.tiers`).

It decides the device of control-plane tensors (gloo: CPU, NCCL: CUDA) in one place, and works
without a process group (a single-device Trainer has none): then every call is local.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def control_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device that small agreement tensors must live on for ``group``'s backend."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Agreement:
    """Cross-rank agreement over ``group`` (the default group when ``None``).

    Every method must be called by all ranks of the group, in the same order.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group

    @classmethod
    def alone(cls) -> Agreement:
        """An agreement of this rank with itself: never collective (a rank that must not wait for others)."""
        return _Alone()

    @property
    def active(self) -> bool:
        return is_distributed() and self.group_alive() and dist.get_world_size(self.group) > 1

    def group_alive(self) -> bool:
        """False for a group of a process group destroyed since (and perhaps made anew): its size still
        reads, but it can no longer be used."""
        if self.group is None:
            return is_distributed()
        try:
            dist.get_process_group_ranks(self.group)
        except (KeyError, ValueError, RuntimeError):
            return False
        return True

    @property
    def rank(self) -> int:
        return dist.get_rank() if is_distributed() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if is_distributed() else 1

    def all_max(self, values: list[int]) -> list[int]:
        """(all ranks) Element-wise maximum of small integer vectors."""
        if not self.active:
            return list(values)
        return self._all_max(values)

    def _all_max(self, values: list[int]) -> list[int]:
        # the collective itself, also at world size 1 (where the tests of both backends run it)
        t = torch.tensor(values, dtype=torch.int64, device=control_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    def exit_side(self, timeout_s: float) -> Agreement:
        """(all ranks, together) A gloo group over the same ranks whose collectives fail after
        ``timeout_s`` instead of waiting forever: for agreeing on the way out of an exception, when a
        rank may never arrive. It works beside NCCL, and its tensors live on the CPU."""
        ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
        group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return Agreement(group)

    def all_gather(self, obj: Any) -> list[Any]:
        """(all ranks) Every rank's ``obj``, in rank order."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out


class _Alone(Agreement):
    @property
    def active(self) -> bool:
        return False
