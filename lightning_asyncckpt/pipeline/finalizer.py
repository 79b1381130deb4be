"""The cross-rank finalize protocol: the ranks agree on how far every save got and on any failure, commit
collective saves together, and raise a failure on every rank, once.

One agreement round (a small all-reduce of four integers, :meth:`Agreement.max_min`) per poll: the
highest ``any_failed`` and ``any_pending`` (and, on the way out, ``out_of_time``), and the lowest
``ready_through`` and ``first_failed`` over the ranks.
Saves before the first failed one still commit: a good checkpoint is never dropped for a later failure.
"""

from __future__ import annotations

import time

from lightning_asyncckpt.collectives import Agreement
from lightning_asyncckpt.pipeline.committer import commit_collective, drop_collective_pending
from lightning_asyncckpt.pipeline.poller import settle_local
from lightning_asyncckpt.pipeline.run_state import Run
from lightning_asyncckpt.pipeline.save import SaveState
from lightning_asyncckpt.pipeline.settings import Settings


def finalize(
    run: Run, agreement: Agreement, settings: Settings, blocking: bool, force: bool, deadline: float | None = None,
) -> None:
    """(all ranks, same order) Commits what every rank has written; raises an agreed failure everywhere.

    ``force`` agrees even when no rank announced a save (explicit calls, teardown, Fabric); the
    callback's per-batch call agrees only while an announced save is unsettled, so that a run without
    pending saves pays no collective. ``deadline`` (the way out) stops waiting once any rank's time is
    up, agreed. ``agreement`` is the group to agree over (the training group, or the exit group)."""
    rank = agreement.rank
    if not agreement.active:
        settle_local(run, settings, rank, blocking=blocking)
        run.failures.raise_local()
        return
    if not (force or run.count.unsettled()):
        return
    count = run.count
    while True:
        settle_local(run, settings, rank, blocking=False)
        ready_through = run.pending.ready_through(count.announced)
        copying = run.copying.seq if run.copying is not None else None  # a lazy snapshot not handed over
        if copying is not None:
            ready_through = min(ready_through, copying - 1)
        first_failed = run.failures.first_failed_seq(after_all=count.announced + 1)
        flags = [int(bool(run.failures)), int(bool(run.unsettled()))]
        if deadline is not None:
            flags.append(int(time.monotonic() > deadline))
        agreed = agreement.max_min(most=flags, least=[ready_through, first_failed])
        (any_failed, any_pending, *out_of_time), (ready, first_failed) = agreed.most, agreed.least
        while (head := run.pending.head()) is not None and head.state is SaveState.WRITTEN \
                and head.seq <= ready and head.seq < first_failed:
            commit_collective(run, agreement, head)  # same saves, same order, on every rank
        if any(out_of_time):
            return
        if any_failed:
            if ready + 1 >= first_failed:
                raise_agreed_failures(run, agreement)
            # A save before the failed one is still being written on some rank: it commits first. Every
            # rank takes this branch.
            time.sleep(settings.poll_interval_s)
            continue
        count.agreed_through(ready)
        if not blocking or (not any_pending and count.reported >= count.announced):
            return
        time.sleep(settings.poll_interval_s)


def raise_agreed_failures(run: Run, agreement: Agreement) -> None:
    """(all ranks) Every rank stops its other collective saves, learns every failure, and raises the
    same error."""
    drop_collective_pending(run, agreement.rank)
    error = run.failures.gather(agreement)
    run.retention.remove_doomed()  # every rank has stopped its writers before the gather
    raise error
