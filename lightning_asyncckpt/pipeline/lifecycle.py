"""The life of one run of saves inside a :class:`~lightning_asyncckpt.pipeline.pipeline.SaveSession`: the
current :class:`~lightning_asyncckpt.pipeline.run_state.Run` (made at the first save, ``begin_run`` or ``warmup``,
ended by :meth:`RunLifecycle.stop`), who settles its saves (:class:`Phase`), the exit group for committing
collective saves on the way out, the interpreter-exit hook, and the drain of what is in flight when a rank
raises. The session decides when; this object keeps the state and does the ending."""

from __future__ import annotations

import enum
import logging
import sys
import time
from collections.abc import Callable

from lightning_asyncckpt.collectives.agreement import Agreement
from lightning_asyncckpt.pipeline import settle_copy
from lightning_asyncckpt.pipeline.drain import AtExit, ExitGroup, drain
from lightning_asyncckpt.pipeline.run_state import Run
from lightning_asyncckpt.pipeline.settings import Settings

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    """Who settles the saves of the current run."""

    OPEN = "open"  # nobody said: a Trainer save outside any stage completes before it returns
    BEGUN = "begun"  # a Trainer stage (the callback) or the user (warmup, ``with``) will finalize
    CLOSED = "closed"  # torn down: nobody finalizes, so a save completes before it returns


class RunLifecycle:
    """(one rank) The session's current run and what ends it. Local: its collectives (the exit group, the
    drain's agreement) run where the session's callers run them, on the ranks they name."""

    def __init__(self) -> None:
        self.run: Run | None = None
        self.phase = Phase.OPEN
        self._handling_at_start: BaseException | None = None  # the exception being handled as the run began
        self._exit_group = ExitGroup()
        self._at_exit = AtExit()

    def ensure(self, make: Callable[[], Run]) -> Run:
        """The current run, made by ``make`` if there is none (remembering the exception being handled then)."""
        if self.run is None:
            self.run = make()
            self._handling_at_start = sys.exc_info()[1]
        return self.run

    def begin(self) -> None:
        """A Trainer stage or the user will finalize the saves from now on."""
        self.phase = Phase.BEGUN

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    def completes_now(self, trainer_save: bool) -> bool:
        """Whether nobody will finalize a save just submitted (torn down; or a Trainer save outside any stage)."""
        return self.phase is Phase.CLOSED or (trainer_save and self.phase is Phase.OPEN)

    def raised_during_run(self) -> bool:
        """Whether an exception propagates that was raised during this run (not one the user was already
        handling when the run began: a retry loop's ``except`` block)."""
        propagating = sys.exc_info()[1]
        return propagating is not None and propagating is not self._handling_at_start

    def arm_exit(self, obj: object, abort: Callable[[object], None]) -> None:
        """At interpreter exit, ``abort(obj)`` runs unless the run stopped first."""
        self._at_exit.arm(obj, abort)

    def make_exit_group(self, agreement: Agreement, timeout_s: float) -> None:
        """(all ranks, together) The group for committing collective saves on the way out."""
        self._exit_group.make(agreement, timeout_s)

    def exit_group_ready(self) -> bool:
        return self._exit_group.usable()

    def drain(self, agreement: Agreement, settings: Settings) -> None:
        """(the ranks that raised; never raises) Lets the saves in flight land within ``drain_timeout_s``: a
        clean lazy snapshot is handed over first, to land like the others. What goes wrong is logged."""
        run = self.run
        if run is None:
            return
        drain_timeout_s = settings.drain_timeout_s
        deadline = time.monotonic() + drain_timeout_s  # one bound for the lazy copy's wait and the drain
        try:
            if run.copying is not None:
                settle_copy.finish_copy(run, agreement, settings, within_s=drain_timeout_s)
        except Exception:  # noqa: BLE001 - on the way out: report, never mask the original error
            log.exception("lightning-asyncckpt: the lazy snapshot in flight failed")
        try:
            left = max(0.0, deadline - time.monotonic())
            drain(run, settings, agreement.rank, self._exit_group, left)
        except Exception:  # noqa: BLE001 - on the way out: report, never mask the original error
            log.exception("lightning-asyncckpt: error while draining the saves in flight")

    def stop(self, rank: int, abort: bool) -> None:
        """The run ends: its workers stop (``abort``: without waiting for a write in progress); a save after
        this completes before it returns."""
        self.phase = Phase.CLOSED
        self._at_exit.disarm()
        run, self.run = self.run, None
        if run is not None:
            run.close(rank, abort)
