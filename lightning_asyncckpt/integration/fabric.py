"""Asynchronous sharded checkpoints for Fabric.

Fabric's own ``ModelParallelStrategy`` (FSDP2, tensor parallel) refuses ``CheckpointIO`` plugins and
saves synchronously. :class:`AsyncFabricModelParallelStrategy` is a drop-in subclass whose
``fabric.save`` returns once each rank has snapshotted its shards; the workers write them in the
stock layout. (For Fabric's DDP strategy, pass ``AsyncCheckpointIO`` in ``plugins`` instead.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_asyncckpt.format import integrity
from lightning_asyncckpt.integration import lightning_api, loading, tier_fabric_load
from lightning_asyncckpt.integration.io import AsyncCheckpointIO
from lightning_asyncckpt.integration.lightning_api import CheckpointIO
from lightning_asyncckpt.integration.lightning_api import FabricModelParallelStrategy as ModelParallelStrategy
from lightning_asyncckpt.storage import paths
from lightning_asyncckpt.tiers import restore_key


class AsyncFabricModelParallelStrategy(ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` with background saves written by every rank.

    Same arguments as ``lightning.fabric.strategies.ModelParallelStrategy``, plus ``checkpoint_io`` (else the
    ``AsyncCheckpointIO`` in Fabric's ``plugins``, else ``AsyncCheckpointIO()``)::

        strategy = AsyncFabricModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
        fabric = Fabric(devices=2, strategy=strategy)
        fabric.launch()
        with strategy.checkpoint_io as io:  # all ranks; on exit every save is committed, workers stop
            for step in ...:
                ...
                fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})  # returns early
                io.finalize()  # all ranks, e.g. every step: commits finished saves, raises failures everywhere

    ``fabric.save`` (all ranks): each rank snapshots its shards and returns; rank 0 also keeps the
    non-module values for ``meta.pt``. ``fabric.load`` (all ranks) first waits for pending saves, then
    loads (checkpoints of any world size, this package's or stock Fabric's). With
    ``save_distributed_checkpoint=False`` saves are the stock, synchronous full-state files.
    """

    def __init__(self, *args: object, checkpoint_io: AsyncCheckpointIO | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._checkpoint_io = checkpoint_io

    @property
    @override
    def checkpoint_io(self) -> AsyncCheckpointIO:
        """(any rank) The ``AsyncCheckpointIO`` that writes this strategy's saves: the one given, else the one
        in Fabric's ``plugins``, else a default ``AsyncCheckpointIO()`` created on first use."""
        if self._checkpoint_io is None:
            self._checkpoint_io = AsyncCheckpointIO()
        return self._checkpoint_io  # type: ignore[return-value]

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO) -> None:
        """Sets the plugin; anything other than an ``AsyncCheckpointIO`` raises ``TypeError``."""
        if not isinstance(io, AsyncCheckpointIO):
            raise TypeError(f"`{type(self).__name__}` writes through `AsyncCheckpointIO`; got {type(io).__name__}.")
        self._checkpoint_io = io

    @override
    def save_checkpoint(
        self, path: Path | str, state: dict[str, object], storage_options: object | None = None,
        filter: dict | None = None,
    ) -> None:
        """(all ranks) Snapshots this rank's shards and schedules their write; returns before it is done.

        Args:
            path: the checkpoint directory (global rank 0's is used on every rank), local or an fsspec URL.
            state: Fabric's state: the model, its optimizers and other values.
            storage_options: refused unless None (``TypeError``).
            filter: with ``save_distributed_checkpoint=False`` only, as Fabric's; else refused."""
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
            return
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported.")
        if filter is not None:
            raise NotImplementedError(
                f"{type(self).__name__} doesn't support distributed filtered checkpoints (neither does Fabric's)."
            )
        path = paths.checkpoint_path(self.broadcast(path))  # a local Path, or an object-store URL
        converted, meta = sharded_state(state)
        self.checkpoint_io.save_checkpoint_sharded(converted, path, meta)

    @override
    def load_checkpoint(
        self, path: Path | str, state: Module | Optimizer | dict[str, object] | None = None, strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """(all ranks) Commits or fails every pending save first, then loads as Fabric does; the key that
        ``FabricTiers.resume`` got for a local-tier step loads this rank's shards of it
        (:mod:`~lightning_asyncckpt.integration.tier_fabric_load`).

        Args:
            path: the checkpoint (global rank 0's is used on every rank), or a key ``FabricTiers.resume`` gave.
            state: what to load into, in place (as Fabric's ``load``).
            strict: every key of ``state`` must be in the checkpoint.
            weights_only: as ``torch.load``'s (None: torch's default).

        Returns:
            The values of the checkpoint not loaded into ``state``, as Fabric's."""
        io = self.checkpoint_io
        io.session.finalize(blocking=True)  # every pending save committed or raised first
        restored = io.session.take_restored(path)
        if restored is not None:
            return tier_fabric_load.load_shards(restored, state or {}, strict, self.root_device)
        step = restore_key.step_of(path)
        if step is not None:  # a local step's key loaded again: it is not a file
            raise restore_key.not_held(path, step)
        path = self.broadcast(path)
        if isinstance(state, dict) and loading.is_sharded(path):  # each rank checks the items it reads, once
            return loading.load_sharded(Path(path), state, strict, weights_only, io.verify_on_load)
        # paths inside the checkpoint, regular files, CRC32 (io.verify_on_load), before Fabric's reader reads
        integrity.check_path(path, crc=io.verify_on_load, allow_pickle=weights_only is False)
        return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)


def sharded_state(state: dict[str, object]) -> tuple[dict[str, object], dict[str, object]]:
    """Splits a Fabric state into the sharded state dicts of its model and optimizers (the ``DTensor``
    local shards, not gathered, left on their device for the stager) and the other values, as Fabric's
    ``ModelParallelStrategy`` does."""
    _has_dtensor_modules = lightning_api.fabric_module("strategies.model_parallel")._has_dtensor_modules
    _Stateful = lightning_api.fabric_module("utilities.types")._Stateful
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    modules = [m for m in state.values() if _has_dtensor_modules(m)]
    if len(modules) != 1:
        raise ValueError(
            f"A sharded save needs exactly one distributed model in the state (e.g. `{{'model': model, ...}}`);"
            f" found {len(modules)}."
        )
    options = StateDictOptions(full_state_dict=False, cpu_offload=False)
    converted: dict[str, object] = {}
    meta: dict[str, object] = {}
    for key, obj in state.items():
        if isinstance(obj, Module):
            converted[key] = get_model_state_dict(obj, options=options)
        elif isinstance(obj, Optimizer):
            converted[key] = get_optimizer_state_dict(modules[0], obj, options=options)
        else:
            meta[key] = obj.state_dict() if isinstance(obj, _Stateful) else obj
    return converted, meta
