"""The collectives of planning a DCP save: DCP's own gather of the ranks' local plans to the coordinator and
scatter of the global plan back (``reduce_scatter``), through DCP's ``_DistWrapper`` as ``dcp.save`` runs it.

Kept apart from the package's other modules, which do not import ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch.distributed.checkpoint.utils import _DistWrapper

T = TypeVar("T")  # one rank's local plan
R = TypeVar("R")  # one rank's part of the global plan


class PlanRound:
    """One save's planning over the default group, rank 0 the coordinator; ``distributed=False``: this rank
    plans alone, with no collective (rank 0 of a world of one)."""

    def __init__(self, distributed: bool) -> None:
        self._wrapper = _DistWrapper(None, distributed, 0)

    @property
    def rank(self) -> int:
        return self._wrapper.rank

    @property
    def world_size(self) -> int:
        return self._wrapper.get_world_size()

    @property
    def is_coordinator(self) -> bool:
        return self._wrapper.is_coordinator

    def reduce_scatter(self, local_step: Callable[[], T], global_step: Callable[[list[T]], list[R]]) -> R:
        """(all ranks of the default group, same order, when distributed) Every rank's ``local_step()`` gathered
        to the coordinator, its ``global_step(plans)`` scattered back: this rank's part. An exception in either
        step on any rank is raised on every rank (DCP's ``CheckpointException``), so none is left waiting."""
        return self._wrapper.reduce_scatter("plan", local_step, global_step)
