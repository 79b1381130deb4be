"""The pending queue: this rank's saves between scheduling and commit, and its invariants.

- Saves are kept in the order they were scheduled (``order`` grows by one per save).
- A single-writer save commits on this rank alone, and only once every save before it has committed
  (so the newest committed checkpoint is always the newest scheduled one that succeeded).
- A save that all ranks write (distributed or sharded) leaves the queue only when the ranks commit it
  together; once this rank's part is on disk (``written``), its staging buffers are free again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from lightning_asyncckpt.pipeline.save import Save, SaveState


class PendingQueue:
    """This rank's pending saves, oldest first."""

    def __init__(self) -> None:
        self._saves: deque[Save] = deque()

    def __len__(self) -> int:
        return len(self._saves)

    def __iter__(self) -> Iterator[Save]:
        return iter(list(self._saves))

    def append(self, save: Save) -> None:
        self._saves.append(save)

    def remove(self, save: Save) -> None:
        self._saves.remove(save)

    def __contains__(self, save: Save) -> bool:
        return any(s is save for s in self._saves)

    def head(self) -> Save | None:
        return self._saves[0] if self._saves else None

    def unwritten(self) -> list[Save]:
        """Saves whose part on this rank is still being written (each holds a copy of the state)."""
        return [s for s in self._saves if s.state is not SaveState.WRITTEN]

    def next_to_poll(self, until: int | None = None) -> Save | None:
        """The oldest save still being written here, if it may be settled now: a single-writer save only
        at the head of the queue (after the collective saves before it commit), and not past ``until``."""
        save = next((s for s in self._saves if s.state is not SaveState.WRITTEN), None)
        if save is None or (until is not None and save.order > until):
            return None
        if not save.collective and save is not self._saves[0]:
            return None
        return save

    def ready_through(self, announced: int) -> int:
        """The highest counted save up to which every save is committed here or, if collective, written."""
        return min((s.seq for s in self._saves if s.seq is not None and s.state is not SaveState.WRITTEN), default=announced + 1) - 1

    def solo_waiting(self) -> list[Save]:
        """The saves this rank commits alone, in order: those before the first collective one."""
        out = []
        for save in self._saves:
            if save.collective:
                break
            out.append(save)
        return out

    def take_all(self) -> list[Save]:
        """Removes and returns every save, oldest first."""
        taken, self._saves = list(self._saves), deque()
        return taken

    def take_where(self, pred: Callable[[Save], bool]) -> list[Save]:
        """Removes and returns the saves for which ``pred`` holds, keeping the others in order."""
        taken = [s for s in self._saves if pred(s)]
        self._saves = deque(s for s in self._saves if not pred(s))
        return taken
