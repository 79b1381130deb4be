"""Preemption signals set a flag, nothing more.

The handler runs between two bytecodes of whatever the main thread is doing (a collective, a write):
saving or talking to other ranks there can deadlock or corrupt (Lightning #21406). So it only records the
signal; the ranks agree on it at the next step boundary (:mod:`~lightning_asyncckpt.tiers.boundary`) and save there.

The handlers it replaced may still be owed the signal (Lightning's SLURM requeue, a user's own handler):
after the emergency save the caller runs them itself, at the boundary
(:mod:`lightning_asyncckpt.integration.replaced_handlers`). A collective one (the requeue's save) runs only
where every rank received the same signal: a save that only some ranks enter would wait forever.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType

    Handler = Callable[[int, FrameType | None], object]  # a Python signal handler

log = logging.getLogger(__name__)


class PreemptionFlag:
    """(one rank, main thread) Installs handlers for ``names`` until :meth:`uninstall`."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        self._pass_on: tuple[str, ...] = ()

    def install(self, pass_on: tuple[str, ...] = ()) -> bool:
        """Installs the handlers; False (nothing installed) off the main thread, where Python allows none.
        ``pass_on``: signals whose replaced handler is collective (Lightning's SLURM requeue), see
        :meth:`replaced_handler`."""
        if not self.names or threading.current_thread() is not threading.main_thread():
            return False
        self._pass_on = tuple(pass_on)
        for name in self.names:
            sig = getattr(signal, name)
            self._previous.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, self._handle)
        return True

    def arm(self, rank: int, pass_on: tuple[str, ...] = ()) -> bool:
        """(global rank ``rank``, once the training loop starts) :meth:`install`, with one warning where the
        signals could not be handled (not the main thread), which the user then learns at setup."""
        armed = self.install(pass_on)
        if not armed and self.names:
            log.warning("lightning-asyncckpt: LocalTier(emergency_signals=%s) are not handled on global rank %d:"
                        " its training loop runs off Python's main thread, where no signal handler can be"
                        " installed, so a preemption stops it without an emergency save. Fix: train on the main"
                        " thread, or emergency_signals=() to say that this is meant.", self.names, rank)
        return armed

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name

    @property
    def received_number(self) -> int:
        """The received signal's number, 0 for none: what the ranks compare at a step boundary."""
        return int(getattr(signal, self.received)) if self.received else 0

    def replaced(self, name: str) -> object:
        """The handler that :meth:`install` replaced for signal ``name`` (callable or not), None if none."""
        return self._previous.get(getattr(signal, name))

    def replaced_handler(self) -> Handler | None:
        """The Python handler that :meth:`install` replaced for the received signal, where that signal is one
        passed on collectively (``pass_on``); else None. The caller runs it outside any signal handler, at a
        step boundary."""
        if self.received not in self._pass_on:
            return None
        previous = self.replaced(self.received)
        return previous if callable(previous) else None

    def uninstall(self) -> None:
        """Gives each signal the handler it had before :meth:`install`."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle and previous is not None:
                signal.signal(sig, previous)
        self._previous = {}
