"""The control plane's bookkeeping as pure logic (no engine, no process): the cross-rank save count and
the pending queue's ordering invariants. The real-process tests (``test_io``, ``test_ddp``) prove the
same behaviour end to end; these name the rule that breaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_asyncckpt.engines import Ticket
from lightning_asyncckpt.format.layout import Layout
from lightning_asyncckpt.pipeline.pending import PendingQueue
from lightning_asyncckpt.pipeline.run_state import SaveCount
from lightning_asyncckpt.pipeline.save import TRANSITIONS, Save, SaveState, TransitionError


def _save(order: int, seq: int | None = None, collective: bool = False) -> Save:
    save = Save({}, Path(f"/c/{order}"), Layout.SINGLE_WRITER, collective, seq, called_at=0.0)
    save.placed(order, Path(f"/c/.t{order}"), rank=0)
    save.handed_over(Ticket(call_idx=order, scheduled_at=0.0), None, Path(f"/r/{order}"), gate=None, stall_s=0.0)
    return save


def _written(save: Save) -> None:
    save.wrote([])


def test_a_save_takes_the_announced_number_or_a_collective_one_counts_itself():
    count = SaveCount()
    assert count.claim(collective=False) is None  # rank 0 saving what no rank announced: uncounted
    count.announce()  # every rank was told of a save (on_save_checkpoint)
    assert count.unsettled()
    assert count.claim(collective=False) == 1
    assert count.claim(collective=True) == 2  # Fabric's collective save: every rank is here, it counts itself
    count.settle_all()
    assert not count.unsettled() and count.reported == count.consumed == 2


def test_a_single_writer_save_is_polled_only_at_the_head_behind_collective_ones():
    queue = PendingQueue()
    shared, solo = _save(1, seq=1, collective=True), _save(2, seq=2)
    queue.append(shared)
    queue.append(solo)
    assert queue.next_to_poll() is shared
    _written(shared)  # this rank's part is on disk; the ranks commit it together later
    assert queue.next_to_poll() is None  # the single writer behind it waits for that commit
    assert queue.solo_waiting() == []
    assert queue.ready_through(announced=2) == 1  # the single writer (seq 2) is not committed yet
    queue.remove(shared)
    assert queue.next_to_poll() is solo and queue.solo_waiting() == [solo]
    assert queue.next_to_poll(until=1) is None  # not past the bound the caller gives


def test_ready_through_stops_below_the_oldest_unwritten_counted_save():
    queue = PendingQueue()
    for save in (_save(1, seq=1, collective=True), _save(2, seq=3, collective=True), _save(3)):
        queue.append(save)
    assert queue.ready_through(announced=5) == 0
    _written(next(iter(queue)))
    assert queue.ready_through(announced=5) == 2  # seq 3 is still being written here
    taken = queue.take_where(lambda s: s.collective)
    assert [s.order for s in taken] == [1, 2] and [s.order for s in queue] == [3]
    assert queue.ready_through(announced=5) == 5


def test_a_save_moves_only_along_its_transitions():
    save = _save(1)
    assert save.state is SaveState.WRITING and save.costs.handed_at > 0
    save.to(SaveState.ABANDONED)  # its lazy copy failed: the worker skips it
    with pytest.raises(TransitionError, match="abandoned -> committed"):
        save.to(SaveState.COMMITTED)  # an abandoned save never commits
    save.to(SaveState.DROPPED)
    assert save.ended
    for end in (SaveState.COMMITTED, SaveState.FAILED, SaveState.DROPPED):
        assert TRANSITIONS[end] == frozenset()  # nothing follows an end
    reachable, todo = set(), [SaveState.REQUESTED]
    while todo:
        for nxt in TRANSITIONS[todo.pop()] - reachable:
            reachable.add(nxt)
            todo.append(nxt)
    assert reachable == set(SaveState) - {SaveState.REQUESTED}  # every state is used


def test_a_gated_save_whose_worker_died_is_handed_over_again_never_committed_twice():
    save = _save(1)
    save.to(SaveState.LOST)
    with pytest.raises(TransitionError):
        save.to(SaveState.WRITTEN)  # a lost write reports nothing
    save.to(SaveState.WRITING)  # the next worker has it
    save.to(SaveState.COMMITTED)
    with pytest.raises(TransitionError):
        save.to(SaveState.FAILED)
