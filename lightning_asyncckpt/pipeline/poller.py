"""Local progress: this rank polls its own writes, commits finished single-writer saves, marks its parts
of collective saves as written, notices a dead or hung worker, and waits for room (``max_pending``).

Everything here is local to one rank: no collectives.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from pathlib import Path
from typing import NamedTuple

from lightning_asyncckpt.engines import Status
from lightning_asyncckpt.errors import CheckpointWriteError, RankFailure
from lightning_asyncckpt.pipeline.committer import commit_save, record_failure, settle_publishing
from lightning_asyncckpt.pipeline.run_state import Run
from lightning_asyncckpt.pipeline.save import Save, SaveState
from lightning_asyncckpt.pipeline.settings import Settings
from lightning_asyncckpt.storage import commit
from lightning_asyncckpt.write.gate import Skipped

log = logging.getLogger(__name__)


def settle_local(run: Run, settings: Settings, rank: int, blocking: bool, until: int | None = None) -> None:
    """(this rank) Polls own writes in order; commits finished single-writer saves, marks finished parts of
    collective saves as written (the ranks commit them together), records failures.

    Args:
        rank: this rank.
        blocking: wait for every write (else only settle those that ended).
        until: the order of the last save to wait for (None: all).
    """
    settle_publishing(run, rank, blocking and until is None, settings.timeout_s)
    while True:
        save = run.pending.next_to_poll(until)
        if save is None:
            return
        assert run.engine is not None
        status = run.engine.poll(save.ticket)
        if status is Status.RUNNING:
            if time.monotonic() - save.ticket.scheduled_at > settings.timeout_s:
                fail_all(run, rank, save, RankFailure(
                    rank, "TimeoutError",
                    f"the background write did not finish within timeout_s={settings.timeout_s:g}s; its worker was killed",
                ))
                return
            if not blocking:
                return
            time.sleep(settings.poll_interval_s)
            continue
        if status is Status.DEAD:
            fail_all(run, rank, save, RankFailure(rank, "WorkerDied", save.ticket.detail))
            return
        abandoned = save.state is SaveState.ABANDONED
        if not (abandoned and save.copy_running):  # a dropped lazy copy may still write into its buffers
            run.stager.release(save.buffer_set)
        results, failure = read_outcome(save, rank)
        if run.copying is save and failure is not None and failure.error_type == Skipped.__name__:
            save.to(SaveState.ABANDONED)  # its copy shut the gate: the training thread's finish_copy reports why
            abandoned = True
        if save.gate is not None:
            save.gate.remove()
        if abandoned:  # its failure is reported by its copy's settling; its worker wrote nothing
            run.pending.remove(save)
            if isinstance(save.tmp, Path):
                commit.try_remove(save.tmp, "the dropped save")
            continue
        if failure is None and save.collective:
            save.wrote(results)
            continue
        run.pending.remove(save)
        if failure is None:
            failure = commit_save(run, save, [results], rank, coordinator=True)
        if failure is not None:
            record_failure(run, save, failure, rank)


def wait_for_local_writes(run: Run, settings: Settings, rank: int) -> None:
    """(this rank) Waits for every write in flight here, saying so (it holds training up)."""
    if run.engine is not None and run.pending.unwritten():
        log.info("lightning-asyncckpt: waiting for %d checkpoint write(s) before going on", len(run.pending.unwritten()))
        settle_local(run, settings, rank, blocking=True)


def settle_for(run: Run, settings: Settings, rank: int, path: Path) -> None:
    """(this rank, before reading ``path``) Waits for this rank's writes; a failed save at ``path`` is raised."""
    if run.engine is not None:
        settle_local(run, settings, rank, blocking=True)
    failed = run.failures.for_path(str(path))
    if failed is not None:
        raise CheckpointWriteError(failed.path, [failed.failure])


def wait_for_path(run: Run, settings: Settings, rank: int, url: str, persistent: bool) -> None:
    """(before a remote save, ahead of any collective planning) Waits for the ``.metadata`` upload of an
    earlier directory save to the same URL: the new save's workers overwrite its shards, so an old
    ``.metadata`` landing after them would make a torn checkpoint look complete. With forked writers, also
    waits for this rank's earlier saves to that URL: an object appears when its upload completes, not in
    commit order. (The persistent worker writes in order.)"""
    settle_publishing(run, rank, False, settings.timeout_s, url=url)
    if persistent:
        return
    for save in run.pending:
        if save.path == url:
            settle_local(run, settings, rank, blocking=True, until=save.order)


def wait_for_room(run: Run, settings: Settings, rank: int) -> None:
    """Each write in progress holds one copy of the state: wait until fewer than ``max_pending`` are (a
    collective save whose part is written has released its buffers)."""
    while True:
        unwritten = run.pending.unwritten()
        if len(unwritten) < settings.max_pending:
            return
        oldest = unwritten[0]
        settle_local(run, settings, rank, blocking=True, until=oldest.order)
        if oldest in run.pending and oldest.state is not SaveState.WRITTEN:
            return  # cannot progress locally (it waits for a collective commit): go on rather than spin


class Outcome(NamedTuple):
    """The worker's report for one save: its write results, or what went wrong (``failure``)."""

    results: list
    failure: RankFailure | None


def read_outcome(save: Save, rank: int) -> Outcome:
    """The worker's report for ``save``: its write results, or what went wrong. Its own figures (write
    time, file size) go to the save."""
    assert save.result_path is not None
    try:
        with open(save.result_path, "rb") as f:
            outcome = pickle.load(f)
        os.unlink(save.result_path)
    except FileNotFoundError:
        return Outcome([], RankFailure(rank, "WorkerDied", "the checkpoint worker exited without reporting a result"))
    if not outcome["ok"]:
        return Outcome([], RankFailure(rank, outcome["error_type"], outcome["message"], outcome["errno"]))
    save.reported(float(outcome.get("write_s", 0.0)), int(outcome.get("nbytes", 0)))
    return Outcome(outcome["results"], None)


def fail_all(run: Run, rank: int, lost: Save, failure: RankFailure) -> None:
    """The worker is dead or hung: every save queued on it is lost, and the next save starts a new one.
    A collective save whose part this rank already wrote is not lost: it still commits."""
    assert run.engine is not None
    run.engine.reset_after_failure()
    for save in run.pending.take_where(lambda s: s.state is not SaveState.WRITTEN):
        run.workers.kill(save.ticket)
        if run.copying is save and save is not lost and save.state is SaveState.WRITING:
            # queued behind the lost write, its copy not yet settled: the training thread hands it to the
            # next worker (its buffers still hold its snapshot)
            save.to(SaveState.LOST)
            continue
        if not save.copy_running:  # an abandoned copy still running keeps its buffers
            run.stager.release(save.buffer_set)
        if save.state is SaveState.ABANDONED:  # reported when its copy failed: only its hidden file goes
            if isinstance(save.tmp, Path):
                commit.try_remove(save.tmp, "the dropped save")
        else:
            record_failure(run, save, failure, rank)
