"""Preemption signals set a flag, nothing more.

The handler runs between two bytecodes of whatever the main thread is doing (a collective, a write):
saving or talking to other ranks there can deadlock or corrupt (Lightning #21406). So it only records the
signal; the ranks agree on it at the next step boundary (:meth:`TierRun.boundary`) and save there.
"""

from __future__ import annotations

import signal
import threading
from typing import Any


class PreemptionFlag:
    """(one rank, main thread) Installs handlers for ``names`` until :meth:`uninstall`."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> bool:
        """Installs the handlers; False (nothing installed) off the main thread, where Python allows none."""
        if not self.names or threading.current_thread() is not threading.main_thread():
            return False
        for name in self.names:
            sig = getattr(signal, name)
            self._previous.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, self._handle)
        return True

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum).name

    def uninstall(self) -> None:
        """Gives each signal the handler it had before :meth:`install`."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle and previous is not None:
                signal.signal(sig, previous)
        self._previous = {}
