"""Scheduling one save: snapshot, plan, and hand the write to the engine's worker.

Runs on the training thread of each saving rank, inside ``save_checkpoint``: everything here is the
stall that training sees. The other half of a lazy save, the wait before the optimizer step, is
``settle_copy``. A collective save (every rank writes a part) arrives with its snapshot taken
and the ranks agreed that each has one; its planning is collective too.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from lightning_asyncckpt.collectives.agreement import Agreement
from lightning_asyncckpt.errors import CheckpointWriteError, RankFailure
from lightning_asyncckpt.format.layout import Layout
from lightning_asyncckpt.pipeline import poller, write_jobs
from lightning_asyncckpt.pipeline.failures import Failed, filesystem_failures
from lightning_asyncckpt.pipeline.run_state import Run
from lightning_asyncckpt.pipeline.save import Save, SaveState
from lightning_asyncckpt.pipeline.serialize import torch_bytes
from lightning_asyncckpt.pipeline.settings import Settings, SnapshotMode
from lightning_asyncckpt.snapshot import lazy, staging
from lightning_asyncckpt.storage import commit, paths
from lightning_asyncckpt.write import file_layout
from lightning_asyncckpt.write.gate import Gate

log = logging.getLogger(__name__)


def submit(
    run: Run, agreement: Agreement, settings: Settings, save: Save, storage_options: object,
    on_first_collective: Callable[[], None],
) -> None:
    """(the saving ranks; every rank for a collective save) The save-time half of a save: validate, wait for
    room, snapshot (agreed across the ranks when collective: a rank that failed before the collective
    planning must not leave the others in it), plan and hand over.

    Alone (no process group), a write failure raises :class:`CheckpointWriteError` here and bad input its
    own error. With a process group, a failure is recorded for the next finalize, which raises it on every
    rank: raising on one rank alone would leave the others waiting in Lightning's barrier.

    Args:
        run: the run the save belongs to.
        agreement: the ranks (``Agreement.alone()`` without a process group).
        settings: the plugin's settings.
        save: the save, ``REQUESTED``; it leaves ``WRITING`` (or ``COPYING``), or ended.
        storage_options: as the caller passed them (checked by ``paths.check_save_path``).
        on_first_collective: called on every rank at the first collective save, once its token is agreed.
    """
    rank, collective = agreement.rank, save.collective
    try:
        snapshot, local_error = None, None
        try:
            save.validated(paths.check_save_path(save.path, storage_options, save.writes_file))
            run.start(rank, save.destination.parent())
            poller.settle_local(run, settings, rank, blocking=False)
            if not agreement.active:
                run.failures.raise_local()
            poller.wait_for_room(run, settings, rank)
            if save.remote:
                poller.wait_for_path(run, settings, rank, save.path, run.workers.persistent)
            if collective:
                snapshot = take_snapshot(run, agreement, save, _lazy_rule(run, settings))
        except Exception as e:
            if not collective:
                raise
            local_error = e
        if collective and agreement.all_max([int(local_error is not None)])[0]:
            run.stager.release(snapshot.buffer_set if snapshot is not None else None)  # the others drop it
            save.to(SaveState.DROPPED)
            if local_error is not None:
                raise local_error
            return
        schedule(run, agreement, settings, save, snapshot, on_first_collective)
    except (Exception, CheckpointException) as e:
        if save.state in (SaveState.REQUESTED, SaveState.COPYING):  # one handed over already ended its own way
            save.to(SaveState.FAILED)
        if isinstance(e, CheckpointWriteError):
            raise
        fail_at_save_time(run, agreement, save, e)


def fail_at_save_time(run: Run, agreement: Agreement, save: Save, e: BaseException) -> None:
    """Alone, raises (a write failure as :class:`CheckpointWriteError`, bad input as it is); with a process
    group, records the failure for the next finalize, which raises it on every rank."""
    rank = agreement.rank
    failures = filesystem_failures(e, rank)
    if not agreement.active:
        if failures is None:
            raise e  # bad input: the caller's own error type (TypeError, pickling error, ...)
        raise CheckpointWriteError(str(save.path), failures) from (None if isinstance(e, CheckpointException) else e)
    for failure in failures if failures is not None else [RankFailure.from_exception(rank, e)]:
        if failure.rank == rank:  # a failure in DCP's collective planning reaches all; each records its own
            run.failures.record(Failed(run.order, str(save.path), failure, save.seq))
    log.error("lightning-asyncckpt: save to %s failed at save time: %s", save.path, e)


def take_snapshot(run: Run, agreement: Agreement, save: Save,
                  defer: staging.Defer | None = None) -> staging.Snapshot:
    """Copies the state into reused host buffers (this rank's shards or share when collective), but for
    the tensors that ``defer`` leaves to a lazy copy. A lazy snapshot that finds no free buffers follows
    the newest write in flight into its buffers (:mod:`lightning_asyncckpt.snapshot.buffer_pool`)."""
    save.faults.check(save.faults.at_snapshot, save.path)
    newest = newest_write(run)
    after = newest.buffer_set if newest is not None else None
    if save.layout is Layout.SHARDED:
        return run.stager.snapshot_tree(save.checkpoint, defer=defer, after=after)
    if save.collective:  # replicated state: this rank copies and writes its share only
        return run.stager.snapshot(save.checkpoint, rank=agreement.rank, world_size=agreement.world_size,
                                   defer=defer, after=after)
    return run.stager.snapshot(save.checkpoint, defer=defer, after=after, objects=save.writes_file)


def newest_write(run: Run) -> Save | None:
    """The newest save whose write on this rank is in flight (each holds a copy of the state)."""
    unwritten = run.pending.unwritten()
    return unwritten[-1] if unwritten else None


def schedule(
    run: Run, agreement: Agreement, settings: Settings, save: Save, snapshot: staging.Snapshot | None,
    on_first_collective: Callable[[], None],
) -> None:
    """Snapshots, plans and hands over one save (``WRITING`` once handed over). A lazy snapshot's copy is
    left running (``run.copying``) and its settling waits for ``settle_copy.finish_copy``. On an error
    nothing of the save is left behind."""
    assert run.engine is not None and run.results_dir is not None
    order, tmp = run.names.next_save(agreement, save, on_first_collective)
    save.placed(order, tmp, agreement.rank if save.collective else 0)
    if save.writes_file and isinstance(tmp, Path):
        # seen by the other ranks from the moment the save call returns (a load there waits for it to land);
        # the worker opens it again, truncating
        tmp.touch()
    follow = None
    try:
        if save.writes_file:  # views and parameters as stock's file has them (metadata only, no copies)
            save.prepared(*file_layout.prepare(save.checkpoint))
        save.snapshotted(snapshot if snapshot is not None else take_snapshot(run, agreement, save, _lazy_rule(run, settings)))
        assert save.snapshot is not None
        if save.layout is not Layout.SHARDED and (save.writes_file or save.rank == 0):
            save.serialized(torch_bytes(save.snapshot.skeleton))  # bad input (an object that cannot be pickled) fails here
        if save.snapshot.deferred:
            if not save.writes_file:  # planning reads shapes, not values: now, while every rank is here
                save.planned_now(write_jobs.plan_dcp(run, agreement, settings, save))
            follow = _follow(run, settings, save)  # the write it follows: found before this one is pending
    except BaseException:
        drop(run, save, snapshot if save.snapshot is None else save.snapshot)
        raise
    if not save.snapshot.deferred:
        hand_over(run, agreement, settings, save, time.perf_counter() - save.called_at)
        return
    _start_copy(run, agreement, settings, save, follow)


def _start_copy(run: Run, agreement: Agreement, settings: Settings, save: Save,
                follow: lazy.AfterWrite | None) -> None:
    """Starts a lazy snapshot's background copy (``run.copying`` until ``settle_copy.finish_copy``). A
    single-writer save is handed to the worker first (``WRITING``), behind a gate the copy opens once it is
    proven (``gate.py``), so that its write starts the moment its bytes are copied, not at the next
    optimizer step. A collective save stays ``COPYING``: all ranks agree on its fate at the wait, and a
    write the ranks dropped must never be left in a worker's queue."""
    assert save.snapshot is not None
    gate = None
    if save.collective:
        save.to(SaveState.COPYING)
    else:
        assert run.results_dir is not None
        gate = Gate(run.results_dir / f"{save.order}.gate")
        hand_over(run, agreement, settings, save, 0.0, gate)  # raises having dropped the save
    try:
        copy = lazy.BackgroundCopy(save.snapshot.deferred, save.copy_hook, follow, gate)
    except BaseException:
        if gate is None:
            drop(run, save, save.snapshot)
        else:  # raised here, once: its worker skips it (or gives up at timeout_s), reported by nobody
            save.to(SaveState.ABANDONED)
            with contextlib.suppress(OSError):
                gate.decide(False)
        raise
    save.copy_started(copy, time.perf_counter() - save.called_at)
    run.copy_started(save)
    log.debug("lightning-asyncckpt: %s: copying %d bytes lazily", save.path, copy.nbytes)


def _follow(run: Run, settings: Settings, save: Save) -> lazy.AfterWrite | None:
    """What the lazy copy waits for: nothing, or the end of the write whose buffers it follows into."""
    lease = save.buffer_set
    if lease is None or lease.ready.is_set():
        return None
    newest = newest_write(run)
    assert newest is not None and newest.buffer_set is not None and newest.buffer_set.buffer_set is lease.buffer_set
    save.following(newest.order)
    return lazy.AfterWrite(lease.ready, newest.result_path, settings.timeout_s)


def _lazy_rule(run: Run, settings: Settings) -> staging.Defer | None:
    """Which tensors a lazy snapshot leaves to the background copy (any layout). A forked writer's
    snapshot is the fork itself: taken at save time."""
    if settings.snapshot_mode is not SnapshotMode.LAZY or not run.stager.copy_cpu:
        return None
    return run.tracked.rule()


def drop(run: Run, save: Save, snapshot: staging.Snapshot | None) -> None:
    """What a save that never reached a worker (or that the ranks dropped) left goes: this rank's own
    directory (a single writer's, or a remote save's local spool), and the hold on the buffers of
    ``snapshot`` (pass None while a copy thread may still write into them). A remote file is never visible.
    The caller moves the save to its end state."""
    if (not save.collective or save.remote) and isinstance(save.tmp, Path):
        commit.try_remove(save.tmp, "the unfinished save")
    run.stager.release(snapshot.buffer_set if snapshot is not None else None)


def hand_over(run: Run, agreement: Agreement, settings: Settings, save: Save, stall_s: float,
              gate: Gate | None = None) -> None:
    """Plans the save and hands its write to the worker: ``WRITING``, in the pending queue. On an error
    nothing of it is left behind (and the error is raised). ``gate``: the worker waits at it before reading
    the buffers."""
    assert run.engine is not None and run.results_dir is not None and save.snapshot is not None
    result_path = run.results_dir / f"{save.order}.result"
    gated = (gate.path, settings.timeout_s) if gate is not None else None
    try:
        if save.writes_file:
            ticket, plan = write_jobs.file_job(run, save, result_path, gated), None
        else:
            planned = save.staged.planned or write_jobs.plan_dcp(run, agreement, settings, save)
            ticket, plan = write_jobs.dcp_job(run, save, planned, result_path, gated), planned.plan
    except BaseException:
        # bad input (e.g. an object that cannot be pickled): raised here, in the trainer
        drop(run, save, save.snapshot)
        raise
    save.handed_over(ticket, plan, result_path, gate, stall_s)
    run.pending.append(save)
    log.debug("lightning-asyncckpt: scheduled %s (%d bytes), stall %.4fs", save.path, save.nbytes, stall_s)
