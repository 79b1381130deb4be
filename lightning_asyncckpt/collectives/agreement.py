"""Agreeing on a few integers: one all-reduce that gives every rank the same maxima and minima.

Minima ride in the same all-reduce as maxima, negated (the maximum of negated values is the negated minimum):
:func:`max_min` is the one place that does this, so that callers name what they want the highest of and
what they want the lowest of.

:class:`Agreement` is the persistent pipeline's: over the training's group (or a bounded exit group),
on the device its backend wants, and local where there is no group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from lightning_asyncckpt.collectives import groups, objects
from lightning_asyncckpt.collectives.groups import ProcessGroup

T = TypeVar("T")  # a picklable value each rank contributes

AllMax = Callable[[list[int]], list[int]]
"""An element-wise maximum over ranks of a small integer vector (:meth:`Agreement.all_max`)."""


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed on: the element-wise ``most`` (maxima) and ``least`` (minima) over every rank,
    in the order they were given."""

    most: list[int]
    least: list[int]


def encode(most: Sequence[int], least: Sequence[int]) -> list[int]:
    """The one vector whose element-wise maximum carries both: ``most`` as is, ``least`` negated."""
    return [*(int(v) for v in most), *(-int(v) for v in least)]


def decode(values: Sequence[int], n_most: int) -> Agreed:
    """The inverse of :func:`encode` on the reduced vector (``n_most``: how many maxima come first)."""
    return Agreed([int(v) for v in values[:n_most]], [-int(v) for v in values[n_most:]])


def max_min(all_max: AllMax, most: Sequence[int], least: Sequence[int]) -> Agreed:
    """(all ranks that ``all_max`` reduces over, same order) The maxima of ``most`` and the minima of ``least``
    over every rank, in one all-reduce."""
    return decode(all_max(encode(most, least)), len(most))


class Agreement:
    """Cross-rank agreement over ``group`` (the default group when ``None``).

    Every collective method must be called by all ranks of the group, in the same order.
    """

    def __init__(self, group: ProcessGroup | None = None):
        self.group = group

    @classmethod
    def alone(cls) -> Agreement:
        """An agreement of this rank with itself: never collective (a rank that must not wait for others)."""
        return _Alone()

    @property
    def active(self) -> bool:
        """(any rank, local) Whether the methods talk to other ranks: a live group of more than one rank."""
        return groups.is_distributed() and self.group_alive() and dist.get_world_size(self.group) > 1

    def group_alive(self) -> bool:
        """False for a group of a process group destroyed since (and perhaps made anew): its size still
        reads, but it can no longer be used."""
        return groups.group_alive(self.group)

    @property
    def rank(self) -> int:
        """This process's global rank (0 without a process group)."""
        return groups.rank()

    @property
    def world_size(self) -> int:
        """The number of ranks of the group (1 without a process group)."""
        return groups.world_size(self.group)

    def all_max(self, values: list[int]) -> list[int]:
        """(all ranks of the group, same order) Element-wise maximum of small integer vectors."""
        if not self.active:
            return list(values)
        return self._all_max(values)

    def _all_max(self, values: list[int]) -> list[int]:
        # the collective itself, also at world size 1 (where the tests of both backends run it)
        t = torch.tensor(values, dtype=torch.int64, device=groups.control_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    def max_min(self, most: Sequence[int], least: Sequence[int]) -> Agreed:
        """(all ranks of the group, same order) The maxima of ``most`` and the minima of ``least`` over every
        rank, in one all-reduce (:func:`max_min`)."""
        return max_min(self.all_max, most, least)

    def exit_side(self, timeout_s: float) -> Agreement:
        """(all ranks of the default group, together) A gloo group over the same ranks whose collectives fail
        after ``timeout_s`` instead of waiting forever: for agreeing on the way out of an exception, when a
        rank may never arrive. It works beside NCCL, and its tensors live on the CPU."""
        ranks = None if self.group is None else groups.group_ranks(self.group)
        return Agreement(groups.bounded_group(timeout_s, ranks))

    def all_gather(self, obj: T) -> list[T]:
        """(all ranks of the group, same order) Every rank's ``obj``, in rank order.

        Args:
            obj: this rank's value (picklable).

        Returns:
            One value per rank of the group, in rank order (``[obj]`` without a group)."""
        if not self.active:
            return [obj]
        return objects.all_gather_object(obj, self.group)


class _Alone(Agreement):
    @property
    def active(self) -> bool:
        return False
