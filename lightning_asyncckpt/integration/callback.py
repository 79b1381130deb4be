"""``AsyncFinalizerCallback``: runs ``AsyncCheckpointIO.finalize`` at the right hooks, on every rank."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from typing_extensions import override

from lightning_asyncckpt.integration import contract, tier_resume, tier_trainer
from lightning_asyncckpt.integration.io import AsyncCheckpointIO, find_async_io
from lightning_asyncckpt.integration.lightning_api import Callback, LightningModule, Trainer
from lightning_asyncckpt.integration.logger_relay import LoggerRelay
from lightning_asyncckpt.integration.patches import InstancePatches
from lightning_asyncckpt.integration.tier_step_end import TierStepEnd

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Lightning's SLURM auto-requeue saves `hpc_ckpt_<N>.ckpt`, then requeues the job, which stops it soon after
_REQUEUE_SAVE = re.compile(r"hpc_ckpt_\d+\.ckpt")


class AsyncFinalizerCallback(Callback):
    """Commits finished background saves and raises their errors on every rank of the trainer.

    - ``on_save_checkpoint`` (all ranks): counts the save, so that every rank knows a save is pending
      even though Lightning calls the plugin on global rank 0 only. Lightning skips this hook for
      weights-only saves; those are counted as they reach the strategy's ``save_checkpoint``, which
      every rank calls.
    - ``on_train_start`` and ``on_save_checkpoint`` (all ranks): tells the plugin the trainer's optimizers,
      whose parameters and state a lazy snapshot (``AsyncCheckpointIO(snapshot="lazy")``) copies in the
      background.
    - ``on_before_optimizer_step`` (all ranks, right before the real optimizer step: on the accumulation
      boundary, in automatic and manual optimization): waits for a lazy snapshot's copy, which the step
      would otherwise change (a collective save's write is handed over then; a single writer's already
      runs behind the gate its copy opened).
    - ``on_train_batch_end`` (all ranks): a non-blocking ``finalize``; a failed write raises
      :class:`~lightning_asyncckpt.CheckpointWriteError` here, within a step or two. With a local tier, its
      step end (agreement, local save, preemption) runs after every other callback's hook
      (:mod:`~lightning_asyncckpt.integration.tier_step_end`).
    - ``on_train_end`` (all ranks): a blocking ``finalize``, after every checkpoint callback's last save
      (Lightning runs checkpoint callbacks last).
    - Lightning's SLURM auto-requeue save (``hpc_ckpt_<N>.ckpt``, made right before ``scontrol requeue``
      stops the job): each rank waits for its writes before the requeue, with no collectives (a
      single-writer save is then committed; the ranks commit a sharded one at the next finalize or
      on the way out).
    - ``on_exception``: stops the workers without collectives and without masking the exception.

    After each of these, global rank 0 sends every newly committed save's figures to the trainer's
    loggers (``asyncckpt/stall_seconds``, ``write_seconds``, ``bytes_written``, ``write_gb_per_second``,
    ``pending_saves``; see :meth:`SaveRecord.metrics`), unless ``log_metrics=False``.

    Loggers hear of a checkpoint only once it is committed: ``ModelCheckpoint`` calls each logger's
    ``after_save_checkpoint`` right after it schedules a save; from ``setup`` to ``teardown`` (or
    ``on_exception``) those calls are deferred (:class:`~lightning_asyncckpt.integration.logger_relay.LoggerRelay`)
    and made, in order, after the finalize that committed every save scheduled before them. A call for
    which a save failed is dropped (the failure is raised as ``CheckpointWriteError``).

    A ``Trainer`` made with ``AsyncCheckpointIO`` gets one without being given it
    (:mod:`~lightning_asyncckpt.integration.autoattach`), unless another ``AsyncFinalizerCallback`` was given;
    a ``Trainer`` without the plugin gets none.
    """

    def __init__(self, log_metrics: bool = True) -> None:
        if not isinstance(log_metrics, bool):
            raise TypeError(f"`AsyncFinalizerCallback(log_metrics={log_metrics!r})` must be True or False.")
        self.log_metrics = log_metrics
        self._logged = 0  # io.history[:_logged] went to the loggers
        self._io: AsyncCheckpointIO | None = None
        self._auto = False
        self._prepare_pending = False
        self._capabilities = contract.StrategyCapabilities()  # the trainer's strategy's
        self._counted: dict[str, object] | None = None  # the checkpoint dict that on_save_checkpoint counted last
        self._patches = InstancePatches()  # the strategy's save_checkpoint, the checkpoint callbacks' file_exists
        self._relay = LoggerRelay()  # the loggers' after_save_checkpoint, deferred until the save commits
        self._tier_step_end = TierStepEnd(self._local_step_end)  # the local tier's, after every other callback

    @property
    def state_key(self) -> str:
        return f"{type(self).__qualname__}{'[auto]' if self._auto else ''}"

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """(all ranks, at the start of fit/validate/test/predict) Finds the trainer's ``AsyncCheckpointIO``;
        for fit, starts the worker on every writing rank (outside any training step).

        Args:
            trainer: the Trainer running the stage.
            pl_module: its LightningModule (unused).
            stage: ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``; only fit starts workers."""
        self._io = None
        self._prepare_pending = False
        io = find_async_io(trainer.strategy)
        if io is None:
            if not self._auto:
                log.warning("AsyncFinalizerCallback: the trainer does not use AsyncCheckpointIO; doing nothing.")
            return
        if self._auto and any(
            isinstance(cb, AsyncFinalizerCallback) and not cb._auto for cb in trainer.callbacks
        ):
            return
        self._io = io
        self._logged = len(io.history)
        self._capabilities = caps = contract.capabilities_of(trainer.strategy)
        # every rank is here: the exit group is made now, not inside the first save's stall
        io.session.begin_run(collective=caps.all_ranks_write and stage == "fit")
        if stage == "fit" and tier_trainer.start(trainer, io) is not None:  # collective: before any restore
            self._tier_step_end.attach(trainer)  # its saves built as ModelCheckpoint's are: after every callback
        self._watch_saves(trainer.strategy)
        self._watch_names(trainer)
        self._relay.attach(trainer.loggers, io.session)
        # start the worker now on every rank that writes, not inside a training step
        if stage == "fit" and (trainer.is_global_zero or caps.all_ranks_write):
            io.session.warmup()
            # a sharded strategy saves its own state layout: its first save allocates the buffers
            self._prepare_pending = not caps.own_state_layout

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, object]) -> None:
        """(all ranks, as Lightning builds a checkpoint) Counts the save on every rank.

        Args:
            trainer: the Trainer running the stage.
            pl_module: its LightningModule (unused).
            checkpoint: the checkpoint being built (remembered, so that its save is not counted twice)."""
        if self._io is not None and not tier_trainer.building_local_checkpoint():
            self._io.session.announce()
            self._io.session.track_optimizers(trainer.optimizers)  # the ones this save holds (configure may replace them)
            self._counted = checkpoint

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """(all ranks) Tracks the optimizers, for weights-only saves too (they run no ``on_save_checkpoint``).

        Args:
            trainer: the Trainer running the stage.
            pl_module: its LightningModule (unused)."""
        if self._io is not None:
            self._io.session.track_optimizers(trainer.optimizers)
            tier_trainer.arm(trainer, self._io)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        """(all ranks, right before the optimizer changes the state) Waits for a lazy snapshot's copy, the
        persistent save's and the local tier's.

        Args:
            trainer: the Trainer running the stage.
            pl_module: its LightningModule (unused).
            optimizer: the optimizer about to step (unused: every lazy copy is waited for)."""
        if self._io is not None:
            self._io.session.wait_for_snapshot()

    def _watch_saves(self, strategy: object) -> None:
        """Every rank calls ``strategy.save_checkpoint`` for every save, weights-only ones included (for
        which Lightning runs no callback hook). There: count the saves ``on_save_checkpoint`` did not, so
        that an error of a weights-only save reaches every rank within a step or two as well; and finish
        the write of a SLURM requeue save before it returns."""
        def make(original: Callable[..., None]) -> Callable[..., None]:
            def save_checkpoint(checkpoint: dict[str, object], filepath: Path | str,
                                storage_options: object | None = None) -> None:
                if self._io is not None and checkpoint is not self._counted:
                    self._io.session.announce()
                self._counted = None
                original(checkpoint, filepath, storage_options=storage_options)
                if self._io is not None and _REQUEUE_SAVE.fullmatch(os.path.basename(str(filepath))):
                    # the requeue that follows stops this job: the write must not still be running then
                    self._io.session.wait_for_local_writes()

            return save_checkpoint

        self._patches.wrap(strategy, "save_checkpoint", make)

    def _watch_names(self, trainer: Trainer) -> None:
        """``ModelCheckpoint`` picks a free name (``-v1``, ``-v2``) by asking whether a file exists; a save still
        being written does not yet, so a later save could take its name. Each of the trainer's
        checkpoint callbacks also counts pending saves as existing (decided on global rank 0, as stock)."""
        session = self._io.session if self._io is not None else None

        def make(original: Callable[[Path | str, Trainer], bool]) -> Callable[[Path | str, Trainer], bool]:
            def file_exists(filepath: Path | str, trainer: Trainer) -> bool:
                if original(filepath, trainer):
                    return True
                pending = bool(trainer.is_global_zero and session is not None and session.is_pending(filepath))
                return trainer.strategy.reduce_boolean_decision(pending, all=False)

            return file_exists

        for cb in trainer.checkpoint_callbacks:
            self._patches.wrap(cb, "file_exists", make)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """(all ranks) Gives the strategy its own ``save_checkpoint`` back, and the checkpoint callbacks their
        own ``file_exists``, and the loggers their own ``after_save_checkpoint``.

        Args:
            trainer: the Trainer running the stage.
            pl_module: its LightningModule (unused).
            stage: the stage that ends."""
        self._relay.detach()
        self._patches.undo()
        self._tier_step_end.detach(trainer)
        self._counted = None

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:
        """(all ranks, after every training batch) Non-blocking finalize; raises a failed write here.

        Args:
            trainer: the Trainer running the stage.
            pl_module: its LightningModule (its ``state_dict`` sizes the staging buffers after the first step).
            outputs: the batch's outputs (unused).
            batch: the batch (unused).
            batch_idx: its index (unused)."""
        if self._io is None:
            return
        if self._prepare_pending:
            # After the first optimizer step the optimizer state exists: allocate the staging buffers now
            # (before checkpoint callbacks, which run after this one), not inside the first save.
            self._prepare_pending = False
            like = {"state_dict": pl_module.state_dict(),
                    "optimizer_states": [o.state_dict() for o in trainer.optimizers]}
            self._io.session.prepare(like, distributed=self._capabilities.all_ranks_write)
        self._finalize(blocking=False)
        self._log_committed(trainer)

    def _local_step_end(self, trainer: Trainer) -> None:
        """(all ranks, after every training batch, after every other callback: :class:`TierStepEnd`) The local
        tier's agreement and save; on a preemption, the persistent saves drained too, then training stops."""
        if self._io is None or self._io.session.tier is None:
            return
        # AsyncModelParallelStrategy: each rank's shards, even where the persistent saves gather a full state
        with contract.local_tier_state(trainer.strategy):
            preempted = tier_trainer.step_end(trainer, self._io)
        if preempted:
            self._finalize(blocking=True)
            self._log_committed(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """(all ranks, once at the end of fit) Blocking finalize: every save is committed or raised.

        Args:
            trainer: the Trainer running the stage.
            pl_module: its LightningModule (unused)."""
        if self._io is not None:
            self._finalize(blocking=True)
            self._log_committed(trainer)
            tier_trainer.stop(self._io)

    def _finalize(self, blocking: bool) -> None:
        """The session's ``finalize`` (agreeing only while a save is pending), then the loggers' deferred ``after_save_checkpoint`` calls whose saves committed
        (also when it raises: the saves before a failed one committed)."""
        assert self._io is not None
        try:
            self._io.session.finalize(blocking, only_if_pending=True)
        except BaseException:
            self._relay.replay(quiet=True)
            raise
        self._relay.replay()

    def _log_committed(self, trainer: Trainer) -> None:
        """(global rank 0) The figures of the saves committed since the last call, to every logger."""
        assert self._io is not None
        new = self._io.history[self._logged:]
        self._logged = len(self._io.history)
        if not (new and self.log_metrics and trainer.is_global_zero and trainer.loggers):
            return
        step = trainer.fit_loop.epoch_loop._batches_that_stepped  # the step Lightning's own logging uses
        for record in new:
            for logger in trainer.loggers:
                logger.log_metrics(record.metrics(), step=step)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """(the ranks that raised) Stops the workers without collectives, leaving ``exception`` to propagate;
        then tells the loggers of the saves that committed on the way out, and gives them their own
        ``after_save_checkpoint`` back (Lightning runs no ``teardown`` hook after an exception).

        Args:
            trainer: the Trainer running the stage.
            pl_module: its LightningModule (unused).
            exception: the exception raised (left to propagate)."""
        if self._io is not None:
            self._io.abort()
            tier_trainer.stop(self._io, wait=False)
        self._relay.detach()
        self._tier_step_end.detach(trainer)


def needs_a_finalizer(trainer: Trainer) -> bool:
    """Whether ``trainer`` has no ``AsyncFinalizerCallback`` (:mod:`~lightning_asyncckpt.integration.autoattach`)."""
    return not any(isinstance(cb, AsyncFinalizerCallback) for cb in trainer.callbacks)


def attach_resume(trainer: Trainer) -> None:
    """The wrappers of ``trainer``'s checkpoint connector that resolve ``ckpt_path="last"``
    (:mod:`~lightning_asyncckpt.integration.tier_resume`), for a Trainer made with the plugin."""
    tier_resume.attach(trainer)


def automatic_finalizer() -> AsyncFinalizerCallback:
    """The finalizer :mod:`~lightning_asyncckpt.integration.autoattach` adds to a Trainer made with the plugin
    and without a finalizer of its own: inert where one is given later."""
    cb = AsyncFinalizerCallback()
    cb._auto = True
    return cb


def external_callbacks() -> list[Callback]:
    """No callbacks: where an earlier install left the package's Lightning ``callbacks_factory`` entry point
    (installing again removes it), this is what it gives every Trainer now. The finalizer goes only to
    Trainers made with the plugin (:mod:`~lightning_asyncckpt.integration.autoattach`)."""
    return []


_external_callbacks = external_callbacks  # the name the entry point had: an editable install not yet reinstalled
