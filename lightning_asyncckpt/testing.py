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
them through one policy object (:class:`lightning_asyncckpt.faults.EnvironmentFaults` by default),
never through their names.

Targets: ``ranks`` (global ranks, default all), ``saves`` (the n-th save of the ``AsyncCheckpointIO``
on that rank, counting from 1; default every save), ``engine`` (``nvrx``/``mcore``) and ``worker``
(``persistent``/``fork``); default any. In the environment: ``kind[:key=value,...]`` with keys ``rank``,
``save`` (several values separated by ``+``, e.g. ``rank=0+1``), ``engine``, ``worker``, ``delay``;
several faults separated by ``;``.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_asyncckpt.faults import ENV_VAR, ChainedHooks, SaveFaults

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


Hooks = ChainedHooks  # several write hooks, run in order


@dataclass(frozen=True)
class FailAt:
    """Raises ``OSError(code)`` (``MemoryError`` for code 0) in the trainer at one point of a save."""

    what: str
    code: int = _errno.EIO

    def __call__(self, path: Any) -> None:
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

    def hook(self) -> Any:
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
        kwargs: dict[str, Any] = {}
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
    :class:`~lightning_asyncckpt.faults.SaveFaults`."""
    hooks: list = []
    points: dict[str, Any] = {}
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

    def for_save(self, rank: int, save: int, engine: str, worker: str) -> SaveFaults:
        return faults_for(rank, save, engine, worker, self.faults)


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
