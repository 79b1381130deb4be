"""``LocalTierHook``: the named interface through which the plugin and Lightning's side drive the local tier.

The local tier is a component of the save session: :func:`~lightning_asyncckpt.tiers.setup.open_tier` makes
one (every rank, at setup), ``AsyncCheckpointIO.session.attach_tier`` attaches it, ``detach_tier`` takes it back at
the end of the run; nothing assigns it from outside. Its verbs, every one called on every rank in the same
order:

- :meth:`LocalTierHook.begin` names the run (at the resume decision, before any local save or restore);
- :meth:`LocalTierHook.latest` is the restore at resume: the key of the local step to load, or the
  persistent checkpoint; :meth:`LocalTierHook.take` then hands the load the checkpoint it fetched;
- :meth:`LocalTierHook.step_end` is the save at a step boundary (and the preemption request, agreed there);
- :meth:`LocalTierHook.wait_copy` runs right before the optimizer changes the state (a lazy save's copy);
- :meth:`LocalTierHook.arm` installs the preemption handlers once the loop runs; at the boundary that
  stops training, :attr:`LocalTierHook.preemption_signal`, :meth:`LocalTierHook.replaced_handler` and
  :meth:`LocalTierHook.replaced` say what the signal replaced
  (:mod:`~lightning_asyncckpt.integration.replaced_handlers`);
- :meth:`LocalTierHook.finish` and :meth:`LocalTierHook.close` end the run.

:class:`~lightning_asyncckpt.tiers.tier_run.TierRun` implements it; ``integration.tier_trainer`` (the Trainer) and
``integration.tier_fabric`` (a Fabric loop) drive it, and ``AsyncCheckpointIO`` asks it for a restored
checkpoint at load and waits for its copy before the optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pathlib import Path

    from lightning_asyncckpt.tiers.preemption import Handler

from lightning_asyncckpt.snapshot.staging import Defer

Checkpoint = dict[str, Any]
LazyRule = Defer | None  # a lazy snapshot's rule (AsyncCheckpointIO.lazy_rule()); None: everything copied at once
CopyHook = Callable[[], None] | None  # a lazy copy's thread calls it first (tests: testing.HoldCopy)


@dataclass(frozen=True)
class StepEnd:
    """What a step boundary decided (:meth:`LocalTierHook.step_end`)."""

    saved: bool  # this step was saved to the local tier
    preempted: bool  # some rank received a preemption signal: this step is saved and complete; stop training
    complete: int  # the newest step complete on every rank (-1: none yet)
    handlers_everywhere: bool = False  # every rank received the same signal and has the handler it replaced
    replicated: bool = False  # the saves are replicated to peer ranks (their replicas are complete too)


@runtime_checkable
class LocalTierHook(Protocol):
    """(every rank) One run's local tier, as the session and Lightning's side drive it."""

    def begin(self, destination: str = "", resuming: bool = False) -> None:
        """(every rank, together, once per run) Names the run: a new one, or where ``resuming`` the one whose
        local steps were saved for ``destination``."""

    def latest(self, persistent: str | Path | None, weights_only: bool | None = None) -> str | Path | None:
        """(every rank, together, before loading) The key of the local step to resume from, or ``persistent``."""

    def take(self, key: object) -> Checkpoint | None:
        """(any rank, at load) The checkpoint :meth:`latest` fetched for ``key`` (once), or None."""

    def step_end(self, step: int, checkpoint: Callable[[], Checkpoint], like: Callable[[], Checkpoint],
                 lazy: LazyRule = None, hook: CopyHook = None) -> StepEnd:
        """(every rank, after every optimizer step) Agrees on the boundary; saves ``checkpoint()`` when a save
        is due or a preemption was requested; until the first save, makes its files sized for ``like()``."""

    def wait_copy(self) -> None:
        """(every rank, right before the optimizer changes the state) Waits for a lazy save's copy."""

    def arm(self, pass_on: tuple[str, ...] = ()) -> bool:
        """(every rank, main thread, once the training loop starts) Installs the preemption handlers; False
        where none could be installed. ``pass_on``: signals whose replaced handler is collective."""

    @property
    def preemption_signal(self) -> str | None:
        """(any rank) The signal this rank received (``"SIGTERM"``), None for none."""

    def replaced_handler(self) -> Handler | None:
        """(every rank, at the boundary that stops training) The collective handler to pass the signal on to."""

    def replaced(self, name: str) -> object:
        """(any rank) The handler that :meth:`arm` replaced for signal ``name`` (None: none)."""

    def finish(self) -> int:
        """(every rank) Waits for the save in flight and agrees; returns the newest complete step."""

    def close(self, wait: bool = True) -> None:
        """(every rank) Ends the run: waits for the save in flight unless not ``wait``, releases its lock."""
