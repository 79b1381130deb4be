"""The interface the save session uses on an engine (:class:`EngineProtocol`), and the values it passes
around: a :class:`Ticket` per scheduled write and the :class:`Status` a poll returns.

``AsyncCheckpointIO`` does not call the engine: its :class:`~lightning_asyncckpt.pipeline.pipeline.SaveSession`
does, through its run (``pipeline/workers.py`` makes the engine and stops it, ``SaveSession.warmup`` starts its
worker, ``write_jobs`` schedules a write, ``poller`` and ``committer`` poll and reset)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess


class Status(enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"  # the worker ran the job; its result file says whether the write succeeded
    DEAD = "dead"  # the worker process died before reporting


@dataclass
class Ticket:
    """One scheduled job on an engine."""

    call_idx: int
    scheduled_at: float
    process: BaseProcess | None = None  # fork-per-save: this job's own process
    detail: str = ""

    def died(self, detail: str) -> None:
        """Records why the job's worker died (the message a failed save reports)."""
        self.detail = detail


@runtime_checkable
class EngineProtocol(Protocol):
    """What the save session's run (:mod:`lightning_asyncckpt.pipeline.workers`, ``write_jobs``, ``poller``,
    ``committer``) calls on the engine that ``engines.create`` returns. Calls are local to this process: no
    collectives."""

    persistent: bool  # one long-lived worker process (else a process forked per save)
    writer_cls: type  # the engine's DCP ``FileSystemWriterAsync``, which plans and writes shard files
    split_by_size: Callable[[int, list], list]  # splits a plan's items into that many similar-sized files
    version: str | None  # the engine package's version, recorded in each checkpoint

    def start(self, timeout_s: float = ..., directories: bool = ...) -> None:
        """Starts the persistent worker and waits until it is ready (having imported DCP's writer too where
        ``directories``: DCP directory saves are expected); no-op for fork-per-save."""

    def schedule(self, fn: Callable[..., object], args: tuple) -> Ticket:
        """Hands ``fn(*args)`` to the background worker; returns at once."""

    def poll(self, ticket: Ticket) -> Status:
        """Non-blocking; tickets are polled in the order they were scheduled."""

    def kill(self, ticket: Ticket) -> None:
        """Stops a fork-per-save job's process."""

    def worker_pids(self) -> list[int]:
        """The worker processes alive now."""

    def close(self, abort: bool = False) -> None:
        """Stops the worker; ``abort`` kills it without waiting for a write in progress."""

    def reset_after_failure(self) -> None:
        """Kills a dead or hung worker; the next save starts a fresh one."""
