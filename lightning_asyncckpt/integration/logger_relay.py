"""``LoggerRelay``: a logger hears of a checkpoint (``after_save_checkpoint``) only once it is committed.

Stock ``ModelCheckpoint`` calls ``logger.after_save_checkpoint(proxy(checkpoint_callback))`` right after
``trainer.save_checkpoint`` returns. Under ``AsyncCheckpointIO`` the save is only scheduled then, so a
logger that uploads checkpoints (``MLFlowLogger(log_model=...)``, ``WandbLogger(log_model="all")``) would
look for files that do not exist yet. The relay, set up by ``AsyncFinalizerCallback``:

- replaces each of the trainer's loggers' ``after_save_checkpoint`` with a wrapper (an instance attribute,
  given back at ``detach``) that records the call with how many saves this rank had scheduled so far
  (``SaveSession.saves_scheduled``);
- after every finalize (``replay``), makes the recorded calls, in the order Lightning made them, whose
  saves have all committed; a call for which one of those saves did not commit (the failure is raised
  as ``CheckpointWriteError`` by the finalize) is dropped, never made.

A call for which nothing is pending (a rank that saves nothing; a save completed synchronously) is made
at once, after the calls recorded before it.

A deferred call sees what stock's call would have seen: the logger gets a copy of the checkpoint
callback's state as it was when Lightning made the call (its ``best_k_models``, ``last_model_path``,
scores), and the removals Lightning asked for meanwhile (top-k) wait until the deferred calls are made
(``SaveSession.hold_removals``), so a checkpoint that fell out of the top k is still there for
the call that announces it.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_asyncckpt.integration.patches import InstancePatches

if TYPE_CHECKING:
    from lightning.pytorch.loggers import Logger

    from lightning_asyncckpt.integration.contract import SessionInterface

log = logging.getLogger(__name__)

_HOOK = "after_save_checkpoint"


@dataclass
class _Call:
    original: Callable[[object], None]  # the logger's own bound after_save_checkpoint
    checkpoint_callback: object  # what Lightning passed (a weakref proxy of the ModelCheckpoint)
    mark: int  # io.saves_scheduled when the call was made


class LoggerRelay:
    """Defers the loggers' ``after_save_checkpoint`` until the saves scheduled before each call commit."""

    def __init__(self) -> None:
        self._io: SessionInterface | None = None
        self._since = 0  # io.saves_scheduled at attach, then through which save every call was settled
        self._deferred: deque[_Call] = deque()
        self._patches = InstancePatches()  # each logger's after_save_checkpoint, ours until detach

    @property
    def num_deferred(self) -> int:
        """Calls recorded and not yet made or dropped."""
        return len(self._deferred)

    def attach(self, loggers: Iterable[Logger], io: SessionInterface) -> None:
        """(all ranks, at the callback's ``setup``) Wraps each logger's ``after_save_checkpoint``.

        Args:
            loggers: the trainer's loggers.
            io: the session of the trainer's ``AsyncCheckpointIO`` (``io.session``)."""
        self.detach()
        self._io, self._since = io, io.saves_scheduled
        for logger in loggers:
            self._patches.wrap(logger, _HOOK, self._deferring)

    def replay(self, quiet: bool = False) -> None:
        """(all ranks, after each finalize) Makes, in order, the recorded calls whose saves all committed;
        drops those for which one did not. ``quiet`` (while an exception propagates): a logger's error is
        logged, not raised, so as not to mask it. Once none is left, the held removals run."""
        try:
            self._replay(quiet)
        finally:
            if not self._deferred and self._io is not None:
                self._io.hold_removals(False)

    def _replay(self, quiet: bool) -> None:
        while self._deferred and self._io is not None:
            call = self._deferred[0]
            settled = self._io.saves_settled(call.mark, since=self._since)
            if settled is None:
                return
            self._deferred.popleft()
            if not settled:
                log.warning("lightning-asyncckpt: a checkpoint save failed; the loggers are not told of it"
                            " (after_save_checkpoint dropped)")
                continue
            self._since = max(self._since, call.mark)
            if not quiet:
                call.original(call.checkpoint_callback)
                continue
            try:
                call.original(call.checkpoint_callback)
            except Exception:  # noqa: BLE001 - on the way out: report, never mask the original error
                log.exception("lightning-asyncckpt: a logger's after_save_checkpoint failed")

    def detach(self) -> None:
        """(all ranks, at the callback's ``teardown``) Makes the calls that can be made (quietly), drops the
        others, and gives each logger its own ``after_save_checkpoint`` back."""
        self.replay(quiet=True)
        if self._deferred:
            log.warning("lightning-asyncckpt: %d logger after_save_checkpoint call(s) dropped: their saves did"
                        " not commit", len(self._deferred))
            self._deferred.clear()
            if self._io is not None:
                self._io.hold_removals(False)
        self._patches.undo()
        self._io = None

    def _deferring(self, original: Callable[[object], None]) -> Callable[[object], None]:
        """A logger's ``after_save_checkpoint`` that records the call, to be made by :meth:`replay`."""

        def after_save_checkpoint(checkpoint_callback: object) -> None:
            self._deferred.append(_Call(original, _as_of_now(checkpoint_callback), self._io.saves_scheduled))
            self._io.hold_removals(True)
            self.replay()

        return after_save_checkpoint


def _as_of_now(checkpoint_callback: object) -> object:
    """A copy of the checkpoint callback's state now, for a call made later: what a logger reads of it
    (``best_k_models``, ``last_model_path``, ``best_model_path``, scores) as stock's call would see it.
    Lightning passes a weak proxy; its attributes are the callback's own."""
    try:
        frozen = object.__new__(checkpoint_callback.__class__)
        frozen.__dict__.update(copy.copy(checkpoint_callback.__dict__))
        if isinstance(getattr(frozen, "best_k_models", None), dict):
            frozen.best_k_models = dict(frozen.best_k_models)
        return frozen
    except Exception:  # noqa: BLE001 - an unusual callback: the live one, as before
        return checkpoint_callback
