"""The engine protocol, and the adapter shared by the nvrx and mcore queues.

Both engines ship the same async machinery: an ``AsyncRequest`` value, a persistent worker
(``PersistentAsyncCaller.async_loop``, spawned once, fed through a ``JoinableQueue`` and reporting on
``comp_q``), a fork-per-save caller (``TemporalAsyncCaller``), and a DCP ``FileSystemWriterAsync``
whose ``write_preloaded_data`` writes one shard file with fsync. We use all of these as they are.

What we replace, because it hangs or assumes CUDA (see ENGINES.md):
- the callers' scheduling and completion checks, which call ``torch.cuda`` and
  ``torch.distributed.get_rank()`` and never check that the worker is alive;
- the engines' finalize collectives (``agreement`` does that, on the right device, on every rank).
"""

from __future__ import annotations

import contextlib
import enum
import gc
import inspect
import logging
import os
import select
import sys
import time
from dataclasses import dataclass
from multiprocessing import queues as mp_queues
from queue import Empty
from types import ModuleType
from typing import Any

from torch import multiprocessing as mp

from lightning_asyncckpt import _worker

log = logging.getLogger(__name__)


class Status(enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"  # the worker ran the job; its result file says whether the write succeeded
    DEAD = "dead"  # the worker process died before reporting


@dataclass
class Ticket:
    """One scheduled job on an engine."""

    call_idx: int
    scheduled_at: float
    process: Any = None  # fork-per-save: this job's own process
    detail: str = ""


def _resource_tracker_running() -> bool:
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None) is not None


def _stop_resource_tracker() -> None:
    """Spawning starts multiprocessing's resource-tracker helper; stop it again if we started it, so
    that no process outlives ``teardown``. It restarts on demand."""
    from multiprocessing import resource_tracker

    gc.collect()  # finalizers of our queues' semaphores unregister them first
    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        with contextlib.suppress(Exception):
            stop()


@contextlib.contextmanager
def _no_main_reimport():
    """Spawned children re-run the user's ``__main__`` unless it is guarded by
    ``if __name__ == "__main__"``; many training scripts are not. Our worker needs nothing from
    ``__main__``, so hide it from ``multiprocessing``'s spawn preparation while the worker starts."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


class _RequestQueue(mp_queues.JoinableQueue):
    """The persistent worker's request queue. When the worker dies or hangs, its feeder thread can be
    blocked writing a request into the pipe; ``close`` then closes our end of the pipe, so that the
    write fails with EPIPE and the thread exits. That expected EPIPE is not printed."""

    @staticmethod
    def _on_queue_feeder_error(e: Exception, obj: Any) -> None:
        if not isinstance(e, (BrokenPipeError, OSError)):
            mp_queues.Queue._on_queue_feeder_error(e, obj)


class _PersistentMixin:
    """Persistent worker: the engine's ``async_loop`` in a spawned process, with liveness checks."""

    queue: Any
    preload_q: Any
    comp_q: Any
    process: Any

    def start_worker(self, rank: int) -> None:
        if self.process is not None:
            return
        loop = type(self).async_loop
        known = {
            "rank": rank,
            "queue": self.queue,
            "preload_q": self.preload_q,
            "comp_q": self.comp_q,
            "log_level": logging.DEBUG if log.isEnabledFor(logging.DEBUG) else logging.WARNING,
            # nvrx >= 0.6: the requests hold host (shared-memory) tensors only, so the worker needs no
            # CUDA device (without it, the loop pins one and creates a context)
            "cpu_shm_mode": True,
        }
        # by keyword: versions add parameters with defaults between the ones we pass (nvrx 0.6:
        # cpu_priority and io_priority before cpu_shm_mode)
        kwargs = {}
        for name, p in inspect.signature(loop).parameters.items():
            if name in known:
                kwargs[name] = known[name]
            elif p.default is inspect.Parameter.empty:
                raise RuntimeError(f"unsupported engine version: async_loop needs {name!r}")
        ctx = mp.get_context("spawn")
        self._ready = ctx.Event()
        with _no_main_reimport():
            self.process = ctx.Process(
                target=_worker.engine_loop,
                args=(loop, self._preload_modules, self._ready),
                kwargs=kwargs,
                daemon=True,
                name="asyncckpt-worker",
            )
            self.process.start()

    def wait_ready(self, timeout_s: float) -> None:
        """Blocks until the worker has imported what a write needs (bounded; raises if it died)."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.05):
            if not self.process.is_alive():
                raise RuntimeError(f"the checkpoint worker process exited while starting (code {self.process.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the checkpoint worker process did not start within {timeout_s:g}s")

    def schedule_async_call(self, async_req: Any) -> None:
        self.queue.put(async_req)

    def poll_done(self) -> Status:
        try:
            self.comp_q.get_nowait()
            return Status.FINISHED
        except Empty:
            pass
        if self.process is not None and self.process.is_alive():
            return Status.RUNNING
        try:  # the completion message may have been flushed just before the exit
            self.comp_q.get(timeout=0.1)
            return Status.FINISHED
        except Empty:
            return Status.DEAD

    def close(self, abort: bool = False, timeout_s: float = 30.0) -> None:  # type: ignore[override]
        proc, self.process = self.process, None
        if proc is not None:
            if not abort and proc.is_alive():
                self.queue.put("DONE")
                proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
            if not proc.is_alive():
                proc.close()
        del proc
        # Join the queues' feeder threads (bounded: one blocked on a dead reader never returns), so
        # that their semaphores are released before the resource tracker is stopped.
        self._queues_closed = True
        for q in (self.queue, self.preload_q, self.comp_q):
            with contextlib.suppress(Exception):
                q.cancel_join_thread()
                if abort:  # nobody reads any more: a write blocked on the full pipe fails instead of hanging
                    q._reader.close()
                q.close()
                feeder = getattr(q, "_thread", None)
                if feeder is not None:
                    feeder.join(5.0)
                    self._queues_closed &= not feeder.is_alive()
        self.queue = self.preload_q = self.comp_q = self._ready = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close(abort=True)


# A forked writer signals that it runs within this many seconds (normally a few milliseconds), else it
# is killed and the trainer forks again, this many times in all.
FORK_START_S = 5.0
FORK_ATTEMPTS = 3


class _TemporalMixin:
    """Fork per save: a copy-on-write snapshot of the trainer for the cost of a ``fork``."""

    def schedule_fork(self, async_req: Any) -> Any:
        """Forks the writer and returns once it runs (inside the save, so the snapshot is still this step's).

        A child forked from a process with other threads (gloo's, torch's) can hang inside ``fork``
        itself, before any Python runs, on a lock one of them held: it is killed after
        ``FORK_START_S`` and the trainer forks again, up to ``FORK_ATTEMPTS`` times.
        """
        ctx = mp.get_context("fork")
        for attempt in range(1, FORK_ATTEMPTS + 1):
            started_r, started_w = os.pipe()
            proc = ctx.Process(
                target=_worker.run_forked,
                args=(started_w, async_req.async_fn, tuple(async_req.async_fn_args),
                      dict(async_req.async_fn_kwargs or {})),  # None in nvrx 0.7
                daemon=True,
                name="asyncckpt-fork",
            )
            # The trainer's objects go into the collector's permanent generation for the fork, as the gc
            # module's documentation advises: the child never collects them, so it never runs the
            # finalizers of the trainer's garbage (which may wait on threads that do not exist in the
            # child, or on locks they held), and it does not touch, and so copy, the pages that hold them.
            gc.freeze()
            try:
                proc.start()
            finally:
                gc.unfreeze()
                os.close(started_w)
            try:
                started = bool(select.select([started_r], [], [], FORK_START_S)[0])
            finally:
                os.close(started_r)
            if started:
                return proc
            proc.kill()
            proc.join(5.0)
            log.warning("lightning-asyncckpt: the forked checkpoint writer did not start within %gs (attempt %d"
                        " of %d; a fork of a multi-threaded process can hang); forking again",
                        FORK_START_S, attempt, FORK_ATTEMPTS)
        raise RuntimeError(
            f"the forked checkpoint writer did not start in {FORK_ATTEMPTS} attempts of {FORK_START_S:g}s each;"
            " AsyncCheckpointIO(worker='persistent') does not fork the training process"
        )

    def __del__(self) -> None:
        pass


class Engine:
    """One engine's async queue, behind the five calls ``io.py`` needs.

    Subclasses name the engine's modules; everything else is shared because both engines expose the
    same classes. Calls are local to this process: no collectives here.
    """

    name: str = ""
    pip_extra: str = ""

    def __init__(self, core: ModuleType, filesystem: ModuleType, worker: str, rank: int = 0):
        self.core = core
        self.writer_cls = filesystem.FileSystemWriterAsync
        self.split_by_size = filesystem._split_by_size_and_type
        self.persistent = worker == "persistent"
        self.rank = rank
        self._caller: Any = None
        self._next_idx = 0

    # -- the protocol ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 120.0) -> None:
        """Starts the persistent worker now and waits until it is ready (outside a training step).
        No-op for fork-per-save."""
        if self.persistent:
            caller = self._persistent_caller()
            caller.start_worker(self.rank)
            caller.wait_ready(timeout_s)

    def schedule(self, fn: Any, args: tuple) -> Ticket:
        """Hands ``fn(*args)`` to the background worker; returns at once."""
        req = self.core.AsyncRequest(fn, tuple(args), [])
        ticket = Ticket(call_idx=self._next_idx, scheduled_at=time.monotonic())
        self._next_idx += 1
        if self.persistent:
            caller = self._persistent_caller()
            caller.start_worker(self.rank)
            caller.schedule_async_call(req._replace(call_idx=ticket.call_idx))
        else:
            ticket.process = self._temporal_caller().schedule_fork(req)
        return ticket

    def poll(self, ticket: Ticket) -> Status:
        """Local and non-blocking. Tickets must be polled in the order they were scheduled."""
        if self.persistent:
            caller = self._caller
            status = caller.poll_done() if caller is not None else Status.DEAD
            if status is Status.DEAD:
                ticket.detail = self._death_detail(getattr(caller, "process", None))
            return status
        proc = ticket.process
        if proc.is_alive():
            return Status.RUNNING
        proc.join()
        if proc.exitcode == 0:
            return Status.FINISHED
        ticket.detail = self._death_detail(proc)
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
            started_tracker = getattr(caller, "_started_tracker", False) and caller._queues_closed
            del caller
            if started_tracker:
                _stop_resource_tracker()

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
    def _death_detail(proc: Any) -> str:
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

    def _persistent_caller(self) -> Any:
        if self._caller is None:
            cls = type(f"{self.name.title()}PersistentCaller", (_PersistentMixin, self.core.PersistentAsyncCaller), {})
            started_tracker = not _resource_tracker_running()
            self._caller = cls()  # its spawn-context queues start the resource tracker
            self._caller.queue = _RequestQueue(ctx=mp.get_context("spawn"))
            self._caller._preload_modules = (
                "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner",
                self.writer_cls.__module__,
            )
            self._caller.rank = self.rank
            self._caller._started_tracker = started_tracker
        return self._caller

    def _temporal_caller(self) -> Any:
        if self._caller is None:
            cls = type(f"{self.name.title()}TemporalCaller", (_TemporalMixin, self.core.TemporalAsyncCaller), {})
            self._caller = cls()
        return self._caller


def engine_version(dist_name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist_name)
    except Exception:  # noqa: BLE001
        return None
