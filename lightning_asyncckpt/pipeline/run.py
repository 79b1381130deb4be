"""``Run``: the state of one run of saves, made when saving starts and dropped when it stops.

A run owns the engine (its worker), the stager's buffers, the pending queue, the failure log, the
cross-rank save count, the results directory and the token that names its temporary directories. One
place makes all of it and one place (:meth:`Run.close`) lets all of it go, so that nothing of an
earlier run (a Trainer's ``fit`` before a ``test``, a torn-down plugin saving once more) leaks into the
next.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_asyncckpt import engines
from lightning_asyncckpt.format import commit, remote
from lightning_asyncckpt.pipeline import scratch
from lightning_asyncckpt.pipeline.failures import FailureLog
from lightning_asyncckpt.pipeline.pending import PendingQueue
from lightning_asyncckpt.pipeline.plan_cache import PlanCache
from lightning_asyncckpt.pipeline.records import SaveRecord
from lightning_asyncckpt.pipeline.save import SaveState
from lightning_asyncckpt.snapshot.lazy import TrackedState
from lightning_asyncckpt.snapshot.staging import Stager

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

    def unsettled(self) -> bool:
        return self.announced > self.reported

    def settle_all(self) -> None:
        self.reported = self.consumed = self.announced


@dataclass(eq=False)
class Run:
    engine_name: engines.EngineName
    worker_mode: engines.WorkerMode
    history: list[SaveRecord]  # the IO's, shared: records outlive the run
    committed_calls: set[int] = field(default_factory=set)  # the IO's, shared: save calls that committed
    token: str = field(default_factory=commit.new_token)
    token_agreed: bool = False  # collective saves write into rank 0's token's directories
    collective_count: int = 0
    order: int = 0  # saves scheduled on this rank
    last_ok_order: int = 0  # the newest save committed on this rank
    count: SaveCount = field(default_factory=SaveCount)
    pending: PendingQueue = field(default_factory=PendingQueue)
    failures: FailureLog = field(default_factory=FailureLog)
    removals: list[tuple[Path | str, int]] = field(default_factory=list)  # (path, after order): retention
    removals_held: bool = False  # deferred logger calls come first (see logger_relay)
    doomed: list[Path] = field(default_factory=list)  # partial dirs of failed collective saves (coordinator)
    engine: engines.Engine | None = None
    worker_nice: int = 0  # the writer processes' CPU priority
    results_dir: Path | None = None
    cleaned_dirs: set[Path | str] = field(default_factory=set)
    stager: Stager = field(init=False)
    # remote directories whose .metadata is being uploaded (coordinator): (save, upload, write results, since)
    publishing: list[tuple[Any, Future, list, float]] = field(default_factory=list)
    tracked: TrackedState = field(default_factory=TrackedState)  # what a lazy snapshot may copy later
    plans: PlanCache = field(default_factory=PlanCache)  # collective saves' plans, reused while the structure holds
    copying: Any = None  # save.Save whose lazy copy is not settled yet (one at most: a save waits for it)
    _remote_ops: ThreadPoolExecutor | None = None

    def __post_init__(self) -> None:
        persistent = self.worker_mode is engines.WorkerMode.PERSISTENT
        self.stager = Stager(shared=persistent, copy_cpu=persistent)

    def start(self, rank: int, dirpath: Path | str | None) -> engines.Engine:
        """(writing ranks) The engine (its worker starts at the first write or ``warmup``), the results
        directory, and for rank 0 the leftovers of dead saves in ``dirpath`` removed, once per directory.
        A remote ``dirpath`` is checked instead (a missing bucket is an error here, at save time)."""
        if self.results_dir is None:
            base = "/dev/shm" if Path("/dev/shm").is_dir() else None
            self.results_dir = scratch.make_scratch_dir(base)  # first removes those of dead trainers
        if self.engine is None:
            self.engine = engines.create(self.engine_name, self.worker_mode, rank, self.worker_nice, str(self.results_dir))
        if isinstance(dirpath, str) and dirpath not in self.cleaned_dirs:
            remote.check_directory(dirpath)
            spool = remote.spool_root()
            if spool not in self.cleaned_dirs:  # parts of dead runs' directory saves on this node
                commit.cleanup_leftovers(spool, keep_prefix=commit.tmp_for(spool / "x", self.token).name)
                self.cleaned_dirs.add(spool)
            self.cleaned_dirs.add(dirpath)
        elif dirpath is not None and dirpath not in self.cleaned_dirs:
            dirpath.mkdir(parents=True, exist_ok=True)
            if rank == 0:
                commit.cleanup_leftovers(dirpath, keep_prefix=commit.tmp_for(dirpath, self.token).name)
            self.cleaned_dirs.add(dirpath)
        return self.engine

    def prepare(self, like: dict, rank: int, world_size: int) -> None:
        """Allocates staging buffers for checkpoints like ``like`` (this rank's share of ``world_size``), once."""
        if not self.stager.buffers():
            nbytes = self.stager.prepare(like, rank=rank, world_size=world_size)
            log.debug("lightning-asyncckpt: prepared %d bytes of staging buffers", nbytes)

    def unsettled(self) -> list[tuple[Path | str, int]]:
        """``(path, save call)`` of every save not yet committed or failed: the pending ones, the lazy
        snapshot being copied (not yet handed to the worker), and remote directories being published."""
        out = [(s.path, s.call) for s in [*self.pending, *(p[0] for p in self.publishing)]]
        if self.copying is not None and self.copying.state in (SaveState.COPYING, SaveState.LOST):  # not handed over
            out.append((self.copying.path, self.copying.call))
        return out

    def remove(self, path: Path | str, what: str) -> None:
        """(this rank, retention) Removes a checkpoint: a local one now; a remote one in one background
        thread, so that object-store calls stay off the training thread (``close`` waits for them)."""
        if isinstance(path, Path):
            commit.try_remove(path, what)
        else:
            self.background(remote.remove, path, what)

    def background(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Runs ``fn`` in the run's one thread for object-store calls, in the order they were asked for
        (a publish before the removals that wait for it); ``close`` waits for all of them."""
        if self._remote_ops is None:
            self._remote_ops = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncckpt-remote")
        return self._remote_ops.submit(fn, *args)

    def worker_pids(self) -> list[int]:
        """PIDs of this run's live writers: the persistent worker, or the forked ones of pending saves."""
        if self.engine is None:
            return []
        forked = [s.ticket.process for s in self.pending if s.ticket.process is not None]
        return self.engine.worker_pids() + [p.pid for p in forked if p.is_alive()]

    def close(self, rank: int, abort: bool) -> None:
        """(this rank) Stops the worker, drops what is still pending (only left when aborting), runs the
        removals that were waiting for committed saves, and frees every buffer."""
        if self.copying is not None:  # every way out waits for it first: a last resort, the save is dropped
            self.copying.copy.cancel()  # one still waiting for the write before it never starts
            self.copying.copy.wait(COPY_AT_CLOSE_S)  # its thread writes into buffers that go now
            if not self.copying.ended and self.copying not in self.pending:
                self.copying.to(SaveState.DROPPED)
            self.copying = None
        try:
            if self.engine is not None:
                self.engine.close(abort=abort)
        finally:  # a worker that would not stop cleanly still leaves no buffers or scratch files behind
            self._release(rank, abort)

    def _release(self, rank: int, abort: bool) -> None:
        """The rest of :meth:`close`, once the engine is stopped (or failed to stop)."""
        dropped = self.pending.take_where(lambda s: True)
        for save in dropped:
            if not save.ended:
                save.to(SaveState.DROPPED)
            if self.engine is not None:
                self.engine.kill(save.ticket)
            if not isinstance(save.tmp, Path):
                continue  # a remote file: an unfinished upload is never visible
            if not save.collective or rank == 0 or save.remote:  # a remote save's parts: this rank's spool  # every rank writes into a collective save's directory
                commit.try_remove(save.tmp, "the unfinished save")
        if dropped:
            log.warning("lightning-asyncckpt: %d unfinished save(s) dropped", len(dropped))
        if abort:
            self.failures.clear()  # logged when recorded; an aborted run does not raise them later
        for tmp in self.doomed:
            commit.try_remove(tmp, "the failed save")
        self.doomed = []
        for path, after in self.removals:
            if after <= self.last_ok_order:
                self.remove(path, "the checkpoint")
        self.removals = []
        if self._remote_ops is not None:
            self._remote_ops.shutdown(wait=True)  # the publishes and removals asked for are done when the run closes
            self._remote_ops = None
        for save, *_ in self.publishing:  # published (or not) on the way out, unrecorded: its spool goes
            save.to(SaveState.DROPPED)
            commit.try_remove(save.tmp, "the uploaded spool directory")
        self.publishing = []
        self.count.settle_all()
        self.stager.clear()
        if self.results_dir is not None:
            shutil.rmtree(self.results_dir, ignore_errors=True)  # our own scratch files in /dev/shm
            self.results_dir = None
