"""``SaveSession``: the run of saves behind ``AsyncCheckpointIO``, which holds one.

``AsyncCheckpointIO`` (``integration/io.py``) is the face Lightning and Fabric call; it holds a session and
hands it every save. The session owns what those saves share: its frozen :class:`Settings`, the committed
``history``, the cross-rank ``Agreement``, the tracked optimizers, the local tier's run, when attached, and the
run's lifecycle (:class:`~lightning_asyncckpt.pipeline.lifecycle.RunLifecycle`: the current
:class:`~lightning_asyncckpt.pipeline.run_state.Run`, the exit group, the interpreter-exit hook, the drain on the way
out). The values it is handed or keeps (:class:`Instruments`, :class:`SaveCalls`, :class:`AttachedTier`) are
in :mod:`~lightning_asyncckpt.pipeline.session_parts`.

Its verbs: :meth:`~SaveSession.submit` a save, :meth:`~SaveSession.finalize` (commit what finished, raise
failures on every rank), :meth:`~SaveSession.abort` (drain what is in flight, then stop) and
:meth:`~SaveSession.close` (the end of a run). The callback, the strategies and the tier hooks call the rest
of its public methods, named by :class:`~lightning_asyncckpt.integration.contract.SessionInterface`; nothing
outside calls its ``_``-methods or sets its attributes.

A lazy snapshot (``snapshot="lazy"``, :mod:`lightning_asyncckpt.snapshot.lazy`) is waited for at every entry that
may follow a change of the state or needs the save handed over: the next save, finalize, load,
teardown, abort, and :meth:`~SaveSession.wait_for_snapshot` itself.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from lightning_asyncckpt.collectives.agreement import Agreement
from lightning_asyncckpt.format.layout import Layout
from lightning_asyncckpt.pipeline import committer, finalizer, poller, scheduler, settle_copy, write_jobs
from lightning_asyncckpt.pipeline.lifecycle import Phase, RunLifecycle
from lightning_asyncckpt.pipeline.records import SaveRecord, global_step
from lightning_asyncckpt.pipeline.run_state import Run
from lightning_asyncckpt.pipeline.save import Save
from lightning_asyncckpt.pipeline.session_parts import AttachedTier, Instruments, SaveCalls
from lightning_asyncckpt.pipeline.settings import Settings
from lightning_asyncckpt.snapshot import staging
from lightning_asyncckpt.snapshot.lazy import TrackedState
from lightning_asyncckpt.storage import paths

__all__ = ["AttachedTier", "Instruments", "Phase", "SaveCalls", "SaveSession"]

log = logging.getLogger(__name__)


class SaveSession:
    """A run of saves: made at the first save (or ``begin_run``/``warmup``), dropped at close; its history
    and settings outlive each run."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings  # frozen: replaced whole (and validated again) by configure
        self.history: list[SaveRecord] = []  # every committed save, oldest first
        self._agreement = Agreement()
        self._life = RunLifecycle()  # the current run, who settles it, and what ends it
        # begin_run's ``collective``: every rank will write DCP directories (None: no begin_run, so unknown)
        self._collective_run: bool | None = None
        self._calls = SaveCalls()
        self._tracked = TrackedState()  # the optimizers given to track_optimizers (weakly), for every run
        self._tier: AttachedTier | None = None  # the local tier's run, attached at setup on every rank

    def __getstate__(self) -> dict[str, object]:
        """A pickled (or deep-copied) session is its settings and history, as stock's ``TorchCheckpointIO`` is:
        ``torch.save(trainer)`` works. The copy starts no worker until it saves; the saves in flight stay
        with the original."""
        state = dict(self.__dict__)
        state.update(_life=RunLifecycle(), _tracked=TrackedState())
        return state

    # settings ---------------------------------------------------------------------------------------------
    def configure(self, **changes: object) -> Settings:
        """(any rank, between saves) Replaces settings, validated as the constructor's arguments are (a bad
        value raises here and changes nothing); the next save uses them.

        Args:
            changes: :class:`Settings` fields and their new values, e.g. ``timeout_s=60``.

        Returns:
            The new settings."""
        self.settings = dataclasses.replace(self.settings, **changes)
        return self.settings

    # the run's figures (any rank, any time; local, no collectives) -----------------------------------------
    @property
    def num_pending(self) -> int:
        """Saves of this rank not yet committed or failed (a lazy snapshot being copied included)."""
        return len(self._run.unsettled()) if self._run is not None else 0

    @property
    def exit_group_ready(self) -> bool:
        """Whether the group for committing collective saves on the way out exists and is usable."""
        return self._life.exit_group_ready()

    def worker_pids(self) -> list[int]:
        """PIDs of this rank's live background writers (the persistent worker, or forked ones)."""
        return self._run.worker_pids() if self._run is not None else []

    def staging_buffers(self) -> list[torch.Tensor]:
        """The host buffers held for snapshots, reused from save to save (empty after ``close``)."""
        return self._run.stager.buffers() if self._run is not None else []

    def is_pending(self, path: Path | str) -> bool:
        """(the saving ranks) Whether a save to ``path`` is scheduled and not yet committed: it exists for
        whoever picks free names (``ModelCheckpoint``'s ``-v1`` suffixes), as stock's synchronous file would.

        Args:
            path: a checkpoint path, as given to the save.

        Returns:
            True while a save to it is neither committed nor failed."""
        path = paths.checkpoint_path(path)
        return self._run is not None and any(p == path for p, _ in self._run.unsettled())

    @property
    def saves_scheduled(self) -> int:
        """How many saves this rank's plugin was asked to make since it was made, counted as each call
        begins (one that fails or raises counts too). Lightning's Trainer calls the plugin on global rank 0
        only (every rank for ``AsyncDDPStrategy`` and sharded saves): on the other ranks it stays 0. A mark
        for :meth:`saves_settled`."""
        return self._calls.scheduled

    def saves_settled(self, mark: int, since: int = 0) -> bool | None:
        """Whether this rank's saves numbered ``since + 1`` to ``mark`` (values of :attr:`saves_scheduled`) have
        settled: ``None`` while one of them is still pending; then ``True`` if every one committed, ``False``
        if one did not (its write failed, it was dropped on the way out, or it raised to its caller). Saves
        commit in ``finalize``; a failure is raised there, on every rank. With nothing in the range
        (``mark <= since``, e.g. a rank that saves nothing), ``True``.

        Args:
            mark: the last save of the range, a value of :attr:`saves_scheduled`.
            since: the save before the range (0: from the first).

        Returns:
            None while pending; else whether every save of the range committed."""
        unsettled = [call for _, call in self._run.unsettled()] if self._run is not None else []
        return self._calls.settled(mark, since, unsettled)

    # Lightning's side: the callback, the strategies and the tier hooks ------------------------------------
    def hold_removals(self, held: bool) -> None:
        """(this rank; the callback's logger relay) While held, the removals Lightning asks for (top-k) wait,
        so that a checkpoint is still there for the deferred logger call that announces it; releasing
        runs those whose saves have committed.

        Args:
            held: True to hold the removals, False to release (and run) them."""
        run = self._run
        if run is None:
            return  # no run: nothing to remove (a closed run ran its removals)
        run.retention.hold(held)

    def request_removal(self, path: Path | str) -> None:
        """(the ranks Lightning calls ``remove_checkpoint`` on) Removes ``path`` once every save scheduled so far
        has committed.

        Args:
            path: a checkpoint this session saved."""
        committer.request_removal(self._ensure_run(), paths.checkpoint_path(path))

    def begin_run(self, collective: bool) -> None:
        """(all ranks, together, at the start of a Trainer stage) Saves are finalized from now on.
        ``collective``: all ranks will write parts, so the exit group is made now, outside any save.

        Args:
            collective: every rank will write DCP directories (sharded or ``AsyncDDPStrategy`` saves)."""
        self._life.begin()
        self._collective_run = collective
        self._ensure_run()
        if collective:
            self._begin_collective_saves()

    def warmup(self, like: dict[str, object] | None = None) -> None:
        """(writing ranks; local) Starts the background worker now; ``like`` also allocates the staging buffers
        (``AsyncCheckpointIO.warmup``).

        Args:
            like: a checkpoint like the ones to come, or None."""
        self._life.begin()
        # a Trainer stage whose saves are single torch.save files (begin_run, not collective) never needs DCP's
        # writer in its worker; a user's warmup may come before any kind of save
        directories = self._collective_run is not False or self.settings.format == "dcp"
        self._ensure_run().start(self._agreement.rank, None).start(directories=directories)
        if like is not None:
            self.prepare(like, distributed=False)

    def announce(self) -> None:
        """(all ranks, as Lightning builds a checkpoint) Counts a save that the plugin will be called for
        on some rank, so that every rank knows a save is pending."""
        self._ensure_run().count.announce()

    def prepare(self, like: dict[str, object], distributed: bool) -> None:
        """(writing ranks, before the first save) Allocates staging buffers for checkpoints like ``like``
        (this rank's share of it when ``distributed``).

        Args:
            like: a checkpoint like the ones to come.
            distributed: the saves will be ``Layout.DISTRIBUTED`` (each rank stages its share)."""
        rank, world = (self._agreement.rank, self._agreement.world_size) if distributed else (0, 1)
        self._ensure_run().prepare(like, rank, world)

    def track_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """(the saving ranks, before the saves) The optimizers whose ``step`` alone changes their parameters
        and state: with ``snapshot="lazy"`` those are copied in the background after the save call returns.

        Args:
            optimizers: the optimizers (held weakly; a ``LightningOptimizer`` stands for the one it wraps)."""
        self._tracked.track(optimizers)

    def lazy_rule(self) -> staging.Defer | None:
        """(the training thread, at a local-tier save) With ``snapshot="lazy"``, which tensors may be copied
        after the save call returns (the tracked optimizers' parameters and state: see
        :meth:`~lightning_asyncckpt.snapshot.lazy.TrackedState.rule`); else None (everything at save time)."""
        return self._tracked.rule() if self.settings.snapshot == "lazy" else None

    @property
    def tier(self) -> AttachedTier | None:
        """The local tier's run (``AsyncCheckpointIO(local=...)``), attached at setup; else None."""
        return self._tier

    def attach_tier(self, tier: AttachedTier) -> None:
        """(every rank, at setup, before any restore) The local tier's run, waited for with the persistent saves'
        lazy copies and asked first at a load. A second tier while one is attached is refused.

        Args:
            tier: the local tier's run (``tiers.tier_run.TierRun``)."""
        if self._tier is not None and self._tier is not tier:
            raise RuntimeError("SaveSession.attach_tier: a local tier is attached already; detach_tier() it first.")
        self._tier = tier

    def detach_tier(self) -> AttachedTier | None:
        """(every rank, as the local tier closes) Returns the tier's run, no longer attached."""
        tier, self._tier = self._tier, None
        return tier

    def take_restored(self, key: Path | str) -> dict[str, object] | None:
        """(every rank, at a load) The checkpoint the local tier's recovery fetched for ``key``, once; else None.

        Args:
            key: the path being loaded (a resume name ``LocalTierHook.latest`` returned, or any other).

        Returns:
            The fetched checkpoint, or None (no tier, another path, or taken already)."""
        return self._tier.take(key) if self._tier is not None else None

    # the verbs --------------------------------------------------------------------------------------------
    def submit(self, checkpoint: dict[str, object], path: Path | str, layout: Layout, instruments: Instruments, *,
               storage_options: object | None = None, meta: dict[str, object] | None = None, step: int | None = None,
               trainer_save: bool = False) -> None:
        """(the saving ranks; every rank, same order, for a ``layout`` where all ranks write) Snapshots
        ``checkpoint`` and schedules its write to ``path``; returns once the snapshot is taken.

        Args:
            checkpoint: the state to save (this rank's share of it, for a sharded layout).
            path: where: a local path or an fsspec URL.
            layout: who writes what (:class:`~lightning_asyncckpt.format.layout.Layout`).
            instruments: the test hooks and fault policy this save runs with.
            storage_options: Lightning's ``storage_options`` (refused unless None).
            meta: the non-tensor state of a sharded save: global rank 0 writes it to ``meta.pt``.
            step: the global step, else read from ``checkpoint``.
            trainer_save: the Lightning Trainer built ``checkpoint``: outside a stage it completes now."""
        rank = self._agreement.rank
        extra_files = [write_jobs.meta_file(meta)] if meta is not None and rank == 0 else []  # serialized now
        self.wait_for_snapshot()  # the previous save's copy, before anything of this one
        call = self._calls.next()
        run = self._ensure_run()
        collective = layout.all_ranks_write(self._agreement.active)
        s = self.settings
        save = Save(
            checkpoint, path, layout, collective, seq=run.count.claim(collective), called_at=time.perf_counter(),
            writes_file=layout is Layout.SINGLE_WRITER and s.format == "auto",
            step=step if step is not None else global_step(checkpoint), extra_files=extra_files,
            faults=instruments.faults.for_save(rank, call, s.engine, s.worker), call=call,
            write_hook=instruments.write_hook, copy_hook=instruments.copy_hook,
        )
        self._life.arm_exit(self, SaveSession.abort)
        scheduler.submit(run, self._agreement, s, save, storage_options, self._begin_collective_saves)
        if self._life.completes_now(trainer_save):
            self._complete_now(collective)

    def wait_for_snapshot(self) -> None:
        """(the saving ranks, on the training thread, right before ``optimizer.step()``) Waits for the
        background copy of a lazy snapshot, the persistent save's (a collective save's write is handed to
        the worker then) and the local tier's. Returns at once when none is in flight."""
        if self._run is not None and self._run.copying is not None:
            settle_copy.finish_copy(self._run, self._agreement, self.settings)
        if self._tier is not None:
            self._tier.wait_copy()

    def finalize(self, blocking: bool = False, *, only_if_pending: bool = False) -> None:
        """(all ranks, same order) Commits the saves whose writes finished (``blocking``: all of them) and
        raises :class:`~lightning_asyncckpt.CheckpointWriteError` on every rank for a failed one.

        Args:
            blocking: wait for every write in flight (and a lazy copy still running).
            only_if_pending: agree only while a save is announced and unsettled, so that the steps
                without pending saves pay no collective (the callback, after every batch)."""
        if only_if_pending and self._run is None:
            return
        run = self._ensure_run()
        copying = run.copying
        # not blocking: a lazy copy still running is waited for before the optimizer step, not inside a
        # finalize that the training loop calls right after the save (Fabric's loops do)
        if copying is not None and (blocking or copying.copy.done()):
            self.wait_for_snapshot()
        finalizer.finalize(run, self._agreement, self.settings, blocking, force=not only_if_pending)

    def wait_for_local_writes(self) -> None:
        """(this rank, no collectives) Waits for this rank's writes in flight: single-writer saves commit;
        this rank's part of a collective save is written (the ranks commit it at the next finalize, or on
        the way out). Failures are raised by the next finalize, on every rank."""
        if self._run is not None:
            self.wait_for_snapshot()
            poller.wait_for_local_writes(self._run, self.settings, self._agreement.rank)

    def settle_for_load(self, path: Path | str) -> None:
        """(any rank, before a load of ``path``) This rank's saves to ``path`` settled; with other ranks up, a
        save another rank is still writing into ``path`` landed (at most ``timeout_s``).

        Args:
            path: the checkpoint about to be loaded (local, or an fsspec URL)."""
        if self._run is not None:
            self.wait_for_snapshot()
            poller.settle_for(self._run, self.settings, self._agreement.rank, path)
        if self._agreement.active:
            paths.wait_until_landed(path, self.settings.timeout_s, self.settings.poll_interval_s)

    def abort(self) -> None:
        """(the ranks that raised; never raises) Lets the saves in flight land (``drain_timeout_s``), then
        stops the workers and drops unfinished saves. What goes wrong on the way is logged."""
        if not self._life.closed:
            self._life.drain(self._agreement, self.settings)
        try:
            self._stop(abort=True)
        except Exception:  # noqa: BLE001
            log.exception("lightning-asyncckpt: error while stopping the checkpoint workers")

    def close(self) -> None:
        """(all ranks) The end of a run: blocking finalize (errors raised on every rank), then the workers stop.
        After :meth:`abort` there is nothing left to do. While an exception raised during this run propagates,
        it is :meth:`abort`, so as not to mask it; one the user was already handling when the run began (a
        retry loop's ``except`` block) does not count. A rank that never saved agrees too: Fabric's rank 0
        saves alone and every rank tears down."""
        if self._life.raised_during_run():
            self.abort()
            return
        try:
            if not self._life.closed:
                self.wait_for_snapshot()
                finalizer.finalize(self._ensure_run(), self._agreement, self.settings, blocking=True, force=True)
        finally:
            self._stop(abort=False)

    # private ----------------------------------------------------------------------------------------------
    def _begin_collective_saves(self) -> None:
        self._life.make_exit_group(self._agreement, self.settings.drain_timeout_s)  # (all ranks, together)

    def _complete_now(self, collective: bool) -> None:
        # no loop will finalize this save (torn down, e.g. `trainer.save_checkpoint` after `fit`; or a Trainer
        # save outside any stage): complete it now, with the other ranks for a collective save, else alone
        try:
            self.wait_for_snapshot()
            agreement = self._agreement if collective else Agreement.alone()
            finalizer.finalize(self._ensure_run(), agreement, self.settings, blocking=True, force=True)
        finally:
            self._stop(abort=False)

    @property
    def _run(self) -> Run | None:
        return self._life.run

    def _ensure_run(self) -> Run:
        return self._life.ensure(self._new_run)

    def _new_run(self) -> Run:
        s = self.settings
        return Run(s.engine_name, s.worker_mode, self.history, self._calls.committed, worker_nice=s.worker_nice,
                   tracked=self._tracked)

    def _stop(self, abort: bool) -> None:
        self._life.stop(self._agreement.rank, abort)
