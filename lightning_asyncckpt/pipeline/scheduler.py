"""Scheduling one save: snapshot, plan, and hand the write to the engine's worker.

Runs on the training thread of each saving rank, inside ``save_checkpoint``: everything here is the
stall that training sees. A collective save (every rank writes a part) arrives with its snapshot taken
and the ranks agreed that each has one; its planning is collective too.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from lightning_asyncckpt.errors import CheckpointWriteError, RankFailure
from lightning_asyncckpt.format import commit, paths, remote
from lightning_asyncckpt.format.layout import Layout
from lightning_asyncckpt.pipeline import poller, write_jobs
from lightning_asyncckpt.pipeline.agreement import Agreement
from lightning_asyncckpt.pipeline.failures import Failed, filesystem_failures
from lightning_asyncckpt.pipeline.pending import PendingSave
from lightning_asyncckpt.pipeline.run import Run
from lightning_asyncckpt.pipeline.save import HandOver, SaveRequest
from lightning_asyncckpt.pipeline.settings import Settings
from lightning_asyncckpt.snapshot import lazy, staging
from lightning_asyncckpt.write import torch_file
from lightning_asyncckpt.write.gate import Gate

log = logging.getLogger(__name__)


def submit(
    run: Run, agreement: Agreement, settings: Settings, request: SaveRequest, storage_options: Any, write_hook: Any,
    copy_hook: Any, on_first_collective: Callable[[], None],
) -> None:
    """(the saving ranks; every rank for a collective save) The save-time half of a save: validate, wait for
    room, snapshot (agreed across the ranks when collective: a rank that failed before the collective
    planning must not leave the others in it), plan and hand over.

    Alone (no process group), a write failure raises :class:`CheckpointWriteError` here and bad input its
    own error. With a process group, a failure is recorded for the next finalize, which raises it on every
    rank: raising on one rank alone would leave the others waiting in Lightning's barrier."""
    rank, collective = agreement.rank, request.collective
    try:
        snapshot, local_error = None, None
        try:
            request.path = paths.check_save_path(request.path, storage_options, request.writes_file)
            run.start(rank, paths.parent(request.path))
            poller.settle_local(run, settings, rank, blocking=False)
            if not agreement.active:
                run.failures.raise_local()
            poller.wait_for_room(run, settings, rank)
            if isinstance(request.path, str):
                poller.wait_for_path(run, settings, rank, request.path, run.engine.persistent)
            if collective:
                snapshot = take_snapshot(run, agreement, request, _lazy_rule(run, settings))
        except Exception as e:
            if not collective:
                raise
            local_error = e
        if collective and agreement.all_max([int(local_error is not None)])[0]:
            run.stager.release(snapshot.buffer_set if snapshot is not None else None)  # the others drop it
            if local_error is not None:
                raise local_error
            return
        schedule(run, agreement, settings, request, snapshot, write_hook, copy_hook, on_first_collective)
    except (Exception, CheckpointException) as e:
        if isinstance(e, CheckpointWriteError):
            raise
        _failed_at_save_time(run, agreement, request, e)


def _failed_at_save_time(run: Run, agreement: Agreement, request: SaveRequest, e: BaseException) -> None:
    """Alone, raises (a write failure as :class:`CheckpointWriteError`, bad input as it is); with a process
    group, records the failure for the next finalize, which raises it on every rank."""
    rank = agreement.rank
    failures = filesystem_failures(e, rank)
    if not agreement.active:
        if failures is None:
            raise e  # bad input: the caller's own error type (TypeError, pickling error, ...)
        raise CheckpointWriteError(str(request.path), failures) from (None if isinstance(e, CheckpointException) else e)
    for failure in failures if failures is not None else [RankFailure.from_exception(rank, e)]:
        if failure.rank == rank:  # a failure in DCP's collective planning reaches all; each records its own
            run.failures.record(Failed(run.order, str(request.path), failure, request.seq))
    log.error("lightning-asyncckpt: save to %s failed at save time: %s", request.path, e)


def take_snapshot(run: Run, agreement: Agreement, request: SaveRequest,
                  defer: staging.Defer | None = None) -> staging.Snapshot:
    """Copies the state into reused host buffers (this rank's shards or share when collective), but for
    the tensors that ``defer`` leaves to a lazy copy. A lazy snapshot that finds no free buffers follows
    the newest write in flight into its buffers (:mod:`lightning_asyncckpt.snapshot.buffer_pool`)."""
    request.faults.check(request.faults.at_snapshot, request.path)
    newest = _newest_write(run)
    after = newest.buffer_set if newest is not None else None
    if request.layout is Layout.SHARDED:
        return run.stager.snapshot_tree(request.checkpoint, defer=defer, after=after)
    if request.collective:  # replicated state: this rank copies and writes its share only
        return run.stager.snapshot(request.checkpoint, rank=agreement.rank, world_size=agreement.world_size,
                                   defer=defer, after=after)
    return run.stager.snapshot(request.checkpoint, defer=defer, after=after)


def _newest_write(run: Run) -> PendingSave | None:
    unwritten = run.pending.unwritten()
    return unwritten[-1] if unwritten else None


def _tmp_dir(run: Run, agreement: Agreement, request: SaveRequest, on_first_collective: Callable[[], None]) -> Path | str:
    """The hidden directory the save is written into: per save for one writer; for a collective save the
    same on every rank (rank 0's token, agreed at the first one, and a count every rank keeps). A remote
    file is written at its URL (invisible until complete: an object store has no rename); a remote
    directory into a local spool directory first, which its worker uploads."""
    if isinstance(request.path, str) and request.writes_file:
        return request.path
    # a spool directory is per rank: the ranks of one node share the spool root
    base, spool = (remote.spool_root() / "x", f"-r{agreement.rank}") if isinstance(request.path, str) else (request.path, "")
    if not request.collective:
        return commit.tmp_for(base, f"{run.token}-{run.order}")
    if not run.token_agreed:
        run.token = agreement.all_gather(run.token)[0]
        run.token_agreed = True
        on_first_collective()  # every rank is here (Fabric; the Trainer made its exit group at setup)
    run.collective_count += 1
    return commit.tmp_for(base, f"{run.token}-c{run.collective_count}{spool}")


def schedule(
    run: Run, agreement: Agreement, settings: Settings, request: SaveRequest, snapshot: staging.Snapshot | None,
    write_hook: Any, copy_hook: Any, on_first_collective: Callable[[], None],
) -> None:
    """Snapshots, plans and hands over one save (pending once handed over). A lazy snapshot's copy is left
    running (``run.copying``) and the hand-over waits for :func:`finish_copy`. On an error nothing of the
    save is left behind."""
    assert run.engine is not None and run.results_dir is not None
    run.order += 1
    tmp = _tmp_dir(run, agreement, request, on_first_collective)
    rank = agreement.rank if request.collective else 0
    try:
        if snapshot is None:
            snapshot = take_snapshot(run, agreement, request, _lazy_rule(run, settings))
        skeleton = None
        if request.layout is not Layout.SHARDED and (request.writes_file or rank == 0):
            skeleton = _serialize(snapshot.skeleton)  # bad input (an object that cannot be pickled) fails here
        shape = torch_file.layout(request.checkpoint) if request.writes_file else None  # metadata only
        ready = HandOver(request, snapshot, run.order, tmp, rank, skeleton, shape, write_hook, copy_hook)
        follow = None
        if snapshot.deferred:
            if not request.writes_file:  # planning reads shapes, not values: now, while every rank is here
                ready.planned = write_jobs.plan_dcp(run, agreement, settings, ready)
            follow = _follow(run, settings, ready)  # the write it follows: found before this one is pending
    except BaseException:
        _drop(run, request, tmp, snapshot)
        raise
    if not snapshot.deferred:
        hand_over(run, agreement, settings, ready, time.perf_counter() - request.started)
        return
    _start_copy(run, agreement, settings, ready, follow)


def _start_copy(run: Run, agreement: Agreement, settings: Settings, ready: HandOver,
                follow: lazy.AfterWrite | None) -> None:
    """Starts a lazy snapshot's background copy (``run.copying`` until :func:`finish_copy`). A single-writer
    save is handed to the worker first, behind a gate the copy opens once it is proven (``gate.py``), so
    that its write starts the moment its bytes are copied, not at the next optimizer step. A collective
    save is handed over by :func:`finish_copy`: all ranks agree on its fate, and a write the ranks dropped
    must never be left in a worker's queue."""
    request, snapshot = ready.request, ready.snapshot
    gate = None
    if not request.collective:
        assert run.results_dir is not None
        gate = Gate(run.results_dir / f"{ready.order}.gate")
        ready.pending = hand_over(run, agreement, settings, ready, 0.0, gate)  # raises having dropped the save
        ready.pending.gate, ready.pending.behind_gate = gate, True
    try:
        ready.copy = lazy.BackgroundCopy(snapshot.deferred, ready.copy_hook, follow, gate)
    except BaseException:
        if ready.pending is None:
            _drop(run, request, ready.tmp, snapshot)
        else:  # raised here, once: its worker skips it (or gives up at timeout_s), reported by nobody
            ready.pending.behind_gate, ready.pending.abandoned = False, True
            with contextlib.suppress(OSError):
                ready.pending.gate.decide(False)
        raise
    ready.stall_s = time.perf_counter() - request.started
    if ready.pending is not None:
        ready.pending.copy, ready.pending.stall_s, ready.pending.lazy_nbytes = ready.copy, ready.stall_s, ready.copy.nbytes
    run.copying = ready
    log.debug("lightning-asyncckpt: %s: copying %d bytes lazily", request.path, ready.copy.nbytes)


def _follow(run: Run, settings: Settings, ready: HandOver) -> lazy.AfterWrite | None:
    """What the lazy copy waits for: nothing, or the end of the write whose buffers it follows into."""
    lease = ready.snapshot.buffer_set
    if lease is None or lease.ready.is_set():
        return None
    newest = _newest_write(run)
    assert newest is not None and newest.buffer_set.buffer_set is lease.buffer_set
    ready.follows = newest.order
    return lazy.AfterWrite(lease.ready, newest.result_path, settings.timeout_s)


def _lazy_rule(run: Run, settings: Settings) -> staging.Defer | None:
    """Which tensors a lazy snapshot leaves to the background copy (any layout). A forked writer's
    snapshot is the fork itself: taken at save time."""
    if settings.snapshot != "lazy" or not run.stager.copy_cpu:
        return None
    return run.tracked.rule()


def _serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _drop(run: Run, request: SaveRequest, tmp: Path | str, snapshot: staging.Snapshot | None) -> None:
    # this rank's own directory (a single writer's, or a remote save's local spool); a remote file is never visible
    if (not request.collective or isinstance(request.path, str)) and isinstance(tmp, Path):
        commit.try_remove(tmp, "the unfinished save")
    run.stager.release(snapshot.buffer_set if snapshot is not None else None)


def hand_over(run: Run, agreement: Agreement, settings: Settings, ready: HandOver, stall_s: float,
              gate: Gate | None = None) -> PendingSave:
    """Plans the save and hands its write to the worker; returns it, pending. On an error nothing of it
    is left behind (and the error is raised). ``gate``: the worker waits at it before reading the buffers."""
    assert run.engine is not None and run.results_dir is not None
    request, snapshot = ready.request, ready.snapshot
    result_path = run.results_dir / f"{ready.order}.result"
    gated = (gate.path, settings.timeout_s) if gate is not None else None
    try:
        if request.writes_file:
            ticket, plan = write_jobs.file_job(run, ready, result_path, gated), None
        else:
            planned = ready.planned or write_jobs.plan_dcp(run, agreement, settings, ready)
            ticket, plan = write_jobs.dcp_job(run, ready, planned, result_path, gated), planned.plan
    except BaseException:
        # bad input (e.g. an object that cannot be pickled): raised here, in the trainer
        _drop(run, request, ready.tmp, snapshot)
        raise
    save = PendingSave(
        order=ready.order, seq=request.seq, path=request.path, tmp=ready.tmp, ticket=ticket, plan=plan,
        result_path=result_path, buffer_set=snapshot.buffer_set, stall_s=stall_s,
        nbytes=snapshot.nbytes, step=request.step, collective=request.collective, faults=request.faults,
        writes_file=request.writes_file, call=request.call, lazy_nbytes=ready.copy.nbytes if ready.copy else 0,
    )
    run.pending.append(save)
    log.debug("lightning-asyncckpt: scheduled %s (%d bytes), stall %.4fs", request.path, snapshot.nbytes, save.stall_s)
    return save


def finish_copy(run: Run, agreement: Agreement, settings: Settings, within_s: float | None = None) -> None:
    """(the saving rank, on the training thread, before the state may change) Waits for the lazy snapshot
    in flight, if any; then hands a collective save's write over (a single writer's was handed over at save
    time, behind the gate its copy decides: nothing more to do when the copy is proven). A snapshot that changed while it was copied is never
    written: alone (no process group) :class:`CheckpointWriteError` is raised here; with one, the failure
    is recorded and the next finalize raises it on every rank. A copy that follows a write into its
    buffers waits for that write first, at most ``within_s`` (default ``timeout_s``; the exit drain's
    bound on the way out), polling it meanwhile so that a dead or hung worker is seen; past that the save
    is dropped."""
    ready, run.copying = run.copying, None
    if ready is None:
        return
    assert ready.copy is not None
    request, waited, early = ready.request, time.perf_counter(), ready.pending
    if ready.follows is not None and ready.snapshot.buffer_set is not None:
        _wait_for_buffers(run, settings, agreement.rank, ready, settings.timeout_s if within_s is None else within_s)
    problem = ready.copy.wait(settings.timeout_s)
    if early is not None and early.lost_worker:
        early = None  # the write before it lost the worker, which had this one queued: hand it over again
        ready.pending.gate.remove()
    if early is not None:
        early.behind_gate = False
        if early not in run.pending and not early.abandoned:  # committed already, or failed with its worker
            if ready.copy.done():  # (reported then): its buffers are free once nothing writes into them
                run.stager.release(early.buffer_set)
            return
        if problem is not None and not _skip(early):
            problem = None  # the copy was proven after all, in the moment since the wait gave up: it is written
        if problem is None:
            early.stall_s = ready.stall_s + time.perf_counter() - waited
            return
        early.abandoned = True  # its worker skips it (the poller takes it off the queue, reporting nothing)
        if ready.copy.done():  # nothing reads the buffers any more: the worker skips, the copy thread ended
            run.stager.release(early.buffer_set)
    elif problem is None:
        try:
            hand_over(run, agreement, settings, ready, ready.stall_s + time.perf_counter() - waited)
        except Exception as e:  # noqa: BLE001 - as at save time: a write failure, or bad input
            _failed_at_save_time(run, agreement, request, e)
        return
    else:  # the buffers are released only once the thread is done writing into them (else never reused)
        _drop(run, request, ready.tmp, ready.snapshot if ready.copy.done() else None)
    failure = RankFailure(agreement.rank, ready.copy.problem_type, problem)
    log.error("lightning-asyncckpt: save to %s failed: %s", request.path, problem)
    if not agreement.active:
        raise CheckpointWriteError(str(request.path), [failure])
    run.failures.record(Failed(ready.order, str(request.path), failure, request.seq))


def _skip(save: PendingSave) -> bool:
    """Tells the worker to skip ``save``'s write; False when the copy thread has said ``go`` first."""
    try:
        return save.gate.decide(False)
    except OSError:  # the results directory is gone: nothing can be written, the worker gives up on its own
        return True


def _wait_for_buffers(run: Run, settings: Settings, rank: int, ready: HandOver, within_s: float) -> None:
    # the copy starts by itself when the write before it reports; polling here commits that write and
    # notices a worker that died (its lease is then released too)
    assert ready.copy is not None and ready.snapshot.buffer_set is not None
    lease, deadline = ready.snapshot.buffer_set, time.monotonic() + within_s
    while not lease.ready.is_set() and not ready.copy.done() and time.monotonic() < deadline:
        poller.settle_local(run, settings, rank, blocking=False)
        lease.ready.wait(settings.poll_interval_s)
    if not lease.ready.is_set() and not ready.copy.done():
        ready.copy.cancel()  # one that has not started gives up; one that has finishes
