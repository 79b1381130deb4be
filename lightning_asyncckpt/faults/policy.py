"""The fault policy: how injected faults (``lightning_asyncckpt.testing``) reach a save, without the
save pipeline knowing their kinds.

A policy answers, for each save, with a :class:`SaveFaults`: a picklable hook the writer runs before it
writes, and checks the trainer runs at named points of the save (before the snapshot, at the handover to the
worker, before ``.metadata``, before the publish). The default policy (``injected.EnvironmentFaults``) answers :data:`NO_FAULTS` unless
``LIGHTNING_ASYNCCKPT_FAULTS`` is set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

ENV_VAR = "LIGHTNING_ASYNCCKPT_FAULTS"

WriterHook = Callable[[list], None]  # picklable; the writer calls it with the save's buckets (``written`` optional)
FaultPoint = Callable[[Path | str], None]  # a check the trainer runs at a named point of a save, with its path


@dataclass(frozen=True)
class SaveFaults:
    """What to break in one save.

    Attributes:
        worker_hook: picklable; the writer process calls it with the save's buckets before writing, and its
            ``written(buckets)``, where it has one, once every byte is written, before it reports.
        at_snapshot: called in the trainer before it takes the snapshot, with the path.
        at_handover: called in the trainer right before it hands the planned write to the worker.
        before_metadata: called by the coordinator before it writes ``.metadata``, with the path.
        before_publish: called by the coordinator before the rename that publishes the checkpoint.
    """

    worker_hook: WriterHook | None = None
    at_snapshot: FaultPoint | None = None
    at_handover: FaultPoint | None = None
    before_metadata: FaultPoint | None = None
    before_publish: FaultPoint | None = None

    def check(self, point: FaultPoint | None, path: Path | str) -> None:
        """(trainer) Runs ``point`` (one of this object's fields) with the save's ``path``, where it is set.

        Args:
            point: ``at_snapshot``, ``at_handover``, ``before_metadata`` or ``before_publish`` (or None).
            path: the checkpoint being saved.
        """
        if point is not None:
            point(path)


NO_FAULTS = SaveFaults()


class FaultPolicy(Protocol):
    def for_save(self, rank: int, save: int, engine: str, worker: str) -> SaveFaults:
        """The faults of this rank's ``save``-th save (counting from 1) on that engine and worker."""


def check_policy(policy: object, where: str) -> None:
    """Refuses, where it is given (``where``: the argument, e.g. ``AsyncCheckpointIO(faults=...)``), what is no
    fault policy, instead of failing at the first save."""
    if policy is None or callable(getattr(policy, "for_save", None)):
        return
    raise TypeError(
        f"`{where.replace('...', repr(policy))}` takes a fault policy (an object with a method"
        " for_save(rank, save, engine, worker)) or None; got "
        f"{type(policy).__name__}. Fix: lightning_asyncckpt.testing.FaultList([Fault('enospc', ranks=(0,)), ...]); a"
        f" spec string such as 'enospc:rank=0' goes into FaultList(parse_faults(...)), or into the environment"
        f" variable {ENV_VAR} (read by the default policy, None)."
    )


def with_hook(faults: SaveFaults, hook: WriterHook | None) -> WriterHook | None:
    """The writer's hook for a save: the user's ``write_hook`` (may be None) then the injected one."""
    hooks = tuple(h for h in (hook, faults.worker_hook) if h is not None)
    if len(hooks) <= 1:
        return hooks[0] if hooks else None
    return ChainedHooks(hooks)


def after_write(hook: WriterHook, buckets: list) -> None:
    """(writer) Runs a writer hook's second point, ``hook.written(buckets)``, if it has one: every byte of the
    save is written and its files are closed, but the trainer has not been told yet."""
    written = getattr(hook, "written", None)
    if written is not None:
        written(buckets)


@dataclass(frozen=True)
class ChainedHooks:
    """Several picklable writer hooks, run in order (at both points, :func:`after_write`)."""

    hooks: tuple[WriterHook, ...]

    def __call__(self, buckets: list) -> None:
        for hook in self.hooks:
            hook(buckets)

    def written(self, buckets: list) -> None:
        for hook in self.hooks:
            after_write(hook, buckets)
