"""Fault injection that reaches the real background writer.

The hooks here are picklable callables run by the worker process (spawned or forked) just before it
writes a save's shard files, so that they work where a monkeypatch in the trainer cannot. Set one with
``AsyncCheckpointIO(...).write_hook = hook``.
"""

from __future__ import annotations

import errno as _errno
import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class DelayWrite:
    """Makes every background write take at least ``seconds`` longer (a slow filesystem)."""

    seconds: float

    def __call__(self, buckets: list) -> None:
        time.sleep(self.seconds)


@dataclass(frozen=True)
class FailWrite:
    """Raises ``OSError(errno)`` in the writer, as a full or broken disk would."""

    code: int = _errno.ENOSPC

    def __call__(self, buckets: list) -> None:
        raise OSError(self.code, os.strerror(self.code))


@dataclass(frozen=True)
class CrashWrite:
    """Kills the writer process with a hard exit in the middle of a write."""

    exit_code: int = 13

    def __call__(self, buckets: list) -> None:
        os._exit(self.exit_code)
