"""The other half of a lazy save: its background copy settled, on the training thread, before the state
may change (the wait before the optimizer step, or any entry that follows a change: the next save,
finalize, load, teardown, abort).

Where the save stands then decides what happens, one case per state (``save.SaveState``):

- ``COPYING`` (a collective save, not yet handed over): proven, it is handed to the worker; torn or failed,
  it is dropped and the failure recorded.
- ``WRITING`` behind its gate (a single writer, handed over at save time): proven, nothing more to do (the
  copy thread opened the gate); torn, the gate is shut, so its worker skips it (``ABANDONED``).
- ``LOST`` (its worker died while it waited at the gate): proven, it is handed to the next worker.
- ``ABANDONED`` (the worker already skipped it), or ended (committed, or failed with its worker): its
  buffers are freed once the copy thread is done; an abandoned one's failure is recorded here, once.
"""

from __future__ import annotations

import logging
import time

from lightning_asyncckpt.collectives.agreement import Agreement
from lightning_asyncckpt.errors import CheckpointWriteError, RankFailure
from lightning_asyncckpt.pipeline import poller
from lightning_asyncckpt.pipeline.failures import Failed
from lightning_asyncckpt.pipeline.run_state import Run
from lightning_asyncckpt.pipeline.save import Save, SaveState
from lightning_asyncckpt.pipeline.scheduler import drop, fail_at_save_time, hand_over
from lightning_asyncckpt.pipeline.settings import Settings

log = logging.getLogger(__name__)
S = SaveState


def finish_copy(run: Run, agreement: Agreement, settings: Settings, within_s: float | None = None) -> None:
    """(the saving rank, on the training thread, before the state may change) Waits for the lazy snapshot
    in flight, if any, and settles it as the module docstring says. A snapshot that changed while it was
    copied is never written: alone (no process group) :class:`CheckpointWriteError` is raised here; with
    one, the failure is recorded and the next finalize raises it on every rank. A copy that follows a
    write into its buffers waits for that write first, at most ``within_s`` (default ``timeout_s``; the
    exit drain's bound on the way out), polling it meanwhile so that a dead or hung worker is seen; past
    that the save is dropped."""
    save = run.copying
    if save is None:
        return
    assert save.copy is not None
    waited = time.perf_counter()
    try:  # still run.copying while it waits: the poller tells a write queued behind its gate (LOST) by that
        if save.staged.follows is not None and save.buffer_set is not None:
            _wait_for_buffers(run, settings, agreement.rank, save, settings.timeout_s if within_s is None else within_s)
        problem = save.copy.wait(settings.timeout_s)
    finally:
        run.take_copy()
    if save.state is S.LOST:  # the worker that had it queued is gone: its gate goes, it is handed over anew
        save.ungated()
    if save.gate is not None:
        problem = _settle_gated(run, save, problem)
        if problem is None:
            save.stalled(time.perf_counter() - waited)
            return
    elif problem is None:
        try:
            hand_over(run, agreement, settings, save, save.costs.stall_s + time.perf_counter() - waited)
        except Exception as e:  # noqa: BLE001 - as at save time: a write failure, or bad input
            save.to(S.FAILED)
            fail_at_save_time(run, agreement, save, e)
        return
    else:  # the buffers are released only once the thread is done writing into them (else never reused)
        drop(run, save, save.snapshot if save.copy.done() else None)
        save.to(S.FAILED)
    assert problem is not None
    failure = RankFailure(agreement.rank, save.copy.problem_type, problem)
    log.error("lightning-asyncckpt: save to %s failed: %s", save.path, problem)
    if not agreement.active:
        raise CheckpointWriteError(str(save.path), [failure])
    run.failures.record(Failed(save.order, str(save.path), failure, save.seq))


def _settle_gated(run: Run, save: Save, problem: str | None) -> str | None:
    """A single writer handed over behind its gate: ``None`` once nothing is left to report, else the
    problem to record (the save is then ``ABANDONED``: its worker skips it)."""
    assert save.copy is not None
    if save.ended or save.state is S.PUBLISHING:  # committed (or being published), or failed with its worker
        if save.copy.done():  # its buffers are free once nothing writes into them
            run.stager.release(save.buffer_set)
        return None
    if save.state is S.WRITING and problem is not None and not _skip(save):
        problem = None  # the copy was proven after all, in the moment since the wait gave up: it is written
    if problem is None:
        return None
    if save.state is S.WRITING:
        save.to(S.ABANDONED)  # its worker skips it (the poller takes it off the queue, reporting nothing)
    if save.copy.done():  # nothing reads the buffers any more: the worker skips, the copy thread ended
        run.stager.release(save.buffer_set)
    return problem


def _skip(save: Save) -> bool:
    """Tells the worker to skip ``save``'s write; False when the copy thread has said ``go`` first."""
    assert save.gate is not None
    try:
        return save.gate.decide(False)
    except OSError:  # the results directory is gone: nothing can be written, the worker gives up on its own
        return True


def _wait_for_buffers(run: Run, settings: Settings, rank: int, save: Save, within_s: float) -> None:
    # the copy starts by itself when the write before it reports; polling here commits that write and
    # notices a worker that died (its lease is then released too)
    assert save.copy is not None and save.buffer_set is not None
    lease, deadline = save.buffer_set, time.monotonic() + within_s
    while not lease.ready.is_set() and not save.copy.done() and time.monotonic() < deadline:
        poller.settle_local(run, settings, rank, blocking=False)
        lease.ready.wait(settings.poll_interval_s)
    if not lease.ready.is_set() and not save.copy.done():
        save.copy.cancel()  # one that has not started gives up; one that has finishes
