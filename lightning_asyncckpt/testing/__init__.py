"""Fault injection that reaches the real background writer, for this package's tests and for yours.

A class-level monkeypatch in the trainer does not reach a spawned writer process. Faults here travel
as picklable hooks that the worker (spawned or forked) runs just before it writes a save's shards, or
are applied by the coordinator while it commits. Switch them on

- in Python, around the code that trains (``inject_faults`` also exports them to processes started
  inside the block, such as the ranks Lightning launches)::

      from lightning_asyncckpt.testing import Fault, inject_faults

      with inject_faults(Fault("enospc", ranks=[1], saves=[2])):
          trainer.fit(model)  # the second save of rank 1 fails with ENOSPC; every rank raises

- in pytest, with the ``asyncckpt_faults`` fixture (registered when the package is installed);
- or for an unmodified training script, with the environment::

      LIGHTNING_ASYNCCKPT_FAULTS="enospc:rank=1,save=2" python train.py

Fault kinds (``Fault.kind``):

========== ==================================================================================
enospc     ``OSError(ENOSPC)`` raised by the background write (a full disk)
eio        ``OSError(EIO)`` raised by the background write (a failing disk)
permission ``PermissionError(EACCES)`` raised by the background write
slow       the background write sleeps ``delay`` seconds first (a slow filesystem; with a
           small ``timeout_s`` it becomes a timeout)
crash      the writer process exits hard in the middle of writing a shard file
metadata   the coordinator (global rank 0) fails writing ``.metadata``
commit     the coordinator fails the final rename that publishes the checkpoint
snapshot   ``MemoryError`` raised in the trainer as it takes the snapshot, on that rank alone (before
           any collective of the save: the host memory for the staging buffers ran out)
handover   ``OSError(ENOSPC)`` raised in the trainer as it hands the planned write to the worker, on
           that rank alone (after the ranks planned the save together)
========== ==================================================================================

Coordinator faults fire on global rank 0, which commits every checkpoint. The pipeline sees all of
them through one policy object (:class:`lightning_asyncckpt.faults.injected.EnvironmentFaults` by default),
never through their names.

Targets: ``ranks`` (global ranks, default all), ``saves`` (the n-th save of the ``AsyncCheckpointIO``
on that rank, counting from 1; default every save), ``engine`` (``nvrx``/``mcore``) and ``worker``
(``persistent``/``fork``); default any. In the environment: ``kind[:key=value,...]`` with keys ``rank``,
``save`` (several values separated by ``+``, e.g. ``rank=0+1``), ``engine``, ``worker``, ``delay``;
several faults separated by ``;``.

The local tier's files (:class:`~lightning_asyncckpt.LocalTier`) between two runs of a job: a node lost, a share's
copy corrupted or gone, in :mod:`lightning_asyncckpt.testing.local_tier`. The ``asyncckpt_faults`` fixture is
:mod:`lightning_asyncckpt.testing.pytest_plugin`'s.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from lightning_asyncckpt.faults.injected import (
    COORDINATOR_KINDS,
    KINDS,
    SAVE_TIME_KINDS,
    WORKER_KINDS,
    CrashWrite,
    DelayWrite,
    FailAt,
    FailWrite,
    Fault,
    FaultList,
    active_faults,
    faults_for,
    inject_faults,
    parse_faults,
)
from lightning_asyncckpt.faults.policy import ENV_VAR, ChainedHooks, SaveFaults

__all__ = [
    "COORDINATOR_KINDS", "ENV_VAR", "KINDS", "SAVE_TIME_KINDS", "WORKER_KINDS", "ChainedHooks", "CrashWrite",
    "DelayWrite", "FailAt", "FailWrite", "Fault", "FaultList", "HoldCopy", "HoldWrite", "SaveFaults",
    "active_faults", "faults_for", "inject_faults", "parse_faults", "Hooks",
]

Hooks = ChainedHooks  # several write hooks, run in order


@dataclass(frozen=True)
class HoldWrite:
    """Holds every background write until ``release_file`` exists, so that a test knows a write is still
    in flight instead of hoping a slow one is: ``started_file`` (if given) is created when a write reaches
    the hook; ``release()`` lets the held writes go (and every later one). A write held longer than
    ``timeout_s`` fails with ``TimeoutError``, so a test that never releases does not hang::

        hold = HoldWrite(str(tmp / "release"), started_file=str(tmp / "started"))
        io.write_hook = hold
        io.save_checkpoint(state, path)
        hold.wait_started()  # the writer has the save
        ...                  # the write is in flight for sure
        hold.release()

    ``at="end"`` holds each write at its other end instead: every byte is written and the files closed,
    but the trainer is not told yet (a slow final flush or upload acknowledgement). ``started_file`` then
    says that a write got there.
    """

    release_file: str
    started_file: str | None = None
    timeout_s: float = 120.0
    poll_s: float = 0.005
    at: str = "start"

    def __post_init__(self) -> None:
        if self.at not in ("start", "end"):
            raise ValueError(f'HoldWrite(at={self.at!r}): use "start" (before the first byte) or "end" (after the last)')

    def __call__(self, buckets: list) -> None:
        if self.at == "start":
            self._hold()

    def written(self, buckets: list) -> None:
        """(writer) Every byte of the save is written: held here with ``at="end"``."""
        if self.at == "end":
            self._hold()

    def _hold(self) -> None:
        if self.started_file:
            with open(self.started_file, "a"):
                pass
        self._wait_for(self.release_file, self.timeout_s, f"write held for {self.timeout_s:g}s")

    def release(self) -> None:
        """Lets the held writes (and every later one) go."""
        with open(self.release_file, "a"):
            pass

    def wait_started(self, timeout_s: float = 120.0) -> None:
        """Returns once a write has reached the hook (``started_file``); ``TimeoutError`` after ``timeout_s``."""
        if not self.started_file:
            raise ValueError("HoldWrite.wait_started needs a started_file")
        self._wait_for(self.started_file, timeout_s, f"no write started within {timeout_s:g}s")

    def _wait_for(self, path: str, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {path} never appeared")
            time.sleep(self.poll_s)


class HoldCopy:
    """Holds the background copy of every lazy snapshot (``AsyncCheckpointIO(snapshot="lazy")``) until
    :meth:`release`, so that a test can change the state while the copy has surely not run::

        hold = HoldCopy()
        io.copy_hook = hold
        io.save_checkpoint(state, path)  # returns; the copy waits
        hold.wait_started()
        ...                              # change the state: the save must fail, not tear
        hold.release()
        io.wait_for_snapshot()

    In-process (the copy is a thread of the trainer). A copy held longer than ``timeout_s`` fails its save,
    so a test that never releases does not hang.
    """

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._started = threading.Event()
        self._released = threading.Event()

    def __call__(self) -> None:
        self._started.set()
        if not self._released.wait(self.timeout_s):
            raise TimeoutError(f"lazy snapshot copy held for {self.timeout_s:g}s")

    def release(self) -> None:
        """Lets the held copies (and every later one) go."""
        self._released.set()

    def wait_started(self, timeout_s: float = 60.0) -> None:
        """Returns once a copy has reached the hook; ``TimeoutError`` after ``timeout_s``."""
        if not self._started.wait(timeout_s):
            raise TimeoutError(f"no lazy snapshot copy started within {timeout_s:g}s")
