"""Commit and retention: a written save becomes a checkpoint (a file: atomic replace; a DCP directory:
``.metadata`` -> atomic publish; then the record),
and the removals Lightning asked for (top-k) run once nothing newer can still fail.

Which ranks call what is said per function; every function here runs on the training thread.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from lightning_asyncckpt.collectives.agreement import Agreement
from lightning_asyncckpt.errors import CheckpointWriteError, RankFailure
from lightning_asyncckpt.pipeline.failures import Failed
from lightning_asyncckpt.pipeline.records import SaveRecord, written_bytes
from lightning_asyncckpt.pipeline.run_state import Run
from lightning_asyncckpt.pipeline.save import Save, SaveState
from lightning_asyncckpt.storage import commit

log = logging.getLogger(__name__)


def commit_save(run: Run, save: Save, all_results: list, rank: int, coordinator: bool) -> RankFailure | None:
    """write complete -> (coordinator) .metadata -> publish -> record -> removals that waited for it.
    A failure is returned as a value: the caller raises it on every rank.

    A remote DCP directory is published by uploading its ``.metadata`` in the run's background thread
    (the training thread does no remote I/O): the coordinator records it once that upload is done
    (:func:`settle_publishing`); a failed upload is raised on every rank by the next finalize.

    Args:
        all_results: every rank's write results (one list per rank).
        rank: this rank.
        coordinator: this rank writes the metadata and publishes (rank 0; the only rank of a single writer).

    Returns:
        None once committed (or being published), else the failure.
    """
    if coordinator:
        try:
            save.faults.check(save.faults.before_metadata, save.path)
            if not save.writes_file:  # a file is complete when written; a DCP directory once .metadata is
                save.plan.writer.finish(save.plan.metadata, all_results)
            save.faults.check(save.faults.before_publish, save.path)
            if save.remote and not save.writes_file:  # its .metadata is uploaded off the training thread
                run.remote.publish(save, all_results)
                save.to(SaveState.PUBLISHING)
                return None
            save.destination.publish(save.tmp, save.writes_file)  # a remote file was visible once uploaded
        except Exception as e:  # noqa: BLE001 - becomes a value, raised on every rank by finalize
            return RankFailure.from_exception(rank, e)
    record_commit(run, save, all_results, rank)
    return None


def settle_publishing(run: Run, rank: int, blocking: bool, timeout_s: float, url: str | None = None) -> None:
    """(the coordinator, while polling) Records the remote directories whose ``.metadata`` upload ended
    (``blocking``: waits for each; ``url``: only for those up to the last one to that URL). A failed
    upload, or one still running ``timeout_s`` after it began, is recorded for the next finalize to raise
    on every rank."""
    for publish, error in run.remote.settled(blocking, timeout_s, url):
        if error is not None:
            record_failure(run, publish.save, RankFailure.from_exception(rank, error), rank)
        else:
            record_commit(run, publish.save, publish.results, rank)


def record_commit(run: Run, save: Save, all_results: list, rank: int) -> None:
    """The save is a checkpoint now: its record, and the removals that waited for it."""
    costs = save.costs
    record = SaveRecord(
        path=str(save.path), step=save.step, stall_s=costs.stall_s, write_s=time.monotonic() - costs.handed_at,
        nbytes=costs.file_nbytes if save.writes_file else written_bytes(all_results), local_nbytes=save.nbytes,
        pending=len(run.pending) - (save in run.pending), worker_s=costs.write_s, lazy_nbytes=costs.lazy_nbytes,
    )
    save.to(SaveState.COMMITTED)
    run.ledger.record(record, save.call)
    if save.remote and isinstance(save.tmp, Path):
        commit.try_remove(save.tmp, "the uploaded spool directory")  # this rank's local copy
    if rank == 0:
        log.info("lightning-asyncckpt: %s", record.summary())
    log.debug(
        "lightning-asyncckpt: %s: stall %.4f s, worker write %.3f s, scheduled-to-commit %.3f s, %d bytes"
        " staged here, %d pending", save.path, record.stall_s, record.worker_s, record.write_s,
        record.local_nbytes, record.pending,
    )
    run.retention.committed(save.order)  # the removals that waited for it


def commit_collective(run: Run, agreement: Agreement, save: Save) -> None:
    """(all ranks, same order) Gathers every rank's write results to the coordinator, which writes the
    metadata and publishes; then every rank learns the outcome and raises the same error.

    The save leaves the queue only after the gathers: if one of them fails (a rank that never comes on
    the way out), it is still pending, and closing the run removes its directory."""
    all_results = agreement.all_gather(save.written)
    coordinator = agreement.rank == 0
    failure = commit_save(run, save, all_results, agreement.rank, coordinator) if coordinator else None
    failure = agreement.all_gather(failure)[0]
    run.pending.remove(save)
    if failure is not None:
        if coordinator or save.remote:  # every rank's part of it was written (a remote one: in its own spool)
            commit.try_remove(save.tmp, "the failed save")
        drop_collective_pending(run, agreement.rank)
        agreement.all_max([0])  # every rank has stopped its writers
        run.retention.remove_doomed()
        raise CheckpointWriteError(str(save.path), [failure])
    if not coordinator:
        commit_save(run, save, all_results, agreement.rank, coordinator=False)


def drop_collective_pending(run: Run, rank: int) -> None:
    """After an agreed failure, the other saves written by all ranks together cannot complete
    consistently: stop them everywhere (their directories go once every rank has stopped)."""
    dropped = run.pending.take_where(lambda s: s.collective)
    for save in dropped:
        run.workers.kill(save.ticket)
        run.stager.release(save.buffer_set)
        discard_tmp(run, save, rank)
        save.to(SaveState.DROPPED)
    if dropped and run.engine is not None and run.engine.persistent:
        run.engine.reset_after_failure()


def discard_tmp(run: Run, save: Save, rank: int) -> None:
    """Removes a failed save's partial directory. Other ranks may still be writing into a collective
    save's directory: the coordinator removes it once every rank has stopped (``Retention.remove_doomed``)."""
    if not isinstance(save.tmp, Path):
        return  # a remote file, never visible: the worker discarded the upload (a killed one leaves an incomplete upload)
    if save.collective and not save.remote:  # a remote one's parts are in each rank's own spool
        if rank == 0:
            run.retention.doom(save.tmp)
    else:
        commit.try_remove(save.tmp, "the failed save")


def record_failure(run: Run, save: Save, failure: RankFailure, rank: int) -> None:
    """(this rank) ``save`` failed: what it left goes, and the failure is recorded for the next finalize."""
    discard_tmp(run, save, rank)
    try:
        os.unlink(save.result_path)
    except OSError:
        pass  # the worker never reported
    if not save.ended:
        save.to(SaveState.FAILED)
    run.failures.record(Failed(save.order, str(save.path), failure, save.seq))
    log.error("lightning-asyncckpt: save to %s failed: %s", save.path, failure.describe())


def request_removal(run: Run, path: Path | str) -> None:
    """(the ranks Lightning calls ``remove_checkpoint`` on) ``path`` goes once every save scheduled so far
    has committed: a checkpoint still being written is never deleted, and the newest committed one is
    kept until a newer one commits."""
    run.retention.request(path, run.order)
