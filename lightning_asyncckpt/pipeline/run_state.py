"""``Run``: the state of one run of saves, made when saving starts and dropped when it stops.

A run is made of small parts, each owning its state and changed only through its methods: the writers
(``workers.Workers``: the engine and the scratch directory), the stager's buffers, the pending queue, the
failure log, the cross-rank save count (:class:`SaveCount`), the names of its hidden directories and
their token (``temp_names.TempNames``), retention (``retention.Retention``), the object-store thread and
its publishes (``remote_ops.RemoteOps``), and the lazy snapshot being copied. One place makes all of it
and one place (:meth:`Run.close`) lets all of it go, so that nothing of an earlier run (a Trainer's
``fit`` before a ``test``, a torn-down plugin saving once more) leaks into the next.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from lightning_asyncckpt import engines
from lightning_asyncckpt.pipeline.failures import FailureLog
from lightning_asyncckpt.pipeline.pending import PendingQueue
from lightning_asyncckpt.pipeline.plan_cache import PlanCache
from lightning_asyncckpt.pipeline.records import Ledger, SaveRecord
from lightning_asyncckpt.pipeline.remote_ops import RemoteOps
from lightning_asyncckpt.pipeline.retention import Retention
from lightning_asyncckpt.pipeline.save import Save, SaveState
from lightning_asyncckpt.pipeline.temp_names import TempNames
from lightning_asyncckpt.pipeline.workers import Workers
from lightning_asyncckpt.snapshot.lazy import TrackedState
from lightning_asyncckpt.snapshot.staging import Stager
from lightning_asyncckpt.storage import commit
from lightning_asyncckpt.storage.destination import Destination

log = logging.getLogger(__name__)

COPY_AT_CLOSE_S = 300.0  # a memcpy of the state: far longer than it ever takes


@dataclass
class SaveCount:
    """The cross-rank count of saves. Lightning calls the plugin on global rank 0 only, so every rank
    counts the saves it is told of (``announced``); a save takes its number (``claim``) when it is made;
    ``reported`` is how far every rank has agreed that the saves are settled."""

    announced: int = 0
    consumed: int = 0
    reported: int = 0

    def claim(self, collective: bool) -> int | None:
        """(the saving ranks, when a save starts) The save's number: the announced one, or for a collective
        save that nobody announced (Fabric), the next one (every rank is here)."""
        if self.announced > self.consumed:
            self.consumed = self.announced
            return self.announced
        if collective:
            self.announced += 1
            self.consumed = self.announced
            return self.announced
        return None

    def announce(self) -> None:
        """(all ranks, as Lightning builds a checkpoint) A save that the plugin will be called for on some rank."""
        self.announced += 1

    def agreed_through(self, seq: int) -> None:
        """(all ranks, in finalize) Every rank agreed that the saves up to ``seq`` are settled."""
        self.reported = max(self.reported, seq)

    def unsettled(self) -> bool:
        return self.announced > self.reported

    def all_reported(self) -> bool:
        return self.reported >= self.announced

    def settle_all(self) -> None:
        self.reported = self.consumed = self.announced


class Unsettled(NamedTuple):
    """A save not yet committed or failed: where it goes, and the save call it came from."""

    path: Path | str
    call: int


class Run:
    """One run of saves on this rank. Its parts are public for the pipeline's steps to call; each changes
    its own state only."""

    def __init__(self, engine_name: engines.EngineName, worker_mode: engines.WorkerMode, history: list[SaveRecord],
                 committed_calls: set[int] | None = None, *, worker_nice: int = 0, tracked: TrackedState | None = None,
                 engine: engines.Engine | None = None) -> None:
        """Args:
            engine_name, worker_mode, worker_nice: the writers (``Settings``).
            history, committed_calls: the plugin's records and committed save calls, shared: they outlive the run.
            tracked: what a lazy snapshot may copy later (the plugin's, for every run).
            engine: an engine made already (tests give a fake one); else made at the first save.
        """
        persistent = worker_mode is engines.WorkerMode.PERSISTENT
        self.workers = Workers(engine_name, worker_mode, worker_nice, engine)
        self.ledger = Ledger(history, committed_calls)
        self.tracked = tracked if tracked is not None else TrackedState()
        self.stager = Stager(shared=persistent, copy_cpu=persistent)
        self.plans = PlanCache()  # collective saves' plans, reused while the structure holds
        self.count = SaveCount()
        self.names = TempNames()
        self.pending = PendingQueue()
        self.failures = FailureLog()
        self.remote = RemoteOps()
        self.retention = Retention(self.remote.remove)
        self._copying: Save | None = None  # the lazy copy not settled yet (one at most: a save waits for it)

    # -- read ------------------------------------------------------------------------------------------
    @property
    def engine(self) -> engines.Engine | None:
        return self.workers.engine

    @property
    def results_dir(self) -> Path | None:
        return self.workers.results_dir

    @property
    def history(self) -> list[SaveRecord]:
        return self.ledger.history

    @property
    def order(self) -> int:
        """The order of the newest save scheduled on this rank."""
        return self.names.order

    @property
    def copying(self) -> Save | None:
        """The save whose lazy copy is not settled yet, if any (``settle_copy.finish_copy`` settles it)."""
        return self._copying

    # -- the run's life --------------------------------------------------------------------------------
    def start(self, rank: int, dirpath: Destination | None) -> engines.Engine:
        """(writing ranks, as a save starts) The engine (its worker starts at the first write or
        ``warmup``), the results directory, and ``dirpath`` swept of dead saves' leftovers
        (:meth:`TempNames.sweep`).

        Returns:
            The run's engine.
        """
        engine = self.workers.start(rank)
        self.names.sweep(rank, dirpath)
        return engine

    def prepare(self, like: dict, rank: int, world_size: int) -> None:
        """Allocates staging buffers for checkpoints like ``like`` (this rank's share of ``world_size``), once."""
        if not self.stager.buffers():
            nbytes = self.stager.prepare(like, rank=rank, world_size=world_size)
            log.debug("lightning-asyncckpt: prepared %d bytes of staging buffers", nbytes)

    def copy_started(self, save: Save) -> None:
        """(scheduler) ``save``'s lazy copy runs until ``settle_copy.finish_copy`` takes it."""
        self._copying = save

    def take_copy(self) -> Save | None:
        """(settle_copy) The save whose lazy copy is to be settled now; the run holds it no more."""
        save, self._copying = self._copying, None
        return save

    def unsettled(self) -> list[Unsettled]:
        """Every save not yet committed or failed: the pending ones, the lazy snapshot being copied (not yet
        handed to the worker), and remote directories being published."""
        out = [Unsettled(s.path, s.call) for s in [*self.pending, *self.remote.saves()]]
        copying = self._copying
        if copying is not None and copying.state in (SaveState.COPYING, SaveState.LOST):  # not handed over
            out.append(Unsettled(copying.path, copying.call))
        return out

    def worker_pids(self) -> list[int]:
        """PIDs of this run's live writers: the persistent worker, or the forked ones of pending saves."""
        return self.workers.pids(s.ticket for s in self.pending)

    def close(self, rank: int, abort: bool) -> None:
        """(this rank) Stops the worker, drops what is still pending (only left when aborting), runs the
        removals that were waiting for committed saves, and frees every buffer."""
        self._stop_copy()
        try:
            self.workers.stop(abort)
        finally:  # a worker that would not stop cleanly still leaves no buffers or scratch files behind
            self._drop_pending(rank)
            if abort:
                self.failures.clear()  # logged when recorded; an aborted run does not raise them later
            self.retention.close()
            self._drop_publishing()  # after the removals: their remote calls are waited for there
            self.count.settle_all()
            self.stager.clear()
            self.workers.remove_scratch()

    def _stop_copy(self) -> None:
        """Every way out waits for the lazy copy first: a last resort, the save is dropped."""
        save = self.take_copy()
        if save is None:
            return
        assert save.copy is not None
        save.copy.cancel()  # one still waiting for the write before it never starts
        save.copy.wait(COPY_AT_CLOSE_S)  # its thread writes into buffers that go now
        if not save.ended and save not in self.pending:
            save.to(SaveState.DROPPED)

    def _drop_pending(self, rank: int) -> None:
        """The saves still pending (only left when aborting) are dropped, their writers stopped, and their
        hidden paths removed where this rank owns them."""
        dropped = self.pending.take_all()
        for save in dropped:
            if not save.ended:
                save.to(SaveState.DROPPED)
            self.workers.kill(save.ticket)
            if not isinstance(save.tmp, Path):
                continue  # a remote file: an unfinished upload is never visible
            # every rank writes into a collective save's directory (a remote save's parts: this rank's spool)
            if not save.collective or rank == 0 or save.remote:
                commit.try_remove(save.tmp, "the unfinished save")
        if dropped:
            log.warning("lightning-asyncckpt: %d unfinished save(s) dropped", len(dropped))

    def _drop_publishing(self) -> None:
        """The remote directories being published: published (or not) on the way out, unrecorded; each
        one's spool goes."""
        for save in self.remote.close():
            save.to(SaveState.DROPPED)
            commit.try_remove(save.tmp, "the uploaded spool directory")
