"""The persistent worker: the engine's ``async_loop`` in one spawned process, fed through a queue, with
liveness checks (a mixin over the engine's ``PersistentAsyncCaller``), and the cleanup of the
multiprocessing helpers that starting it brings (queues' feeder threads, the resource tracker)."""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing import queues as mp_queues
from queue import Empty
from typing import TYPE_CHECKING

from torch import multiprocessing as mp

from lightning_asyncckpt.engines import startup
from lightning_asyncckpt.engines.protocol import Status
from lightning_asyncckpt.write import worker

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

log = logging.getLogger(__name__)


def resource_tracker_running() -> bool:
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None) is not None


def stop_resource_tracker() -> None:
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


def _by_name(fn: Callable[..., object]) -> Callable[..., object] | tuple[str, str]:
    """``fn`` as ``(module, qualified name)`` where that names it, for the worker to import inside its own
    startup (where an import error is reported, :func:`write.worker.resolve`), else ``fn`` itself."""
    ref = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", ""))
    try:
        found: object = sys.modules[ref[0]]
        for part in ref[1].split("."):
            found = getattr(found, part)
    except (KeyError, AttributeError, TypeError):
        return fn
    return ref if found is fn else fn


class RequestQueue(mp_queues.JoinableQueue):
    """The persistent worker's request queue. When the worker dies or hangs, its feeder thread can be
    blocked writing a request into the pipe; ``close`` then closes our end of the pipe, so that the
    write fails with EPIPE and the thread exits. That expected EPIPE is not printed.

    A request the feeder thread could not send (its pickling failed, e.g. ``OSError('AF_UNIX path too
    long')`` passing a shared-memory tensor's file descriptor under a long ``TMPDIR``) never reaches the
    worker: the first such error is kept in ``send_error`` for ``poll_done``, which reports the worker as
    failed, instead of the save waiting for it until ``timeout_s``."""

    send_error: BaseException | None = None  # set in the trainer process only (the feeder thread)

    def _on_queue_feeder_error(self, e: Exception, obj: object) -> None:
        if self.send_error is None:
            self.send_error = e
        if not isinstance(e, (BrokenPipeError, OSError)):
            mp_queues.Queue._on_queue_feeder_error(e, obj)


class PersistentMixin:
    """Persistent worker: the engine's ``async_loop`` in a spawned process, with liveness checks."""

    queue: RequestQueue
    preload_q: mp_queues.JoinableQueue
    comp_q: mp_queues.Queue
    process: BaseProcess | None
    nice: int = 0  # the worker's CPU priority (``AsyncCheckpointIO(worker_nice=...)``)
    scratch_dir: str | None = None  # removed by the worker if it outlives the trainer
    # a worker started by the first write imports what that write's job needs as it unpickles it
    _preload_modules: tuple[str, ...] = ()
    _queues_closed = False

    def configure(self, queue: RequestQueue, rank: int, nice: int, scratch_dir: str | None) -> None:
        """(trainer, once, right after construction) Replaces the engine's request queue with ours, which
        reports requests it could not send, and records the worker's settings."""
        self.queue = queue
        self.rank, self.nice, self.scratch_dir = rank, nice, scratch_dir

    def preload(self, modules: tuple[str, ...]) -> None:
        """(trainer, before ``start_worker``) The modules the worker imports before it reports ready."""
        self._preload_modules = tuple(modules)

    def queues_closed(self) -> bool:
        """(trainer, after ``close``) Whether every queue's feeder thread ended, so that the resource tracker
        their semaphores registered with may be stopped."""
        return self._queues_closed

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
            # nvrx >= 0.6 renices its worker to this (default 10): the same value as ours
            "cpu_priority": self.nice,
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
        # the worker sends why it could not start through this pipe, then exits (write.worker.engine_loop)
        self._start_pipe, failed = ctx.Pipe(duplex=False)
        self._start_cause = None
        with _no_main_reimport():
            self.process = ctx.Process(
                target=worker.engine_loop,
                args=(_by_name(loop), self._preload_modules, self._ready, self.nice, os.getpid(), self.scratch_dir,
                      failed),
                kwargs=kwargs,
                daemon=True,
                name="asyncckpt-worker",
            )
            try:
                self.process.start()
            finally:
                failed.close()  # the worker holds its own end: the pipe reads as closed once it is gone

    def wait_ready(self, timeout_s: float) -> None:
        """Blocks until the worker has imported what a write needs (bounded; raises if it died, with why)."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.05):
            if not self.process.is_alive():
                raise RuntimeError(f"the checkpoint worker process exited while starting (code {self.process.exitcode}):"
                                   f" {self.start_failure()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the checkpoint worker process did not start within {timeout_s:g}s")

    def start_failure(self) -> str | None:
        """(trainer) Why the worker died before it was ready: what it sent, else what its interpreter says
        when started again (:mod:`.startup`); ``None`` while it lives or once it was ready."""
        if self.process is None or self.process.is_alive() or self._ready is None or self._ready.is_set():
            return None
        if self._start_cause is None:
            with contextlib.suppress(EOFError, OSError):
                if self._start_pipe.poll(0):
                    self._start_cause = str(self._start_pipe.recv())
            if self._start_cause is None:
                self._start_cause = startup.diagnose()
        return self._start_cause

    def schedule_async_call(self, async_req: object) -> None:
        self.queue.put(async_req)

    def poll_done(self) -> Status:
        try:
            self.comp_q.get_nowait()
            return Status.FINISHED
        except Empty:
            pass
        if self.send_failure() is not None:
            return Status.DEAD
        if self.process is not None and self.process.is_alive():
            return Status.RUNNING
        try:  # the completion message may have been flushed just before the exit
            self.comp_q.get(timeout=0.1)
            return Status.FINISHED
        except Empty:
            return Status.DEAD

    def send_failure(self) -> str | None:
        """Why a request could not be sent to the worker (``RequestQueue.send_error``), or ``None``."""
        error = getattr(self.queue, "send_error", None)
        if error is None:
            return None
        detail = f"a save could not be sent to the checkpoint worker: {type(error).__name__}: {error}"
        if "AF_UNIX path too long" in str(error):
            # shared-memory tensors travel as file descriptors through a Unix socket under TMPDIR
            detail += (f"; the socket path under TMPDIR ({tempfile.gettempdir()}) must be shorter than 108 bytes:"
                       " set TMPDIR to a shorter directory")
        return detail

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
        pipe = getattr(self, "_start_pipe", None)
        if pipe is not None:
            pipe.close()
        self.queue = self.preload_q = self.comp_q = self._ready = self._start_pipe = None
        _stop_fd_sharer()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close(abort=True)


def _stop_fd_sharer() -> None:
    """Sending shared-memory tensors to the worker passes their file descriptors through multiprocessing's
    resource sharer, whose server thread then lives until the process exits. With the worker gone nobody
    asks for them any more: stop it, so that no thread of ours outlives ``fit`` (a later send starts it
    again)."""
    from multiprocessing import resource_sharer

    if getattr(resource_sharer._resource_sharer, "_thread", None) is not None:
        with contextlib.suppress(Exception):
            resource_sharer.stop(timeout=5.0)
