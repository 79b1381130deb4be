"""A run's writers: the engine (its persistent worker, or the processes it forks per save) and the
scratch directory in ``/dev/shm`` where they leave their results and gate files."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from lightning_asyncckpt import engines
from lightning_asyncckpt.pipeline import scratch


class Workers:
    """The engine of one run, made at its first save (its worker starts at the first write or ``warmup``),
    and the scratch directory beside it."""

    def __init__(self, engine_name: engines.EngineName, worker_mode: engines.WorkerMode, worker_nice: int = 0,
                 engine: engines.Engine | None = None) -> None:
        """Args:
            engine_name, worker_mode: the engine and how it runs its writers.
            worker_nice: the writer processes' CPU priority.
            engine: an engine made already (tests give a fake one); else made at :meth:`start`.
        """
        self._name, self._mode, self._nice = engine_name, worker_mode, worker_nice
        self._engine = engine
        self._results_dir: Path | None = None

    @property
    def engine(self) -> engines.Engine | None:
        return self._engine

    @property
    def results_dir(self) -> Path | None:
        return self._results_dir

    @property
    def persistent(self) -> bool:
        """One worker per writing rank, kept for the run (else one forked per save)."""
        return self._mode is engines.WorkerMode.PERSISTENT

    def start(self, rank: int) -> engines.Engine:
        """(writing ranks) The scratch directory (first removing those of dead trainers) and the engine."""
        if self._results_dir is None:
            base = "/dev/shm" if Path("/dev/shm").is_dir() else None
            self._results_dir = scratch.make_scratch_dir(base)
        if self._engine is None:
            self._engine = engines.create(self._name, self._mode, rank, self._nice, str(self._results_dir))
        return self._engine

    def pids(self, tickets: Iterable[engines.Ticket | None]) -> list[int]:
        """PIDs of the live writers: the persistent worker, or the forked ones of ``tickets``."""
        if self._engine is None:
            return []
        forked = [t.process for t in tickets if t is not None and t.process is not None]
        return self._engine.worker_pids() + [p.pid for p in forked if p.is_alive()]

    def kill(self, ticket: engines.Ticket | None) -> None:
        """Stops the write of ``ticket`` (a forked writer; the persistent worker skips it)."""
        if self._engine is not None and ticket is not None:
            self._engine.kill(ticket)

    def stop(self, abort: bool) -> None:
        """(this rank, as the run closes) Stops the worker (``abort``: without waiting for its writes)."""
        if self._engine is not None:
            self._engine.close(abort=abort)

    def remove_scratch(self) -> None:
        """(this rank, last as the run closes) Our own scratch files in ``/dev/shm`` go."""
        if self._results_dir is not None:
            shutil.rmtree(self._results_dir, ignore_errors=True)
            self._results_dir = None
