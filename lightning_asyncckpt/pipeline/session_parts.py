"""The small values :class:`~lightning_asyncckpt.pipeline.pipeline.SaveSession` is handed or keeps: the
:class:`Instruments` a save runs with, this rank's :class:`SaveCalls`, and the :class:`AttachedTier` protocol
of the local tier's run it holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from lightning_asyncckpt.faults.policy import FaultPolicy


class AttachedTier(Protocol):
    """What the session asks of the local tier's run (``tiers.tier_run.TierRun``) that it holds."""

    def wait_copy(self) -> None:
        """(every rank, before the optimizer step) Waits for a lazy local save's copy."""

    def take(self, key: Path | str) -> dict[str, object] | None:
        """(every rank, at a load) The checkpoint the tier's recovery fetched for ``key``, once; else None."""


@dataclass(frozen=True)
class Instruments:
    """What a test or a user's CI puts into a save (``AsyncCheckpointIO``'s ``faults``, ``write_hook`` and
    ``copy_hook``, read at each save).

    Attributes:
        faults: where injected faults come from (:mod:`lightning_asyncckpt.testing`).
        write_hook: picklable; the worker calls it with the buckets before writing.
        copy_hook: a lazy snapshot's copy thread calls it before copying (``testing.HoldCopy``).
    """

    faults: FaultPolicy
    write_hook: Callable[[list], None] | None = None
    copy_hook: Callable[[], None] | None = None


@dataclass
class SaveCalls:
    """This rank's save calls, counted from 1 as each begins (what injected faults target), and those of
    them that committed (the run's committer adds to ``committed``)."""

    scheduled: int = 0
    committed: set[int] = field(default_factory=set)

    def next(self) -> int:
        self.scheduled += 1
        return self.scheduled

    def settled(self, mark: int, since: int, unsettled: list[int]) -> bool | None:
        """``None`` while a call numbered ``since + 1`` to ``mark`` is in ``unsettled``; else whether each committed."""
        if any(since < call <= mark for call in unsettled):
            return None
        return all(call in self.committed for call in range(since + 1, mark + 1))
