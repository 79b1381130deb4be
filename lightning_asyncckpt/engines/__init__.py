"""Engine selection: ``"nvrx"`` (default), ``"mcore"``, or ``"auto"``; :func:`create` returns the
:class:`~.base.Engine` adapter, which implements :class:`~.protocol.EngineProtocol`.

- ``protocol``: :class:`EngineProtocol`, what the save session's run calls on an engine, with its
  :class:`Ticket` and :class:`Status`.
- ``base``: :class:`Engine`, the adapter over the nvrx and mcore queues; ``nvrx`` and ``mcore``: each engine's.
- ``persistent_worker``: the persistent worker (one spawned process fed through a queue, with liveness checks);
  ``fork``: a writer forked per save; ``startup``: why a spawned worker died before it was ready.
"""

from __future__ import annotations

import enum
import importlib.util
import warnings

from lightning_asyncckpt.engines.base import Engine
from lightning_asyncckpt.engines.protocol import EngineProtocol, Status, Ticket
from lightning_asyncckpt.errors import EngineNotAvailableError

__all__ = ["Engine", "EngineName", "EngineProtocol", "Status", "Ticket", "WorkerMode", "create", "parse_worker", "resolve"]


class EngineName(str, enum.Enum):
    NVRX = "nvrx"
    MCORE = "mcore"
    AUTO = "auto"


class WorkerMode(str, enum.Enum):
    PERSISTENT = "persistent"
    FORK = "fork"


_MODULES = {
    EngineName.NVRX: ("nvidia_resiliency_ext", "pip install nvidia-resiliency-ext"),
    EngineName.MCORE: ("megatron.core", "pip install 'lightning-asyncckpt[mcore]'"),
}


def _importable(name: EngineName) -> bool:
    module = _MODULES[name][0]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _parse(value: str, enum_cls: type[enum.Enum], what: str) -> enum.Enum:
    try:
        return enum_cls(value)
    except ValueError:
        valid = ", ".join(repr(e.value) for e in enum_cls)
        raise ValueError(f"`AsyncCheckpointIO({what}={value!r})` is not valid; choose one of {valid}.") from None


def resolve(strategy: str) -> EngineName:
    """Maps ``"auto" | "nvrx" | "mcore"`` to an installed engine, or raises with the pip command."""
    name = _parse(strategy, EngineName, "strategy")
    if name is EngineName.AUTO:
        if _importable(EngineName.NVRX):
            return EngineName.NVRX
        if _importable(EngineName.MCORE):
            warnings.warn(
                "lightning-asyncckpt: nvidia-resiliency-ext is not installed; `strategy='auto'` falls back to"
                " Megatron-Core's async queue. Install it with `pip install nvidia-resiliency-ext`.",
                stacklevel=3,
            )
            return EngineName.MCORE
        raise EngineNotAvailableError(
            "lightning-asyncckpt: no async checkpoint engine is installed. Install one with"
            " `pip install nvidia-resiliency-ext` (recommended) or `pip install 'lightning-asyncckpt[mcore]'`."
        )
    if not _importable(name):
        raise EngineNotAvailableError(
            f"lightning-asyncckpt: `strategy={name.value!r}` needs a package that is not installed."
            f" Install it with `{_MODULES[name][1]}`."
        )
    return name


def parse_worker(worker: str) -> WorkerMode:
    return _parse(worker, WorkerMode, "worker")


def create(name: EngineName, worker: WorkerMode, rank: int, nice: int = 0, scratch_dir: str | None = None) -> Engine:
    """The engine, its writer processes to run at CPU priority ``nice``. ``scratch_dir``: the run's results
    directory, which a writer removes when it outlives its trainer (:mod:`lightning_asyncckpt.write.parent_watch`)."""
    engine: Engine
    if name is EngineName.NVRX:
        from lightning_asyncckpt.engines.nvrx import NvrxEngine

        engine = NvrxEngine(worker.value, rank, nice, scratch_dir)
    else:
        from lightning_asyncckpt.engines.mcore import McoreEngine

        engine = McoreEngine(worker.value, rank, nice, scratch_dir)
    return engine
