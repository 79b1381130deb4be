"""Retention: the checkpoints Lightning asked to remove (top-k), and the partial directories of failed
collective saves, removed once it is safe.

A removal waits for every save scheduled before it to commit, so that a checkpoint still being written is
never deleted and the newest committed one stays until a newer one commits. Every method here runs on the
training thread of the rank that owns the run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from lightning_asyncckpt.storage import commit

Remover = Callable[[Path | str, str], None]  # (path, what it is, for the log): removes now or in the background


class Removal(NamedTuple):
    """A checkpoint to remove once the save of order ``after`` (the newest scheduled when it was asked
    for) has committed on this rank."""

    path: Path | str
    after: int


class Retention:
    """This rank's removals, and the newest save committed here that they wait for."""

    def __init__(self, remove: Remover) -> None:
        """Args:
            remove: removes one checkpoint (``RemoteOps.remove``: a local one now, a remote one in the
                background).
        """
        self._remove = remove
        self._waiting: list[Removal] = []
        self._held = False  # deferred logger calls come first (see logger_relay)
        self._doomed: list[Path] = []  # partial dirs of failed collective saves (coordinator)
        self._newest_ok = 0  # the order of the newest save committed on this rank

    @property
    def newest_committed(self) -> int:
        return self._newest_ok

    def request(self, path: Path | str, after: int) -> None:
        """(the ranks Lightning calls ``remove_checkpoint`` on) ``path`` goes once the save of order
        ``after`` and every one before it have committed.

        Args:
            path: the checkpoint to remove.
            after: the order of the newest save scheduled so far on this rank.
        """
        self._waiting.append(Removal(path, after))
        self._run()

    def committed(self, order: int) -> None:
        """(this rank, at each commit) The save of ``order`` committed: the removals that waited for it run."""
        self._newest_ok = order
        self._run()

    def hold(self, held: bool) -> None:
        """(this rank; the logger relay) While held, removals wait; releasing runs those that may run."""
        self._held = held
        if not held:
            self._run()

    def doom(self, tmp: Path) -> None:
        """(the coordinator) A failed collective save's directory, removed once every rank has stopped
        writing into it (:meth:`remove_doomed`)."""
        self._doomed.append(tmp)

    def remove_doomed(self) -> None:
        """(the coordinator, once every rank has stopped its writers) Removes the failed saves' directories."""
        doomed, self._doomed = self._doomed, []
        for tmp in doomed:
            commit.try_remove(tmp, "the failed save")

    def close(self) -> None:
        """(this rank, as the run closes) The failed saves' directories go, and every removal whose save
        committed runs, held or not: nothing is left waiting for a run that is over."""
        self.remove_doomed()
        waiting, self._waiting = self._waiting, []
        for removal in waiting:
            if removal.after <= self._newest_ok:
                self._remove(removal.path, "the checkpoint")

    def _run(self) -> None:
        if self._held:
            return  # the logger relay has calls to make first (``SaveSession.hold_removals``)
        keep = []
        for removal in self._waiting:
            if removal.after <= self._newest_ok:
                self._remove(removal.path, "the checkpoint that ModelCheckpoint removed")
            else:
                keep.append(removal)
        self._waiting = keep
