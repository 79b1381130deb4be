"""``AsyncCheckpointIO``: the Lightning/Fabric face of the save pipeline.

One save, and the module that owns each step:
1. ``save_checkpoint`` (the ranks Lightning calls it on) validates, snapshots into reused host buffers,
   plans and hands the write to the engine's worker (``scheduler``), then returns.
2. ``finalize`` (all ranks, after every training batch through ``AsyncFinalizerCallback``): each rank polls
   its writes (``poller``), the ranks agree on progress and failures (``finalizer``), written saves are
   committed with ``.metadata`` last and an atomic publish, and top-k removals run (``committer``).
3. ``teardown`` settles everything, then stops the workers (``run``). On the way out of an exception, or
   at interpreter exit without ``teardown``, saves in flight still land where they can (``drain``).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from typing_extensions import override

from lightning_asyncckpt import engines, loading, logsetup, paths, poller, scheduler
from lightning_asyncckpt.agreement import Agreement
from lightning_asyncckpt.committer import request_removal
from lightning_asyncckpt.dcp_format import META_FILE
from lightning_asyncckpt.drain import AtExit, ExitGroup, drain
from lightning_asyncckpt.faults import EnvironmentFaults, FaultPolicy
from lightning_asyncckpt.finalizer import finalize
from lightning_asyncckpt.layout import Layout
from lightning_asyncckpt.records import SaveRecord, global_step
from lightning_asyncckpt.run import Run

__all__ = ["AsyncCheckpointIO", "SaveRecord", "META_FILE"]

FORMATS = ("auto", "dcp")

log = logging.getLogger(__name__)
logsetup.configure()


class AsyncCheckpointIO(CheckpointIO):
    """Writes checkpoints in the background: the same file or DCP directory stock Lightning writes.

    Args:
        strategy: the async engine: ``"nvrx"`` (nvidia-resiliency-ext), ``"mcore"`` (Megatron-Core), or
            ``"auto"`` (nvrx when installed, else mcore with a warning). Read back with :attr:`engine`.
        worker: ``"persistent"`` (one long-lived worker process per rank, started once) or ``"fork"``
            (a process forked per save, whose copy-on-write memory is the snapshot).
        thread_count: shard files (and writer threads) per rank and save.
        timeout_s: a background write that takes longer fails the save (its worker is killed), so that
            a hung write is raised within a bounded time. A dead worker is detected at once.
        max_pending: saves in flight per rank; a further save first waits for the oldest write. Each
            in-flight save holds one copy of the state in host memory.
        poll_interval_s: sleep between checks while a blocking finalize waits.
        drain_timeout_s: on the way out of an exception (Ctrl-C, SIGTERM) or at interpreter exit without
            ``teardown``, how long this rank waits for the saves in flight to land (see
            :mod:`lightning_asyncckpt.drain`); ``0`` drops every unfinished save at once.
        format: ``"auto"``: where stock Lightning writes one file (single device, DDP from rank 0, Fabric),
            the same ``torch.save`` file; sharded and ``AsyncDDPStrategy`` saves are DCP directories.
            ``"dcp"``: single-writer saves are DCP directories too (0.1's layout).
        faults: where injected faults come from (:mod:`lightning_asyncckpt.testing`); by default the
            ``LIGHTNING_ASYNCCKPT_FAULTS`` environment variable, read at every save.

    Construct it on every rank; it starts nothing until the first save, ``warmup`` or the callback's
    ``setup``. ``history`` lists a :class:`SaveRecord` for each save this rank committed.
    """

    def __init__(
        self, strategy: str = "auto", *, worker: str = "persistent", thread_count: int = 1, timeout_s: float = 1800.0,
        max_pending: int = 2, poll_interval_s: float = 0.02, drain_timeout_s: float = 300.0,
        format: str = "auto", faults: FaultPolicy | None = None,
    ) -> None:
        super().__init__()
        for name, ok, want in (("thread_count", thread_count >= 1, "at least 1"), ("max_pending", max_pending >= 1, "at least 1"),
                               ("timeout_s", timeout_s > 0, "positive"), ("drain_timeout_s", drain_timeout_s >= 0, "at least 0")):
            if not ok:
                raise ValueError(f"`AsyncCheckpointIO({name}={locals()[name]})` must be {want}.")
        if format not in FORMATS:
            raise ValueError(f"`AsyncCheckpointIO(format={format!r})` is not valid; choose one of {', '.join(map(repr, FORMATS))}.")
        self.format = format
        self._engine_name = engines.resolve(strategy)
        self._worker_mode = engines.parse_worker(worker)
        self.thread_count, self.max_pending = thread_count, max_pending
        self.timeout_s, self.poll_interval_s, self.drain_timeout_s = float(timeout_s), poll_interval_s, float(drain_timeout_s)
        self.faults: FaultPolicy = faults if faults is not None else EnvironmentFaults()
        self.write_hook: Any = None  # picklable; the worker calls it with the buckets before writing
        self.history: list[SaveRecord] = []  # every committed save, oldest first
        self._returned = 0  # history[:_returned] was returned by finalize()
        self._agreement = Agreement()
        self._run: Run | None = None
        self._closed = False  # torn down: nobody finalizes, so a save completes before it returns
        self._began = False  # a Trainer stage (the callback) or the user (warmup, with) will finalize
        self._save_calls = 0  # this rank's saves, counted from 1: what injected faults target
        self._handling_at_start: BaseException | None = None  # the exception being handled as the run began
        self._exit_group = ExitGroup()
        self._at_exit = AtExit()

    def __getstate__(self) -> dict[str, Any]:
        """A pickled (or deep-copied) plugin is its settings and history, as stock's ``TorchCheckpointIO`` is:
        ``torch.save(trainer)`` works. The copy starts no worker until it saves; the saves in flight stay
        with the original."""
        state = dict(self.__dict__)
        state.update(_run=None, _closed=False, _began=False, _exit_group=ExitGroup(), _at_exit=AtExit(), _handling_at_start=None)
        return state

    @property
    def engine(self) -> str:
        """``"nvrx"`` or ``"mcore"``: the engine ``strategy`` resolved to (in ``__init__``, on every rank)."""
        return self._engine_name.value

    @property
    def worker(self) -> str:
        return self._worker_mode.value  # "persistent" or "fork"

    @property
    def num_pending(self) -> int:
        """(any rank, any time) Saves of this rank not yet committed or failed."""
        return len(self._run.pending) if self._run is not None else 0

    @property
    def exit_group_ready(self) -> bool:
        """(any rank) Whether the group for committing collective saves on the way out exists and is usable."""
        return self._exit_group.usable()

    def worker_pids(self) -> list[int]:
        """(any rank, any time) PIDs of this rank's live background writers (the persistent worker, or forked ones)."""
        return self._run.worker_pids() if self._run is not None else []

    def is_pending(self, path: Any) -> bool:
        """(the saving ranks) Whether a save to ``path`` is scheduled and not yet committed: it exists for
        whoever picks free names (``ModelCheckpoint``'s ``-v1`` suffixes), as stock's synchronous file would."""
        return self._run is not None and any(s.path == paths.local_path(path) for s in self._run.pending)

    def staging_buffers(self) -> list[torch.Tensor]:
        """(any rank) The host buffers held for snapshots, reused from save to save (empty after ``teardown``)."""
        return self._run.stager.buffers() if self._run is not None else []

    # Lightning's CheckpointIO -------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """(the ranks Lightning calls it on) Snapshots ``checkpoint`` and schedules its write to ``path``.
        Returns once the snapshot is taken; errors of the write are raised later, by :meth:`finalize`."""
        self._save(checkpoint, path, storage_options, Layout.SINGLE_WRITER, trainer_save=_from_trainer(checkpoint))

    def save_checkpoint_distributed(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """(all ranks, same order) Saves a state replicated on every rank; each rank snapshots and writes a
        disjoint share, so every byte is written once. One checkpoint that loads on any number of ranks.
        Used by :class:`~lightning_asyncckpt.AsyncDDPStrategy`."""
        self._save(checkpoint, path, storage_options, Layout.DISTRIBUTED, trainer_save=_from_trainer(checkpoint))

    def save_checkpoint_sharded(self, state: dict[str, Any], path: Any, meta: dict[str, Any] | None = None) -> None:
        """(all ranks, same order) Saves a sharded state in Lightning's ``ModelParallelStrategy`` layout: each
        rank writes its own shards (``DTensor`` local shards and its share of replicated tensors), global
        rank 0 also writes ``meta`` to ``meta.pt``. Stock Lightning and plain DCP read the result."""
        extra = [scheduler.meta_file(meta)] if meta is not None and self._agreement.rank == 0 else []
        self._save(state, path, None, Layout.SHARDED, extra, global_step(meta), trainer_save=_from_trainer(meta))

    def _save(self, checkpoint: dict[str, Any], path: Any, storage_options: Any, layout: Layout,
              extra_files: list | None = None, step: int | None = None, trainer_save: bool = False) -> None:
        self._save_calls += 1
        run, rank = self._ensure_run(), self._agreement.rank
        collective = layout.all_ranks_write(self._agreement.active)
        request = scheduler.SaveRequest(
            checkpoint, path, layout, collective, seq=run.count.claim(collective), started=time.perf_counter(),
            writes_file=layout is Layout.SINGLE_WRITER and self.format == "auto",
            step=step if step is not None else global_step(checkpoint), extra_files=extra_files or [],
            faults=self.faults.for_save(rank, self._save_calls, self.engine, self.worker),
        )
        self._at_exit.arm(self, AsyncCheckpointIO.abort)
        scheduler.submit(run, self._agreement, self, request, storage_options, self.write_hook, self.begin_collective_saves)
        if self._closed or (trainer_save and not self._began):
            self._complete_now(collective)

    def _complete_now(self, collective: bool) -> None:
        # no loop will finalize this save (torn down, e.g. `trainer.save_checkpoint` after `fit`; or a Trainer
        # save outside any stage): complete it now, with the other ranks for a collective save, else alone
        try:
            agreement = self._agreement if collective else Agreement.alone()
            finalize(self._ensure_run(), agreement, self, blocking=True, force=True)
        finally:
            self._close(abort=False)

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """(any rank) Waits for this rank's pending saves, then reads the checkpoint at ``path`` (a directory
        of this library or DCP, or a ``torch.save`` file). A failed save at ``path`` is raised here."""
        path = paths.local_path(path)
        if self._run is not None:
            poller.settle_for(self._run, self, self._agreement.rank, path)
        return loading.load(path, map_location=map_location, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """(the ranks Lightning calls it on) Removes ``path`` once every save scheduled so far has committed:
        a checkpoint being written is never deleted, the newest committed one stays until a newer commits."""
        request_removal(self._ensure_run(), paths.local_path(path))

    @override
    def teardown(self) -> None:
        """(all ranks) Blocking finalize (errors raised on every rank), then stops the workers. After
        :meth:`abort` (the callback's ``on_exception``) it has nothing left to do. Called while an exception
        raised during this run propagates (Lightning tears down on errors, also without the callback), it
        is :meth:`abort`, so as not to mask it; one the user was already handling when the run began (a
        retry loop's ``except`` block) does not count."""
        propagating = sys.exc_info()[1]
        if propagating is not None and propagating is not self._handling_at_start:
            self.abort()
            return
        try:
            if self._run is not None and not self._closed:
                finalize(self._run, self._agreement, self, blocking=True, force=True)
        finally:
            self._close(abort=False)

    def finalize(self, blocking: bool = False) -> list[SaveRecord]:
        """(all ranks, same order) Commits the saves whose writes finished (``blocking``: all of them) and
        raises :class:`CheckpointWriteError` on every rank for a failed one. Returns the records committed
        on this rank since the previous call, e.g. for ``fabric.log_dict(r.metrics())``."""
        self.settle(blocking)
        out = self.history[self._returned:]
        self._returned = len(self.history)
        return out

    def settle(self, blocking: bool = True) -> None:
        """(all ranks, same order) ``finalize`` without taking its records: for loads, which must see every
        save settled first (the strategies' ``load_checkpoint``, ``fabric.load``)."""
        finalize(self._ensure_run(), self._agreement, self, blocking, force=True)

    def __enter__(self) -> AsyncCheckpointIO:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """(all ranks) For loops that never tear down (Fabric's): ``teardown``, or :meth:`abort` on an exception."""
        if exc is None:
            self.teardown()
        else:
            self.abort()

    def warmup(self, like: dict[str, Any] | None = None) -> None:
        """(writing ranks) Starts the background worker now, so that the first save does not pay for it;
        ``like`` (a checkpoint like the ones to come) also allocates the staging buffers. Local: it changes
        nothing the ranks must agree on, so it may be called on some ranks only."""
        self._closed, self._began = False, True
        self._ensure_run().start(self._agreement.rank, None).start()
        if like is not None:
            self.prepare(like, distributed=False)

    # The package's interface for the callback and the strategies ---------------------------------------
    def begin_run(self, collective: bool) -> None:
        """(all ranks, together, at the start of a Trainer stage) Saves are finalized from now on.
        ``collective``: all ranks will write parts, so the exit group is made now, outside any save."""
        self._closed, self._began = False, True
        self._ensure_run()
        if collective:
            self.begin_collective_saves()

    def begin_collective_saves(self) -> None:
        self._exit_group.make(self._agreement, self.drain_timeout_s)  # (all ranks, together)

    def announce(self) -> None:
        """(all ranks, as Lightning builds a checkpoint) Counts a save that the plugin will be called for
        on some rank, so that every rank knows a save is pending."""
        self._ensure_run().count.announced += 1

    def prepare(self, like: dict[str, Any], distributed: bool) -> None:
        """(writing ranks, before the first save) Allocates staging buffers for checkpoints like ``like``
        (this rank's share of it when ``distributed``)."""
        rank, world = (self._agreement.rank, self._agreement.world_size) if distributed else (0, 1)
        self._ensure_run().prepare(like, rank, world)

    def finalize_step(self, blocking: bool = False) -> None:
        """(all ranks, same order; the callback, after every batch) ``finalize`` that agrees only while a save
        is announced and unsettled, so that steps without pending saves pay no collective."""
        if self._run is not None:
            finalize(self._run, self._agreement, self, blocking, force=False)

    def wait_for_local_writes(self) -> None:
        """(this rank, no collectives) Waits for this rank's writes in flight: single-writer saves commit;
        this rank's part of a collective save is written (the ranks commit it at the next finalize, or on
        the way out). Failures are raised by the next finalize, on every rank."""
        if self._run is not None:
            poller.wait_for_local_writes(self._run, self, self._agreement.rank)

    def abort(self) -> None:
        """(the ranks that raised; never raises) Lets the saves in flight land (``drain_timeout_s``), then
        stops the workers and drops unfinished saves. What goes wrong on the way is logged."""
        if self._run is not None and not self._closed:
            try:
                drain(self._run, self, self._agreement.rank, self._exit_group, self.drain_timeout_s)
            except Exception:  # noqa: BLE001 - on the way out: report, never mask the original error
                log.exception("lightning-asyncckpt: error while draining the saves in flight")
        try:
            self._close(abort=True)
        except Exception:  # noqa: BLE001
            log.exception("lightning-asyncckpt: error while stopping the checkpoint workers")

    def _ensure_run(self) -> Run:
        if self._run is None:
            self._run = Run(self._engine_name, self._worker_mode, self.history)
            self._handling_at_start = sys.exc_info()[1]
        return self._run

    def _close(self, abort: bool) -> None:
        self._closed, self._began = True, False
        self._at_exit.disarm()
        run, self._run = self._run, None
        if run is not None:
            run.close(self._agreement.rank, abort)


def _from_trainer(checkpoint: Any) -> bool:
    """A checkpoint the Lightning Trainer built (its dict carries Lightning's version)."""
    return isinstance(checkpoint, dict) and "pytorch-lightning_version" in checkpoint
