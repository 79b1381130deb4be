"""The pending queue: this rank's saves between scheduling and commit, and its invariants.

- Saves are kept in the order they were scheduled (``order`` grows by one per save).
- A single-writer save commits on this rank alone, and only once every save before it has committed
  (so the newest committed checkpoint is always the newest scheduled one that succeeded).
- A save that all ranks write (distributed or sharded) leaves the queue only when the ranks commit it
  together; once this rank's part is on disk (``written``), its staging buffers are free again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_asyncckpt import engines
from lightning_asyncckpt.faults.policy import NO_FAULTS, SaveFaults


@dataclass(eq=False)  # compared by identity
class PendingSave:
    order: int  # local FIFO position
    seq: int | None  # the save's number in the cross-rank count, None if no rank counted it
    path: Path | str  # a remote URL as a str (see ``remote``)
    tmp: Path | str  # where the worker writes; for a remote save the URL itself (visible only complete)
    ticket: engines.Ticket
    plan: Any  # dcp_plan.WritePlan
    result_path: Path
    buffer_set: Any
    stall_s: float
    nbytes: int
    step: int | None = None  # the checkpoint's global_step, for the record
    collective: bool = False  # every rank writes a part; committed by all ranks together
    writes_file: bool = False  # one torch.save file (stock's format), not a DCP directory
    file_nbytes: int = 0  # the file's size, as the worker reported it
    faults: SaveFaults = NO_FAULTS
    write_s: float = 0.0
    written: list | None = None  # a collective save's local write results, once this rank's part is on disk
    started: float = field(default_factory=time.monotonic)
    call: int = 0  # the save call of this rank it came from (``SavePipeline.saves_scheduled``)
    lazy_nbytes: int = 0  # bytes its lazy snapshot copied after the save call returned
    # A lazy single-writer save is handed over inside the save call, its worker waiting at ``gate``
    # (gate.Gate) until ``copy`` (lazy.BackgroundCopy) is proven. ``behind_gate`` until the training thread
    # has settled the copy (scheduler.finish_copy); a save whose worker is lost meanwhile is handed over
    # again then (``lost_worker``: its buffers still hold its snapshot). ``abandoned``: its copy failed and
    # was reported; its worker skips it and nothing is committed.
    copy: Any = None
    gate: Any = None
    behind_gate: bool = False
    lost_worker: bool = False
    abandoned: bool = False

    @property
    def copy_running(self) -> bool:
        """Its lazy copy's thread may still write into its buffers (only an abandoned copy: a proven one has
        ended, or is ending, before its worker reads them)."""
        return self.copy is not None and not self.copy.done()

    @property
    def remote(self) -> bool:
        """Written to an object store: nothing to publish or clean up locally (an unfinished upload is
        never visible; the worker discards a failed one)."""
        return isinstance(self.path, str)


class PendingQueue:
    """This rank's pending saves, oldest first."""

    def __init__(self) -> None:
        self._saves: deque[PendingSave] = deque()

    def __len__(self) -> int:
        return len(self._saves)

    def __iter__(self) -> Iterator[PendingSave]:
        return iter(list(self._saves))

    def append(self, save: PendingSave) -> None:
        self._saves.append(save)

    def remove(self, save: PendingSave) -> None:
        self._saves.remove(save)

    def __contains__(self, save: PendingSave) -> bool:
        return any(s is save for s in self._saves)

    def head(self) -> PendingSave | None:
        return self._saves[0] if self._saves else None

    def unwritten(self) -> list[PendingSave]:
        """Saves whose part on this rank is still being written (each holds a copy of the state)."""
        return [s for s in self._saves if s.written is None]

    def next_to_poll(self, until: int | None = None) -> PendingSave | None:
        """The oldest save still being written here, if it may be settled now: a single-writer save only
        at the head of the queue (after the collective saves before it commit), and not past ``until``."""
        save = next((s for s in self._saves if s.written is None), None)
        if save is None or (until is not None and save.order > until):
            return None
        if not save.collective and save is not self._saves[0]:
            return None
        return save

    def ready_through(self, announced: int) -> int:
        """The highest counted save up to which every save is committed here or, if collective, written."""
        return min((s.seq for s in self._saves if s.seq is not None and s.written is None), default=announced + 1) - 1

    def solo_waiting(self) -> list[PendingSave]:
        """The saves this rank commits alone, in order: those before the first collective one."""
        out = []
        for save in self._saves:
            if save.collective:
                break
            out.append(save)
        return out

    def take_where(self, pred: Callable[[PendingSave], bool]) -> list[PendingSave]:
        """Removes and returns the saves for which ``pred`` holds, keeping the others in order."""
        taken = [s for s in self._saves if pred(s)]
        self._saves = deque(s for s in self._saves if not pred(s))
        return taken
