"""Fork per save: the writer is a child forked from the trainer, a copy-on-write snapshot of its state for
the cost of a ``fork`` (a mixin over the engine's ``TemporalAsyncCaller``); a child that hangs inside
``fork`` is killed and forked again."""

from __future__ import annotations

import gc
import logging
import os
import select
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from torch import multiprocessing as mp

from lightning_asyncckpt.write import worker

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

log = logging.getLogger(__name__)


class ForkRequest(Protocol):
    """The engine's ``AsyncRequest``, as the fork reads it."""

    @property
    def async_fn(self) -> Callable[..., object]: ...

    @property
    def async_fn_args(self) -> tuple: ...

    @property
    def async_fn_kwargs(self) -> dict[str, object] | None: ...


class TemporalMixin:
    """Fork per save: a copy-on-write snapshot of the trainer for the cost of a ``fork``."""

    nice: int = 0  # the writer's CPU priority (``AsyncCheckpointIO(worker_nice=...)``)
    scratch_dir: str | None = None  # removed by the writer if it outlives the trainer

    def configure(self, nice: int, scratch_dir: str | None) -> None:
        """(trainer, once, right after construction) The writer's CPU priority and the run's scratch directory."""
        self.nice, self.scratch_dir = nice, scratch_dir

    def schedule_fork(self, async_req: ForkRequest, start_s: float, attempts: int) -> BaseProcess:
        """Forks the writer and returns once it runs (inside the save, so the snapshot is still this step's).

        A child forked from a process with other threads (gloo's, torch's) can hang inside ``fork``
        itself, before any Python runs, on a lock one of them held: it is killed after
        ``start_s`` and the trainer forks again, up to ``attempts`` times.
        """
        ctx = mp.get_context("fork")
        for attempt in range(1, attempts + 1):
            started_r, started_w = os.pipe()
            proc = ctx.Process(
                target=worker.run_forked,
                args=(started_w, async_req.async_fn, tuple(async_req.async_fn_args),
                      dict(async_req.async_fn_kwargs or {}), self.nice, os.getpid(), self.scratch_dir),  # kwargs: None in nvrx 0.7
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
                started = bool(select.select([started_r], [], [], start_s)[0])
            finally:
                os.close(started_r)
            if started:
                return proc
            proc.kill()
            proc.join(5.0)
            log.warning("lightning-asyncckpt: the forked checkpoint writer did not start within %gs (attempt %d"
                        " of %d; a fork of a multi-threaded process can hang); forking again",
                        start_s, attempt, attempts)
        raise RuntimeError(
            f"the forked checkpoint writer did not start in {attempts} attempts of {start_s:g}s each;"
            " AsyncCheckpointIO(worker='persistent') does not fork the training process"
        )

    def __del__(self) -> None:
        pass
