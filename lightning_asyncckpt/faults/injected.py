"""The injected fault kinds, and how a save finds its faults: the ``LIGHTNING_ASYNCCKPT_FAULTS``
syntax, ``inject_faults`` blocks, :class:`FaultList` policies.

The worker-side kinds (:class:`DelayWrite`, :class:`FailWrite`, :class:`CrashWrite`) are picklable
hooks that the real writer process runs before it writes; :class:`FailAt` fails the trainer or the
coordinator at a named point. The kinds and their targets are documented for users in
:mod:`lightning_asyncckpt.testing`, which re-exports them. No Lightning imports: the writer unpickles
these.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_asyncckpt.faults.policy import (
    ENV_VAR,
    NO_FAULTS,
    ChainedHooks,
    FaultPoint,
    SaveFaults,
    WriterHook,
)

WORKER_KINDS = ("enospc", "eio", "permission", "slow", "crash")
COORDINATOR_KINDS = ("metadata", "commit")
SAVE_TIME_KINDS = ("snapshot", "handover")
KINDS = WORKER_KINDS + COORDINATOR_KINDS + SAVE_TIME_KINDS
_ERRNO = {"enospc": _errno.ENOSPC, "eio": _errno.EIO, "permission": _errno.EACCES}


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
        message = f"{os.strerror(self.code)} (injected by lightning_asyncckpt.testing)"
        if self.code in (_errno.EACCES, _errno.EPERM):
            raise PermissionError(self.code, message)
        raise OSError(self.code, message)


@dataclass(frozen=True)
class CrashWrite:
    """Kills the writer process with a hard exit in the middle of a write: part of the first shard
    file is on disk, the rest never comes."""

    exit_code: int = 13

    def __call__(self, buckets: list) -> None:
        if buckets:
            with contextlib.suppress(OSError), open(buckets[0][0], "wb") as f:
                f.write(b"\0" * 4096)
                f.flush()
        os._exit(self.exit_code)




@dataclass(frozen=True)
class FailAt:
    """Raises ``OSError(code)`` (``MemoryError`` for code 0) in the trainer at one point of a save."""

    what: str
    code: int = _errno.EIO

    def __call__(self, path: Path | str) -> None:
        if self.code == 0:
            raise MemoryError(f"cannot allocate the staging buffers while {self.what} of {path} (injected by lightning_asyncckpt.testing)")
        raise OSError(self.code, f"{os.strerror(self.code)} while {self.what} of {path} (injected by lightning_asyncckpt.testing)")


def _values(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split("+") if v)


@dataclass(frozen=True)
class Fault:
    """One fault to inject; see the module docstring for kinds and targets."""

    kind: str
    ranks: Sequence[int] | None = None
    saves: Sequence[int] | None = None
    engine: str | None = None
    worker: str | None = None
    delay: float = 5.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        for name in ("ranks", "saves"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(int(v) for v in value))

    def matches(self, rank: int, save: int, engine: str, worker: str) -> bool:
        """Whether this fault applies to ``rank``'s ``save``-th save (from 1) on that engine and worker."""
        return (
            (self.ranks is None or rank in self.ranks)
            and (self.saves is None or save in self.saves)
            and (self.engine is None or self.engine == engine)
            and (self.worker is None or self.worker == worker)
        )

    def hook(self) -> WriterHook:
        """The picklable hook that makes the worker fail this way."""
        if self.kind == "slow":
            return DelayWrite(self.delay)
        if self.kind == "crash":
            return CrashWrite()
        return FailWrite(_ERRNO[self.kind])

    def spec(self) -> str:
        """This fault in the ``LIGHTNING_ASYNCCKPT_FAULTS`` syntax."""
        parts = []
        if self.ranks is not None:
            parts.append("rank=" + "+".join(map(str, self.ranks)))
        if self.saves is not None:
            parts.append("save=" + "+".join(map(str, self.saves)))
        for name in ("engine", "worker"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={getattr(self, name)}")
        if self.kind == "slow":
            parts.append(f"delay={self.delay:g}")
        return self.kind + (":" + ",".join(parts) if parts else "")

    @classmethod
    def parse(cls, spec: str) -> Fault:
        kind, _, rest = spec.strip().partition(":")
        kwargs: dict[str, tuple[int, ...] | str | float] = {}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"{ENV_VAR}: expected key=value, got {item!r} in {spec!r}")
            if key == "rank":
                kwargs["ranks"] = _values(value)
            elif key == "save":
                kwargs["saves"] = _values(value)
            elif key in ("engine", "worker"):
                kwargs[key] = value
            elif key == "delay":
                kwargs["delay"] = float(value)
            else:
                raise ValueError(f"{ENV_VAR}: unknown key {key!r} in {spec!r} (rank, save, engine, worker, delay)")
        return cls(kind.strip().lower(), **kwargs)


def parse_faults(text: str | None) -> list[Fault]:
    """Faults from the ``LIGHTNING_ASYNCCKPT_FAULTS`` syntax (``;``-separated)."""
    return [Fault.parse(s) for s in (text or "").split(";") if s.strip()]


def active_faults() -> list[Fault]:
    """The faults in force in this process: those of ``LIGHTNING_ASYNCCKPT_FAULTS``."""
    return parse_faults(os.environ.get(ENV_VAR))


@contextlib.contextmanager
def inject_faults(*faults: Fault) -> Iterator[list[Fault]]:
    """Injects ``faults`` into every ``AsyncCheckpointIO`` save inside the block, in this process and in
    processes it starts (the environment variable carries them)."""
    before = os.environ.get(ENV_VAR)
    specs = [f.spec() for f in faults] + ([before] if before else [])
    os.environ[ENV_VAR] = ";".join(specs)
    try:
        yield list(faults)
    finally:
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before


def faults_for(rank: int, save: int, engine: str, worker: str, faults: Sequence[Fault] | None = None) -> SaveFaults:
    """(trainer) The faults of one save (``faults``, else the active ones), as the pipeline's
    :class:`~lightning_asyncckpt.faults.policy.SaveFaults`."""
    hooks: list = []
    points: dict[str, FaultPoint] = {}
    for fault in active_faults() if faults is None else faults:
        if not fault.matches(rank, save, engine, worker):
            continue
        if fault.kind == "metadata":
            points.setdefault("before_metadata", FailAt("writing .metadata"))
        elif fault.kind == "commit":
            points.setdefault("before_publish", FailAt("publishing the checkpoint (rename)"))
        elif fault.kind == "snapshot":
            points.setdefault("at_snapshot", FailAt("taking the snapshot", 0))
        elif fault.kind == "handover":
            points.setdefault("at_handover", FailAt("handing the write to the worker", _errno.ENOSPC))
        else:
            hooks.append(fault.hook())
    return SaveFaults(worker_hook=ChainedHooks(tuple(hooks)) if hooks else None, **points)


@dataclass(frozen=True)
class FaultList:
    """A fault policy for one ``AsyncCheckpointIO`` (its ``faults`` attribute, or the ``faults`` argument),
    e.g. to break the saves of one rank from some point of a run on::

        io.faults = FaultList([Fault("snapshot")])  # every later save of this process fails to snapshot
    """

    faults: Sequence[Fault]

    def __post_init__(self) -> None:
        faults = self.faults
        if isinstance(faults, (str, bytes)) or not isinstance(faults, Sequence) or not all(
                isinstance(f, Fault) for f in faults):
            raise TypeError(f"FaultList(faults=...) takes a sequence of Fault(...); got {type(faults).__name__}"
                            f" {faults!r}. Fix: FaultList([Fault('enospc')]), or FaultList(parse_faults('enospc'))"
                            " for a spec string.")

    def for_save(self, rank: int, save: int, engine: str, worker: str) -> SaveFaults:
        return faults_for(rank, save, engine, worker, self.faults)


class EnvironmentFaults:
    """The default policy: the faults in ``LIGHTNING_ASYNCCKPT_FAULTS``, read at every save (so that
    ``testing.inject_faults`` blocks take effect at once); none when it is unset."""

    def for_save(self, rank: int, save: int, engine: str, worker: str) -> SaveFaults:
        if not os.environ.get(ENV_VAR):
            return NO_FAULTS
        return faults_for(rank, save, engine, worker)
