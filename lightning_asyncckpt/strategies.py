"""Strategies that route every rank's save through ``AsyncCheckpointIO``."""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_asyncckpt.callback import find_async_io
from lightning_asyncckpt.io import AsyncCheckpointIO


class AsyncDDPStrategy(DDPStrategy):
    """A drop-in :class:`~lightning.pytorch.strategies.DDPStrategy` whose saves are written by all ranks.

    The model and optimizer state are replicated under DDP. Instead of rank 0 writing all of it, each
    rank snapshots and writes a disjoint, size-balanced share in the background, so every byte is
    written once and the write bandwidth of every rank is used. The result is one checkpoint directory
    that loads on any number of ranks (and with plain ``torch.distributed.checkpoint``).

    Uses the ``AsyncCheckpointIO`` given in ``plugins`` (or ``checkpoint_io``), else ``AsyncCheckpointIO()``.
    ``save_checkpoint`` runs on every rank (Lightning calls it on all of them); ``remove_checkpoint`` on
    global rank 0; finalization through ``AsyncFinalizerCallback`` on every rank.
    """

    _asyncckpt_all_ranks_write = True  # AsyncFinalizerCallback warms the worker up on every rank

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = AsyncCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    def _async_io(self) -> AsyncCheckpointIO:
        io = find_async_io(self)
        if io is None:
            raise TypeError(
                f"`AsyncDDPStrategy` needs an `AsyncCheckpointIO` plugin; got {type(self.checkpoint_io).__name__}."
            )
        return io

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """(all ranks) Each rank schedules the write of its share; returns once the snapshot is taken."""
        self._async_io().save_checkpoint_distributed(checkpoint, filepath, storage_options)
