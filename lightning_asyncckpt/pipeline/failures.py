"""The failure log: which saves failed on this rank, and how failures become one error on every rank."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch.distributed.checkpoint.api import CheckpointException

from lightning_asyncckpt.collectives.agreement import Agreement
from lightning_asyncckpt.errors import CheckpointWriteError, RankFailure

log = logging.getLogger(__name__)


@dataclass
class Failed:
    """One failed save on this rank. ``seq`` is the save's number in the cross-rank count, so that the
    saves before it still commit; ``None`` only for a save no rank counted (it sorts after all)."""

    order: int
    path: str
    failure: RankFailure
    seq: int | None = None


def filesystem_failures(e: BaseException, rank: int) -> list[RankFailure] | None:
    """A save-time error that is a write failure (the filesystem refused), as rank failures; ``None`` for
    bad input, which is raised as it is."""
    if isinstance(e, CheckpointException):  # DCP's planning: the original error of each failing rank
        return [RankFailure.from_exception(r, exc) for r, (exc, _tb) in sorted(e.failures.items())]
    if isinstance(e, OSError) and not isinstance(e, (FileExistsError, IsADirectoryError, NotADirectoryError)):
        return [RankFailure.from_exception(rank, e)]
    return None


class FailureLog:
    """This rank's failed saves, oldest first, until they are raised (or dropped on the way out)."""

    def __init__(self) -> None:
        self._failed: list[Failed] = []

    def __bool__(self) -> bool:
        return bool(self._failed)

    def record(self, failed: Failed) -> None:
        self._failed.append(failed)

    def first_failed_seq(self, after_all: int) -> int:
        """The lowest counted save that failed here; ``after_all`` when none did (or none was counted)."""
        return min((f.seq if f.seq is not None else after_all for f in self._failed), default=after_all)

    def for_path(self, path: str) -> Failed | None:
        return next((f for f in self._failed if f.path == path), None)

    def clear(self) -> None:
        """On the way out: each failure was logged when recorded, and is not raised later."""
        self._failed = []

    def raise_local(self) -> None:
        """(this rank, no collectives) Raises the oldest failure, naming the others."""
        if self._failed:
            first, rest = self._failed[0], self._failed[1:]
            self._failed = []
            raise CheckpointWriteError(first.path, [first.failure], note=more_note([f.path for f in rest]))

    def gather(self, agreement: Agreement) -> CheckpointWriteError:
        """(all ranks) Every rank learns every rank's failures; returns the same error on every rank."""
        mine = [(f.path, f.failure) for f in self._failed]
        self._failed = []
        gathered = [item for per_rank in agreement.all_gather(mine) for item in per_rank]
        by_path: dict[str, list[RankFailure]] = {}
        for p, failure in gathered:
            by_path.setdefault(p, []).append(failure)
        (path, failures), *rest = by_path.items()
        return CheckpointWriteError(path, failures, note=more_note([p for p, _ in rest]))


def more_note(paths: list[str]) -> str:
    return f"Saves to {paths} failed too." if paths else ""
