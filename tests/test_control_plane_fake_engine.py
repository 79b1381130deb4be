"""The control plane against a fake engine: scheduling, polling, commit order, a dead or hung worker and a
failed write, as pure logic on one rank. The fake engine queues each job and runs it in this process only
when the test says so (the real write job, into real files), or lets it die; no worker process, no timing.

The real-process tests (``test_io``, ``test_reliability``) prove the same rules end to end; these name the
rule that breaks."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_asyncckpt import engines
from lightning_asyncckpt.collectives.agreement import Agreement
from lightning_asyncckpt.engines import Status, Ticket
from lightning_asyncckpt.errors import CheckpointWriteError
from lightning_asyncckpt.format.layout import Layout
from lightning_asyncckpt.pipeline import poller, scheduler
from lightning_asyncckpt.pipeline.run_state import Run
from lightning_asyncckpt.pipeline.save import Save, SaveState
from lightning_asyncckpt.pipeline.settings import Settings
from lightning_asyncckpt.testing import FailWrite


class FakeEngine:
    """An engine whose jobs run when :meth:`run` says so, in this process; :meth:`die` loses the worker."""

    persistent = True
    version = "fake"

    def __init__(self) -> None:
        real = engines.create(engines.EngineName.NVRX, engines.WorkerMode.FORK, 0)  # for its DCP writer class
        self.writer_cls, self.split_by_size = real.writer_cls, real.split_by_size
        self.jobs: list[tuple[Ticket, Any, tuple]] = []
        self.done: set[int] = set()
        self.dead = False
        self.resets = self.kills = 0

    def start(self, timeout_s: float = 0, directories: bool = True) -> None:
        pass

    def schedule(self, fn: Any, args: tuple) -> Ticket:
        ticket = Ticket(call_idx=len(self.jobs), scheduled_at=time.monotonic())
        self.jobs.append((ticket, fn, args))
        return ticket

    def run(self, index: int) -> None:
        ticket, fn, args = self.jobs[index]
        fn(*args)
        self.done.add(ticket.call_idx)

    def die(self) -> None:
        self.dead = True

    def poll(self, ticket: Ticket) -> Status:
        if ticket.call_idx in self.done:
            return Status.FINISHED
        if self.dead:
            ticket.detail = "the fake worker died"
            return Status.DEAD
        return Status.RUNNING

    def kill(self, ticket: Ticket) -> None:
        self.kills += 1

    def worker_pids(self) -> list[int]:
        return []

    def close(self, abort: bool = False) -> None:
        pass

    def reset_after_failure(self) -> None:
        self.resets += 1
        self.dead = False


@pytest.fixture
def plane(tmp_path):
    """A run on one rank with the fake engine, and a ``save(path, value, hook=None)`` that schedules one."""
    run = Run(engines.EngineName.NVRX, engines.WorkerMode.PERSISTENT, history=[], engine=FakeEngine())
    settings = Settings(engines.EngineName.NVRX, engines.WorkerMode.PERSISTENT, timeout_s=60, max_pending=4)
    alone = Agreement.alone()

    def save(name: str, value: float, hook: Any = None, calls: list = []) -> Save:  # noqa: B006 - a counter
        calls.append(name)
        s = Save({"w": torch.full((64,), value), "step": int(value)}, tmp_path / name, Layout.SINGLE_WRITER,
                 collective=False, seq=None, called_at=time.perf_counter(), writes_file=True, call=len(calls),
                 write_hook=hook)
        scheduler.submit(run, alone, settings, s, None, on_first_collective=lambda: None)
        return s

    yield run, run.engine, settings, save
    run.close(rank=0, abort=True)


def _value(path: Path) -> float:
    return float(torch.load(path, weights_only=True)["w"][0])


def test_single_writer_saves_commit_in_order_whatever_order_their_writes_end(plane, tmp_path):
    run, engine, settings, save = plane
    a, b = save("a.ckpt", 1.0), save("b.ckpt", 2.0)
    assert (a.state, b.state) == (SaveState.WRITING, SaveState.WRITING)
    engine.run(1)  # b's write ends first
    poller.settle_local(run, settings, 0, blocking=False)
    assert b.state is SaveState.WRITING and not (tmp_path / "b.ckpt").exists()  # not before a
    engine.run(0)
    poller.settle_local(run, settings, 0, blocking=False)
    assert (a.state, b.state) == (SaveState.COMMITTED, SaveState.COMMITTED)
    assert [r.path for r in run.history] == [str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")]
    assert (_value(tmp_path / "a.ckpt"), _value(tmp_path / "b.ckpt")) == (1.0, 2.0)
    assert len(run.pending) == 0


def test_a_dead_worker_fails_every_save_queued_on_it_and_the_next_save_works(plane, tmp_path):
    run, engine, settings, save = plane
    a, b = save("a.ckpt", 1.0), save("b.ckpt", 2.0)
    engine.die()
    poller.settle_local(run, settings, 0, blocking=False)
    assert (a.state, b.state) == (SaveState.FAILED, SaveState.FAILED) and engine.resets == 1
    with pytest.raises(CheckpointWriteError, match="the fake worker died") as info:
        run.failures.raise_local()
    assert info.value.path == str(tmp_path / "a.ckpt")
    c = save("c.ckpt", 3.0)
    engine.run(2)
    poller.settle_local(run, settings, 0, blocking=False)
    assert c.state is SaveState.COMMITTED and _value(tmp_path / "c.ckpt") == 3.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]  # nothing of a or b is left


def test_a_failed_write_leaves_the_checkpoint_before_it_whole(plane, tmp_path):
    run, engine, settings, save = plane
    first = save("last.ckpt", 1.0)
    engine.run(0)
    poller.settle_local(run, settings, 0, blocking=False)
    failed = save("last.ckpt", 2.0, hook=FailWrite(28))  # ENOSPC in the writer
    engine.run(1)
    poller.settle_local(run, settings, 0, blocking=False)
    assert (first.state, failed.state) == (SaveState.COMMITTED, SaveState.FAILED)
    assert _value(tmp_path / "last.ckpt") == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_write_running_past_timeout_s_is_given_up(plane, tmp_path):
    run, engine, settings, save = plane
    hung = save("a.ckpt", 1.0)
    hung.ticket.scheduled_at -= settings.timeout_s + 1  # as if it had run that long
    poller.settle_local(run, settings, 0, blocking=False)
    assert hung.state is SaveState.FAILED and engine.resets == 1
    with pytest.raises(CheckpointWriteError, match="timeout_s=60s"):
        run.failures.raise_local()


def test_a_lazy_copy_that_cannot_start_raises_its_error_and_leaves_nothing(tmp_path, monkeypatch):
    """A single writer's lazy save is handed to the worker behind its gate before its copy starts; a copy
    that cannot start raises its own error from the save call, shuts the gate (the worker skips the write)
    and leaves no file."""
    from lightning_asyncckpt.snapshot import lazy

    engine = FakeEngine()
    run = Run(engines.EngineName.NVRX, engines.WorkerMode.PERSISTENT, history=[], engine=engine)
    settings = Settings(engines.EngineName.NVRX, engines.WorkerMode.PERSISTENT, snapshot="lazy", timeout_s=60)
    param = torch.nn.Parameter(torch.zeros(1 << 15))  # above the lazy threshold
    opt = torch.optim.SGD([param], lr=0.1)  # tracked weakly: kept alive here
    run.tracked.track([opt])

    def cannot_start(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(lazy, "BackgroundCopy", cannot_start)
    save = Save({"p": param}, tmp_path / "a.ckpt", Layout.SINGLE_WRITER, collective=False, seq=None,
                called_at=time.perf_counter(), writes_file=True, call=1)
    try:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            scheduler.submit(run, Agreement.alone(), settings, save, None, on_first_collective=lambda: None)
        assert save.state is SaveState.ABANDONED and save.gate is not None
        engine.run(0)  # the worker finds the gate shut and writes nothing
        poller.settle_local(run, settings, 0, blocking=False)
        assert len(run.pending) == 0 and list(tmp_path.iterdir()) == []
    finally:
        run.close(rank=0, abort=True)
