"""``SavePipeline``: the run of saves behind ``AsyncCheckpointIO``, and the package's interface to it.

``AsyncCheckpointIO`` (``io.py``) is the face Lightning and Fabric call. This base class holds what the
face stands on: the current :class:`~lightning_asyncckpt.pipeline.run.Run`, the cross-rank ``Agreement``, the exit
group and the interpreter-exit hook. Its public methods are the small interface that the callback and
the strategies call (``begin_run``, ``announce``, ``prepare``, ``track_optimizers``, ``wait_for_snapshot``,
``finalize_step``, ``wait_for_local_writes``, ``abort``, and ``saves_scheduled``/``saves_settled`` for the
logger relay); nothing outside calls its ``_``-methods.

A lazy snapshot (``snapshot="lazy"``, :mod:`lightning_asyncckpt.snapshot.lazy`) is waited for at every entry that
may follow a change of the state or needs the save handed over: the next save, finalize, load,
teardown, abort, and :meth:`wait_for_snapshot` itself.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from lightning_asyncckpt.faults.policy import FaultPolicy
from lightning_asyncckpt.format.layout import Layout
from lightning_asyncckpt.pipeline import poller, scheduler, settle_copy
from lightning_asyncckpt.pipeline.agreement import Agreement
from lightning_asyncckpt.pipeline.drain import AtExit, ExitGroup, drain
from lightning_asyncckpt.pipeline.finalizer import finalize
from lightning_asyncckpt.pipeline.records import SaveRecord, global_step
from lightning_asyncckpt.pipeline.run import Run
from lightning_asyncckpt.pipeline.save import Save
from lightning_asyncckpt.pipeline.settings import Settings
from lightning_asyncckpt.snapshot.lazy import TrackedState

log = logging.getLogger(__name__)


class SavePipeline:
    """A run of saves: made at the first save (or ``begin_run``/``warmup``), dropped at close."""

    faults: FaultPolicy
    write_hook: Any
    copy_hook: Any

    def __init__(self, settings: Settings) -> None:
        self.settings = settings  # frozen: replaced whole (and validated again) when a setting is assigned
        self.history: list[SaveRecord] = []  # every committed save, oldest first
        self._agreement = Agreement()
        self._run: Run | None = None
        self._closed = False  # torn down: nobody finalizes, so a save completes before it returns
        self._began = False  # a Trainer stage (the callback) or the user (warmup, with) will finalize
        # begin_run's ``collective``: every rank will write DCP directories (None: no begin_run, so unknown)
        self._collective_run: bool | None = None
        self._save_calls = 0  # this rank's saves, counted from 1: what injected faults target
        self._committed_calls: set[int] = set()  # the numbers of the save calls that committed
        self._handling_at_start: BaseException | None = None  # the exception being handled as the run began
        self._exit_group = ExitGroup()
        self._at_exit = AtExit()
        self._tracked = TrackedState()  # the optimizers given to track_optimizers (weakly), for every run

    def __getstate__(self) -> dict[str, Any]:
        """A pickled (or deep-copied) plugin is its settings and history, as stock's ``TorchCheckpointIO`` is:
        ``torch.save(trainer)`` works. The copy starts no worker until it saves; the saves in flight stay
        with the original."""
        state = dict(self.__dict__)
        state.update(_run=None, _closed=False, _began=False, _exit_group=ExitGroup(), _at_exit=AtExit(), _handling_at_start=None,
                     _tracked=TrackedState())
        return state

    @property
    def saves_scheduled(self) -> int:
        """(any rank, any time; local) How many saves this rank's plugin was asked to make since it was
        made, counted as each call begins (one that fails or raises counts too). Lightning's Trainer calls
        the plugin on global rank 0 only (every rank for ``AsyncDDPStrategy`` and sharded saves): on the
        other ranks it stays 0. A mark for :meth:`saves_settled`."""
        return self._save_calls

    def saves_settled(self, mark: int, since: int = 0) -> bool | None:
        """(any rank, any time; local, no collectives) Whether this rank's saves numbered ``since + 1`` to
        ``mark`` (values of :attr:`saves_scheduled`) have settled: ``None`` while one of them is still
        pending; then ``True`` if every one committed, ``False`` if one did not (its write failed, it was
        dropped on the way out, or it raised to its caller). Saves commit in ``finalize`` (the callback's,
        after every batch); a failure is raised there, on every rank. With nothing in the range (``mark <=
        since``, e.g. a rank that saves nothing), ``True``."""
        if self._run is not None and any(since < call <= mark for _, call in self._run.unsettled()):
            return None
        return all(call in self._committed_calls for call in range(since + 1, mark + 1))

    def hold_removals(self, held: bool) -> None:
        """(this rank; the callback's logger relay) While held, the removals Lightning asks for (top-k) wait,
        so that a checkpoint is still there for the deferred logger call that announces it; releasing
        runs those whose saves have committed."""
        run = self._run
        if run is None:
            return  # no run: nothing to remove (a closed run ran its removals)
        run.retention.hold(held)

    def begin_run(self, collective: bool) -> None:
        """(all ranks, together, at the start of a Trainer stage) Saves are finalized from now on.
        ``collective``: all ranks will write parts, so the exit group is made now, outside any save."""
        self._closed, self._began = False, True
        self._collective_run = collective
        self._ensure_run()
        if collective:
            self.begin_collective_saves()

    def begin_collective_saves(self) -> None:
        self._exit_group.make(self._agreement, self.settings.drain_timeout_s)  # (all ranks, together)

    def announce(self) -> None:
        """(all ranks, as Lightning builds a checkpoint) Counts a save that the plugin will be called for
        on some rank, so that every rank knows a save is pending."""
        self._ensure_run().count.announce()

    def prepare(self, like: dict[str, Any], distributed: bool) -> None:
        """(writing ranks, before the first save) Allocates staging buffers for checkpoints like ``like``
        (this rank's share of it when ``distributed``)."""
        rank, world = (self._agreement.rank, self._agreement.world_size) if distributed else (0, 1)
        self._ensure_run().prepare(like, rank, world)

    def track_optimizers(self, optimizers: Any) -> None:
        """(the saving ranks, before the saves; the callback at the start of training, and at each save)
        The optimizers whose ``step`` alone changes their parameters and state: with ``snapshot="lazy"``
        those are copied in the background after ``save_checkpoint`` returns. Nothing tracked: every save
        is copied at save time. Fabric users call it once, with their optimizers."""
        self._tracked.track(optimizers)

    def lazy_rule(self) -> Any:
        """(the training thread, at a local-tier save) With ``snapshot="lazy"``, which tensors may be copied
        after the save call returns (the tracked optimizers' parameters and state: see
        :meth:`~lightning_asyncckpt.snapshot.lazy.TrackedState.rule`); else None (everything at save time)."""
        return self._tracked.rule() if self.settings.snapshot == "lazy" else None

    def wait_for_snapshot(self) -> None:
        """(the saving ranks, on the training thread, right before ``optimizer.step()``) Waits for the
        background copy of a lazy snapshot (``snapshot="lazy"``); a collective save's write is handed to the
        worker then (a single writer's was handed over at save time, behind a gate the copy opened). Returns
        at once when none is in flight. ``AsyncFinalizerCallback`` calls it in ``on_before_optimizer_step``;
        Fabric users, who have no hooks, call it themselves before each ``optimizer.step()`` (or at least
        before the first step after a save). Never called, the next save, ``finalize``, ``load_checkpoint``,
        ``teardown`` or ``abort`` waits instead.

        The copy checks every tensor it copies: one changed in place between the save and its copy (an
        optimizer step, a callback or EMA editing weights, before this wait) fails that save, which is
        never written: :class:`CheckpointWriteError` naming the tensor, raised here when there is no process
        group, else by the next ``finalize`` on every rank. A change made through ``.data`` is invisible
        to that check: such code needs ``snapshot="eager"``."""
        if self._run is not None and self._run.copying is not None:
            settle_copy.finish_copy(self._run, self._agreement, self.settings)

    def settle_snapshot(self, blocking: bool) -> None:
        """(the saving ranks, in finalize) ``blocking``: :meth:`wait_for_snapshot`. Else only a lazy copy that
        already finished is handed over: one still running is waited for before the optimizer step, not
        inside a finalize that the training loop calls right after the save (Fabric's loops do)."""
        copying = self._run.copying if self._run is not None else None
        if copying is not None and (blocking or copying.copy.done()):
            self.wait_for_snapshot()

    def finalize_step(self, blocking: bool = False) -> None:
        """(all ranks, same order; the callback, after every batch) ``finalize`` that agrees only while a save
        is announced and unsettled, so that steps without pending saves pay no collective."""
        if self._run is not None:
            self.settle_snapshot(blocking)
            finalize(self._run, self._agreement, self.settings, blocking, force=False)

    def wait_for_local_writes(self) -> None:
        """(this rank, no collectives) Waits for this rank's writes in flight: single-writer saves commit;
        this rank's part of a collective save is written (the ranks commit it at the next finalize, or on
        the way out). Failures are raised by the next finalize, on every rank."""
        if self._run is not None:
            self.wait_for_snapshot()
            poller.wait_for_local_writes(self._run, self.settings, self._agreement.rank)

    def abort(self) -> None:
        """(the ranks that raised; never raises) Lets the saves in flight land (``drain_timeout_s``), then
        stops the workers and drops unfinished saves. What goes wrong on the way is logged."""
        if self._run is not None and not self._closed:
            drain_timeout_s = self.settings.drain_timeout_s
            deadline = time.monotonic() + drain_timeout_s  # one bound for the lazy copy's wait and the drain
            try:
                if self._run.copying is not None:  # a clean lazy snapshot is handed over, to land like the others
                    settle_copy.finish_copy(self._run, self._agreement, self.settings, within_s=drain_timeout_s)
            except Exception:  # noqa: BLE001 - on the way out: report, never mask the original error
                log.exception("lightning-asyncckpt: the lazy snapshot in flight failed")
            try:
                left = max(0.0, deadline - time.monotonic())
                drain(self._run, self.settings, self._agreement.rank, self._exit_group, left)
            except Exception:  # noqa: BLE001 - on the way out: report, never mask the original error
                log.exception("lightning-asyncckpt: error while draining the saves in flight")
        try:
            self._close(abort=True)
        except Exception:  # noqa: BLE001
            log.exception("lightning-asyncckpt: error while stopping the checkpoint workers")

    def _save(self, checkpoint: dict[str, Any], path: Any, storage_options: Any, layout: Layout,
              extra_files: list | None = None, step: int | None = None, trainer_save: bool = False) -> None:
        self.wait_for_snapshot()  # the previous save's copy, before anything of this one
        self._save_calls += 1
        run, rank = self._ensure_run(), self._agreement.rank
        collective = layout.all_ranks_write(self._agreement.active)
        save = Save(
            checkpoint, path, layout, collective, seq=run.count.claim(collective), called_at=time.perf_counter(),
            writes_file=layout is Layout.SINGLE_WRITER and self.settings.format == "auto",
            step=step if step is not None else global_step(checkpoint), extra_files=extra_files or [],
            faults=self.faults.for_save(rank, self._save_calls, self.settings.engine, self.settings.worker), call=self._save_calls,
            write_hook=self.write_hook, copy_hook=self.copy_hook,
        )
        self._at_exit.arm(self, SavePipeline.abort)
        scheduler.submit(run, self._agreement, self.settings, save, storage_options, self.begin_collective_saves)
        if self._closed or (trainer_save and not self._began):
            self._complete_now(collective)

    def _complete_now(self, collective: bool) -> None:
        # no loop will finalize this save (torn down, e.g. `trainer.save_checkpoint` after `fit`; or a Trainer
        # save outside any stage): complete it now, with the other ranks for a collective save, else alone
        try:
            self.wait_for_snapshot()
            agreement = self._agreement if collective else Agreement.alone()
            finalize(self._ensure_run(), agreement, self.settings, blocking=True, force=True)
        finally:
            self._close(abort=False)

    def _finalize_all(self) -> None:
        # (all ranks) the blocking finalize of teardown: every save settled, errors raised on every rank. A rank
        # that never saved agrees too (as in ``settle``): Fabric's rank 0 saves alone and every rank tears down
        try:
            if not self._closed:
                self.wait_for_snapshot()
                finalize(self._ensure_run(), self._agreement, self.settings, blocking=True, force=True)
        finally:
            self._close(abort=False)

    def _propagating(self) -> bool:
        # an exception raised during this run propagates (not one the user was handling as it began)
        propagating = sys.exc_info()[1]
        return propagating is not None and propagating is not self._handling_at_start

    def _ensure_run(self) -> Run:
        if self._run is None:
            s = self.settings
            self._run = Run(s.engine_name, s.worker_mode, self.history, self._committed_calls, worker_nice=s.worker_nice,
                            tracked=self._tracked)
            self._handling_at_start = sys.exc_info()[1]
        return self._run

    def _close(self, abort: bool) -> None:
        self._closed, self._began = True, False
        self._at_exit.disarm()
        run, self._run = self._run, None
        if run is not None:
            run.close(self._agreement.rank, abort)
