"""What the local tier owes the signal handlers it replaced (:func:`pass_on`).

While the local tier is armed, its own handler holds each preemption signal, so that the signal only
sets a flag and the ranks save at the next step boundary. The handler it replaced still has work to do:

- **Lightning's SLURM requeue** (the requeue signal under ``SLURMEnvironment(auto_requeue=True)``) saves
  ``hpc_ckpt_<N>.ckpt`` and requeues the job. Its save is collective, so it runs on every rank or on none
  (:attr:`~lightning_asyncckpt.tiers.boundary.Boundary.handlers_everywhere`).
- **A user's own handler**, installed before ``fit`` (or before ``FabricTiers``): stock Lightning calls it
  from its composed SIGTERM handler, after its own. It runs on the ranks that received the signal, as
  without the local tier.

Both run once the emergency save is complete, outside any signal handler, with ``frame=None``. Lightning's
other parts (its SIGTERM notifier, which kills the launcher's processes and runs a collective inside the
handler, Lightning #21406) are what the local tier replaces and are never called.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_asyncckpt.tiers.hook import LocalTierHook

log = logging.getLogger(__name__)


def _parts(handler: object) -> list[object]:
    """``handler`` flattened: Lightning's ``_HandlersCompose`` into the handlers it calls in turn."""
    if type(handler).__name__ == "_HandlersCompose":
        return [p for h in getattr(handler, "signal_handlers", []) for p in _parts(h)]
    return [handler]


def _lightnings(part: object) -> bool:
    """A method of Lightning's signal connector (its notifier, its SIGTERM bypass, its SLURM requeue)."""
    return type(getattr(part, "__self__", None)).__name__ == "_SignalConnector"


def is_lightnings_requeue(handler: object) -> bool:
    """Whether ``handler`` (the one installed for a signal) runs Lightning's SLURM requeue."""
    return any(_lightnings(p) and getattr(p, "__name__", "") == "_slurm_sigusr_handler_fn" for p in _parts(handler))


def users_own(handler: object) -> list[Callable[..., object]]:
    """The callables in ``handler`` (the handler the local tier replaced) that are not Lightning's: the
    user's own. ``SIG_DFL``, ``SIG_IGN`` and signal numbers are not handlers to call."""
    return [p for p in _parts(handler) if callable(p) and not isinstance(p, int) and not _lightnings(p)]


def pass_on(tier: LocalTierHook, handlers_everywhere: bool) -> None:
    """(every rank, at the boundary that stops training, after the emergency save is complete) Runs what the
    signal this rank received replaced: Lightning's SLURM requeue (see the module docstring) where every
    rank received that signal and has that handler, with a warning where not; and the user's own handlers.
    A rank that received no signal runs nothing. What a user's handler raises (``SystemExit``) propagates."""
    name = tier.preemption_signal
    if name is None:
        return
    signum = int(getattr(signal, name))
    requeue = tier.replaced_handler()  # only for a signal armed as collective: Lightning's requeue
    if requeue is not None:
        if handlers_everywhere:
            log.info("lightning-asyncckpt: passing %s on to Lightning's SLURM requeue handler", name)
            requeue(signum, None)
        else:
            log.warning("lightning-asyncckpt: not passing %s on to Lightning's SLURM requeue handler: not every rank"
                        " received it (or has that handler), and its save needs every rank; requeue the job yourself",
                        name)
    for own in users_own(tier.replaced(name)):
        log.info("lightning-asyncckpt: passing %s on to %s, the handler installed before the local tier",
                 name, getattr(own, "__qualname__", repr(own)))
        own(signum, None)
