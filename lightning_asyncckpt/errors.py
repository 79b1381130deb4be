"""Errors raised by lightning-asyncckpt.

A failed background write becomes a :class:`RankFailure` value on the rank that saw it. Only
``agreement`` turns those values into one :class:`CheckpointWriteError`, raised on every rank.
"""

from __future__ import annotations

import errno as _errno
from dataclasses import dataclass


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank for one save. Plain data, so it survives pickling and gathers."""

    rank: int
    error_type: str
    message: str
    errno: int | None = None

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> RankFailure:
        """Takes the type and errno out *before* the exception crosses a process boundary."""
        code = getattr(exc, "errno", None)
        cause = exc
        # The engine's writers wrap OS errors in RuntimeError: find the original cause.
        while code is None and cause.__cause__ is not None:
            cause = cause.__cause__
            code = getattr(cause, "errno", None)
        if code is not None:
            exc = cause
        return cls(rank=rank, error_type=type(exc).__name__, message=str(exc), errno=code)

    def describe(self) -> str:
        """One line for messages: ``rank 1: OSError [ENOSPC]: No space left on device``."""
        code = ""
        if self.errno is not None:
            code = f" [{_errno.errorcode.get(self.errno, self.errno)}]"
        return f"rank {self.rank}: {self.error_type}{code}: {self.message}"


class CheckpointWriteError(Exception):
    """A background checkpoint write failed.

    Raised by ``AsyncCheckpointIO.finalize`` (and so by ``AsyncFinalizerCallback``) on every rank, once
    per failed save. Nothing was committed at :attr:`path`; the previous checkpoint is untouched.

    Attributes:
        path: the checkpoint path that was being written.
        failures: one :class:`RankFailure` per failing rank.
        ranks: the failing ranks.
        error_type / errno: of the first failure (``errno`` is ``None`` when the cause had none).
    """

    def __init__(self, path: str, failures: list[RankFailure] | tuple[RankFailure, ...], note: str = ""):
        self.path = str(path)
        self.failures = tuple(sorted(failures, key=lambda f: f.rank))
        self.note = note
        lines = "\n  ".join(f.describe() for f in self.failures)
        hint = f"\n{note}" if note else ""
        super().__init__(
            f"Asynchronous checkpoint save to {self.path!r} failed on rank(s) {list(self.ranks)}:\n  {lines}"
            f"\nNothing was committed at that path; earlier checkpoints are untouched.{hint}"
        )

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global ranks whose part of the save failed (the same on every rank that raises)."""
        return tuple(f.rank for f in self.failures)

    @property
    def error_type(self) -> str | None:
        """The first failing rank's original error type, e.g. ``"OSError"`` or ``"WorkerDied"``."""
        return self.failures[0].error_type if self.failures else None

    @property
    def errno(self) -> int | None:
        """The first failing rank's ``errno`` (e.g. ``errno.ENOSPC``), when the error had one."""
        return self.failures[0].errno if self.failures else None

    def __reduce__(self):
        return (type(self), (self.path, self.failures, self.note))


class EngineNotAvailableError(ImportError):
    """The requested engine package is not installed."""


class UnsupportedVersionError(ImportError):
    """An installed package (torch, Lightning, an engine) is outside the versions this library supports
    (:mod:`lightning_asyncckpt.integration.versions`); raised when ``AsyncCheckpointIO`` is made, before any save."""
