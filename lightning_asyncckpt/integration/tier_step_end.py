"""The local tier's step end, run after every other callback's ``on_train_batch_end``.

``ModelCheckpoint`` builds its checkpoint in ``on_train_batch_end``, and Lightning runs checkpoint callbacks
after all others: so its file holds every callback's state as it is after that hook, its own included (the
file it is saving is already in its top-k). A local save taken earlier in the same hook (from
``AsyncFinalizerCallback``, which users list first) held the states of the callbacks after it from *before*
their hook: a resume from it lost a step of a counting callback, and ``ModelCheckpoint`` forgot the file it
saved at that very step, which then stayed in its directory for good.

So ``AsyncFinalizerCallback`` appends this callback to ``trainer.callbacks`` at the start of fit (after
Lightning has ordered them) and removes it at the end: the local save's checkpoint is built after every
callback's hook, as ``ModelCheckpoint``'s own is, and before the ``LightningModule``'s, as Lightning's is.
It has no state, so it is in no checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

from typing_extensions import override

from lightning_asyncckpt.integration.lightning_api import Callback, LightningModule, Trainer


class TierStepEnd(Callback):
    """Calls ``step_end(trainer)`` on every rank after every training batch, after every other callback."""

    def __init__(self, step_end: Callable[[Trainer], None]) -> None:
        self._step_end = step_end

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:
        """(all ranks, after every training batch, after every other callback's hook)"""
        self._step_end(trainer)

    def attach(self, trainer: Trainer) -> None:
        """(all ranks, at the start of fit, once Lightning has ordered the callbacks) Runs last from now on."""
        self.detach(trainer)
        trainer.callbacks.append(self)

    def detach(self, trainer: Trainer) -> None:
        """(all ranks, at the end of fit or on its exception) No longer called."""
        trainer.callbacks[:] = [cb for cb in trainer.callbacks if cb is not self]
