"""The adapter over the nvrx and mcore queues: one :class:`Engine` class serves both.

Both engines ship the same async machinery: an ``AsyncRequest`` value, a persistent worker
(``PersistentAsyncCaller.async_loop``, spawned once, fed through a ``JoinableQueue`` and reporting on
``comp_q``), a fork-per-save caller (``TemporalAsyncCaller``), and a DCP ``FileSystemWriterAsync``
whose ``write_preloaded_data`` writes one shard file with fsync. We use all of these as they are.

What we replace, because it hangs or assumes CUDA (see ENGINES.md):
- the callers' scheduling and completion checks, which call ``torch.cuda`` and ask the process group for
  the rank, and never check that the worker is alive;
- the engines' finalize collectives (the pipeline's agreement, :mod:`lightning_asyncckpt.collectives`, does
  that, on the right device, on every rank).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from torch import multiprocessing as mp

from lightning_asyncckpt.engines.fork import TemporalMixin
from lightning_asyncckpt.engines.persistent_worker import (
    PersistentMixin,
    RequestQueue,
    resource_tracker_running,
    stop_resource_tracker,
)
from lightning_asyncckpt.engines.protocol import Status, Ticket

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

__all__ = ["FORK_ATTEMPTS", "FORK_START_S", "Engine", "Status", "Ticket", "engine_version"]

# A forked writer signals that it runs within this many seconds (normally a few milliseconds), else it
# is killed and the trainer forks again, this many times in all.
FORK_START_S = 5.0
FORK_ATTEMPTS = 3


class Engine:
    """One engine's async queue, behind the calls ``io.py`` needs (:class:`~.protocol.EngineProtocol`):
    the persistent worker (:mod:`.persistent`) or a process forked per save (:mod:`.fork`).

    Subclasses name the engine's modules; everything else is shared because both engines expose the
    same classes. Calls are local to this process: no collectives here.
    """

    name: str = ""
    pip_extra: str = ""
    version: str | None = None  # set by the subclass

    def __init__(self, core: ModuleType, filesystem: ModuleType, worker: str, rank: int = 0, nice: int = 0,
                 scratch_dir: str | None = None):
        self.core = core
        self.writer_cls = filesystem.FileSystemWriterAsync
        self.split_by_size = filesystem._split_by_size_and_type
        self.persistent = worker == "persistent"
        self.rank, self.nice = rank, nice  # nice: the writer processes' CPU priority
        # the run's scratch directory (results, gates): removed by a writer whose trainer is gone (parent_watch)
        self.scratch_dir = scratch_dir
        self._caller: PersistentMixin | TemporalMixin | None = None  # made at the first use (persistent: a start)
        self._owns_tracker = False  # the caller's queues started multiprocessing's resource tracker
        self._next_idx = 0

    # -- the protocol ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 120.0, directories: bool = True) -> None:
        """Starts the persistent worker now and waits until it is ready (outside a training step).
        ``directories``: DCP directory saves are expected, so the worker imports DCP's writer now too (about
        0.6 CPU-seconds), not at the first of them; a worker that writes only ``torch.save`` files never
        needs it. No-op for fork-per-save, and for a worker already started."""
        if self.persistent:
            caller = self._persistent_caller()
            if caller.process is None and directories:
                caller.preload(self._dcp_modules())
            caller.start_worker(self.rank)
            caller.wait_ready(timeout_s)

    def _dcp_modules(self) -> tuple[str, ...]:
        return ("torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint.planner",
                self.writer_cls.__module__)

    def schedule(self, fn: Callable[..., object], args: tuple) -> Ticket:
        """Hands ``fn(*args)`` to the background worker; returns at once.

        Args:
            fn: a module-level function (picklable), run by the worker.
            args: its arguments (picklable; host tensors travel through shared memory).

        Returns:
            The ticket to :meth:`poll` (in the order scheduled)."""
        req = self.core.AsyncRequest(fn, tuple(args), [])
        call_idx, scheduled_at = self._next_idx, time.monotonic()
        self._next_idx += 1
        if self.persistent:
            caller = self._persistent_caller()
            caller.start_worker(self.rank)
            caller.schedule_async_call(req._replace(call_idx=call_idx))
            return Ticket(call_idx=call_idx, scheduled_at=scheduled_at)
        process = self._temporal_caller().schedule_fork(req, FORK_START_S, FORK_ATTEMPTS)
        return Ticket(call_idx=call_idx, scheduled_at=scheduled_at, process=process)

    def poll(self, ticket: Ticket) -> Status:
        """Local and non-blocking. Tickets must be polled in the order they were scheduled."""
        if self.persistent:
            caller = self._caller
            status = caller.poll_done() if caller is not None else Status.DEAD
            if status is Status.DEAD:
                unsent = caller.send_failure() if caller is not None else None
                died = self._death_detail(getattr(caller, "process", None))
                started = caller.start_failure() if caller is not None else None  # a first write started it
                ticket.died(unsent or (f"{died} while starting: {started}" if started else died))
            return status
        proc = ticket.process
        if proc.is_alive():
            return Status.RUNNING
        proc.join()
        if proc.exitcode == 0:
            return Status.FINISHED
        ticket.died(self._death_detail(proc))
        return Status.DEAD

    def worker_pids(self) -> list[int]:
        caller = self._caller
        proc = getattr(caller, "process", None) if caller is not None else None
        return [proc.pid] if proc is not None and proc.pid is not None else []

    def close(self, abort: bool = False) -> None:
        """Stops the worker. ``abort`` kills it without waiting for a write in progress."""
        caller, self._caller = self._caller, None
        if caller is not None and self.persistent:
            caller.close(abort=abort)
            started_tracker = self._owns_tracker and caller.queues_closed()
            del caller
            if started_tracker:
                stop_resource_tracker()

    def kill(self, ticket: Ticket) -> None:
        """Stops a fork-per-save job's process (the persistent worker is stopped by ``close``)."""
        proc = ticket.process
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)

    def reset_after_failure(self) -> None:
        """A dead or hung worker is killed; the next save starts a fresh one."""
        self.close(abort=True)

    # -- helpers --------------------------------------------------------------------------------
    @staticmethod
    def _death_detail(proc: BaseProcess | None) -> str:
        code = getattr(proc, "exitcode", None)
        if code is None:
            return "the checkpoint worker process is gone"
        if code < 0:
            import signal

            try:
                sig = signal.Signals(-code).name
            except ValueError:
                sig = str(-code)
            return f"the checkpoint worker process (pid {proc.pid}) was killed by {sig}"
        return f"the checkpoint worker process (pid {proc.pid}) exited with code {code}"

    def _persistent_caller(self) -> PersistentMixin:
        if self._caller is None:
            cls = type(f"{self.name.title()}PersistentCaller", (PersistentMixin, self.core.PersistentAsyncCaller), {})
            self._owns_tracker = not resource_tracker_running()
            caller = cls()  # its spawn-context queues start the resource tracker
            caller.configure(RequestQueue(ctx=mp.get_context("spawn")), self.rank, self.nice, self.scratch_dir)
            self._caller = caller
        return self._caller

    def _temporal_caller(self) -> TemporalMixin:
        if self._caller is None:
            cls = type(f"{self.name.title()}TemporalCaller", (TemporalMixin, self.core.TemporalAsyncCaller), {})
            caller = cls()
            caller.configure(self.nice, self.scratch_dir)
            self._caller = caller
        return self._caller


def engine_version(dist_name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist_name)
    except Exception:  # noqa: BLE001
        return None
