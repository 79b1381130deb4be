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
# What the mcore engine runs on: Megatron-Core's async queue. Megatron-LM removed it upstream (PR #7052,
# 2026-09); the engine looks for the modules themselves, not for a version, since a release may drop them.
MCORE_QUEUE = ("megatron.core.dist_checkpointing.strategies.async_utils",
               "megatron.core.dist_checkpointing.strategies.filesystem_async")
MCORE_NEWEST_WITH_QUEUE = "0.19.2"  # the newest megatron-core release known to ship MCORE_QUEUE


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or one that fails to import
        return False


def _importable(name: EngineName) -> bool:
    """Whether the engine ``name`` can run here: its package, and for mcore its async queue."""
    if name is EngineName.MCORE:
        return _found(_MODULES[name][0]) and all(_found(m) for m in MCORE_QUEUE)
    return _found(_MODULES[name][0])


def _mcore_without_queue() -> str | None:
    """Why an installed megatron-core cannot serve as the mcore engine (``None``: it is missing or can)."""
    if not _found(_MODULES[EngineName.MCORE][0]) or all(_found(m) for m in MCORE_QUEUE):
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("megatron-core")
    except PackageNotFoundError:
        installed = "(version unknown)"
    return (f"megatron-core {installed} does not ship Megatron-Core's async checkpoint queue"
            f" ({MCORE_QUEUE[0].rpartition('.')[0]}.async_utils, removed upstream by Megatron-LM PR #7052); the newest"
            f" megatron-core known to carry it is {MCORE_NEWEST_WITH_QUEUE}")


def _parse(value: str, enum_cls: type[enum.Enum], what: str) -> enum.Enum:
    try:
        return enum_cls(value)
    except ValueError:
        valid = ", ".join(repr(e.value) for e in enum_cls)
        raise ValueError(f"`AsyncCheckpointIO({what}={value!r})` is not valid; choose one of {valid}.") from None


def resolve(strategy: str) -> EngineName:
    """Maps ``"auto" | "nvrx" | "mcore"`` to an installed engine, or raises with the pip command.

    (any rank, at ``AsyncCheckpointIO``'s construction.) ``"auto"`` takes nvrx where it is installed, else
    mcore where megatron-core still ships its async queue. ``"mcore"`` with a megatron-core that no longer
    ships it raises, naming the installed version, the newest one known to carry the queue, and the fix.

    Args:
        strategy: ``"auto"``, ``"nvrx"`` or ``"mcore"``.

    Returns:
        The engine to create."""
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
        why = _mcore_without_queue()
        raise EngineNotAvailableError(
            "lightning-asyncckpt: no async checkpoint engine is installed"
            + (f" ({why})" if why else "") + ". Install one with"
            " `pip install nvidia-resiliency-ext` (recommended) or `pip install 'lightning-asyncckpt[mcore]'`."
        )
    if name is EngineName.MCORE:
        why = _mcore_without_queue()
        if why:
            raise EngineNotAvailableError(
                f"lightning-asyncckpt: `strategy='mcore'` cannot run: {why}. Use `strategy='nvrx'`"
                " (`pip install nvidia-resiliency-ext`), or pin"
                f" `pip install 'megatron-core<={MCORE_NEWEST_WITH_QUEUE}'`."
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
