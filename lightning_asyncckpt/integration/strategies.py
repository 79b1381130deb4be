"""Strategies that route every rank's save through ``AsyncCheckpointIO``.

- :class:`AsyncDDPStrategy`: DDP, where each rank writes a disjoint share of the replicated state.
- :class:`AsyncModelParallelStrategy`: FSDP2 / tensor parallel, where each rank writes its own shards,
  in the layout of Lightning's ``ModelParallelStrategy``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from typing_extensions import override

from lightning_asyncckpt.format import dcp as dcp_format
from lightning_asyncckpt.format import integrity, metadata
from lightning_asyncckpt.integration import autoattach, lightning_api, loading
from lightning_asyncckpt.integration.callback import AsyncFinalizerCallback
from lightning_asyncckpt.integration.contract import StrategyCapabilities
from lightning_asyncckpt.integration.io import META_FILE, AsyncCheckpointIO, find_async_io
from lightning_asyncckpt.integration.lightning_api import CheckpointIO, DDPStrategy, ModelParallelStrategy
from lightning_asyncckpt.storage import commit, destination, paths
from lightning_asyncckpt.tiers import shares

if TYPE_CHECKING:
    import torch


class _AsyncStrategyMixin:
    """What both strategies share: an ``AsyncCheckpointIO`` by default, and a finalizer on the trainer; their
    capabilities (:class:`~lightning_asyncckpt.integration.contract.AsyncSaveStrategy`)."""

    # every rank saves: AsyncFinalizerCallback warms the worker up on every rank
    save_capabilities: ClassVar[StrategyCapabilities] = StrategyCapabilities(all_ranks_write=True)
    _checkpoint_io: CheckpointIO | None

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """The checkpoint IO given (``plugins`` or ``checkpoint_io``), else an ``AsyncCheckpointIO()`` made once."""
        if self._checkpoint_io is None:
            self._checkpoint_io = AsyncCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    def _async_io(self) -> AsyncCheckpointIO:
        io = find_async_io(self)
        if io is None:
            raise TypeError(
                f"`{type(self).__name__}` needs an `AsyncCheckpointIO` plugin; got {type(self.checkpoint_io).__name__}."
            )
        return io

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        autoattach.install(self)  # the Trainer made with this strategy gets the finalizer and the resume wrappers

    def _add_finalizer(self) -> None:
        """Every rank must finalize: add ``AsyncFinalizerCallback`` when the trainer has none (the Trainer made
        with this strategy usually has one already: :mod:`~lightning_asyncckpt.integration.autoattach`)."""
        module = getattr(self, "_lightning_module", None)
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if trainer is not None and not any(isinstance(cb, AsyncFinalizerCallback) for cb in trainer.callbacks):
            trainer.callbacks.append(AsyncFinalizerCallback())

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        self._add_finalizer()

    @contextlib.contextmanager
    def local_tier_state(self) -> Iterator[None]:
        """(all ranks, while ``AsyncFinalizerCallback`` builds a local-tier checkpoint) The state dicts as for a
        persistent save.

        Returns:
            A context manager for the build of one local-tier checkpoint."""
        yield


class AsyncDDPStrategy(_AsyncStrategyMixin, DDPStrategy):
    """A drop-in :class:`~lightning.pytorch.strategies.DDPStrategy` whose saves are written by all ranks.

    The model and optimizer state are replicated under DDP. Instead of rank 0 writing all of it, each
    rank snapshots and writes a disjoint, size-balanced share in the background, so every byte is
    written once and the write bandwidth of every rank is used. The result is one checkpoint directory
    that loads on any number of ranks (and with plain ``torch.distributed.checkpoint``).

    Uses the ``AsyncCheckpointIO`` given in ``plugins`` (or ``checkpoint_io``), else ``AsyncCheckpointIO()``.
    ``save_checkpoint`` runs on every rank (Lightning calls it on all of them); ``remove_checkpoint`` on
    global rank 0; finalization through ``AsyncFinalizerCallback`` on every rank, added when missing.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, object], filepath: Path | str,
                        storage_options: object | None = None) -> None:
        """(all ranks) Each rank schedules the write of its share; returns once the snapshot is taken.

        Args:
            checkpoint: the checkpoint Lightning built, the same on every rank.
            filepath: the checkpoint directory, the same on every rank (local or an fsspec URL).
            storage_options: passed on to the write (fsspec's options for a URL)."""
        self._async_io().save_checkpoint_distributed(checkpoint, filepath, storage_options)


class AsyncModelParallelStrategy(_AsyncStrategyMixin, ModelParallelStrategy):
    """A drop-in :class:`~lightning.pytorch.strategies.ModelParallelStrategy` (FSDP2, tensor parallel) whose
    distributed checkpoints are written in the background by every rank.

    Each rank snapshots its own shards (the local parts of the ``DTensor`` state, never gathered) and
    its share of the replicated values, and returns to training; its worker writes them. Global rank 0
    also writes the non-tensor state to ``meta.pt``. The directory has the same layout as the stock
    strategy's (DCP shards, ``.metadata``, ``meta.pt``), so stock Lightning resumes from it and plain
    ``torch.distributed.checkpoint`` reads it; it appears at its final path only once complete.

    Same arguments as ``ModelParallelStrategy``, plus ``checkpoint_io`` (else the ``AsyncCheckpointIO`` in
    the trainer's ``plugins``, else ``AsyncCheckpointIO()``). With ``save_distributed_checkpoint=False`` the
    full state is gathered on rank 0, as in the stock strategy, and rank 0 writes it in the background.

    Calls: ``save_checkpoint`` and ``load_checkpoint`` on every rank (Lightning does); ``teardown`` on every
    rank settles pending saves and stops the workers (the stock strategy never tears its IO down).
    """

    # saves its own state layout: AsyncFinalizerCallback does not pre-stage
    save_capabilities: ClassVar[StrategyCapabilities] = StrategyCapabilities(all_ranks_write=True, own_state_layout=True)

    def __init__(self, *args: object, checkpoint_io: CheckpointIO | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._checkpoint_io = checkpoint_io
        self._sharded_for_local_tier = False

    @contextlib.contextmanager
    @override
    def local_tier_state(self) -> Iterator[None]:
        """(all ranks, while ``AsyncFinalizerCallback`` builds a local-tier checkpoint) The model's and the
        optimizers' states are each rank's own shards, even with ``save_distributed_checkpoint=False``: the
        local tier keeps every rank's shards, never a full state gathered on rank 0 (which the other ranks
        would not hold).

        Returns:
            A context manager for the build of one local-tier checkpoint."""
        self._sharded_for_local_tier = True
        try:
            yield
        finally:
            self._sharded_for_local_tier = False

    def _sharded(self) -> bool:
        return self._save_distributed_checkpoint or self._sharded_for_local_tier

    @override
    def lightning_module_state_dict(self) -> dict[str, object]:
        """The sharded model state, left on its device: the stager copies it into reused (pinned) host buffers
        instead of the stock strategy's synchronous CPU offload.

        Returns:
            The model's state dict (``DTensor`` values when sharded), as the stock strategy's."""
        if not self._sharded():
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.model is not None
        return get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=False))

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, object]:
        """(all ranks, when Lightning builds a checkpoint) The optimizer's sharded state, left on its device
        for the stager (``cpu_offload=False``).

        Args:
            optimizer: one of the strategy's optimizers (a ``LightningOptimizer`` counts as the one it wraps).

        Returns:
            Its state dict, as the stock strategy's."""
        if not self._sharded():
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        assert self.model is not None
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        return get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(cpu_offload=False))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Path | str,
                        storage_options: object | None = None) -> None:
        """(all ranks) Each rank schedules the write of its shards; returns once the snapshot is taken.

        Args:
            checkpoint: the checkpoint Lightning built (``state_dict`` and ``optimizer_states`` sharded).
            filepath: the checkpoint directory (global rank 0's is used on every rank).
            storage_options: refused unless None (``TypeError``)."""
        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported;"
                f" got {storage_options!r}."
            )
        if not self._save_distributed_checkpoint:
            # full state on rank 0 (gathered by the stock strategy); rank 0 writes it through the plugin
            super().save_checkpoint(checkpoint, filepath)
            return
        path = paths.checkpoint_path(self.broadcast(filepath))  # every rank writes into the same directory
        state = {"state_dict": checkpoint["state_dict"]}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.get("optimizer_states", []))})
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self._async_io().save_checkpoint_sharded(state, path, meta)

    @override
    def load_checkpoint(self, checkpoint_path: Path | str, weights_only: bool | None = None) -> dict[str, Any]:
        """(all ranks) Settles pending saves, then loads a sharded checkpoint (this package's or stock
        Lightning's, written on any number of ranks) or a full one.

        Args:
            checkpoint_path: the checkpoint (global rank 0's is used on every rank), local or an fsspec URL.
            weights_only: as ``torch.load``'s (None: torch's default).

        Returns:
            The rest of the checkpoint, the model and optimizers loaded in place, as the stock strategy's."""
        io = self._async_io()
        io.session.finalize(blocking=True)  # every pending save committed or raised first
        restored = io.session.take_restored(checkpoint_path)
        if restored is not None:  # the local tier's recovery fetched this rank's shards (tier_resume)
            return self._load_tier(restored)
        where = destination.of(self.broadcast(checkpoint_path))
        with where.localize() as local:  # an object store's: every rank reads from its own local copy
            return self._load_local(io, local, weights_only)

    def _load_local(self, io: AsyncCheckpointIO, path: Path, weights_only: bool | None) -> dict[str, Any]:
        if path.is_dir() and commit.is_committed(path):
            # refuses a .metadata that would run code, before stock unpickles it
            md = metadata.read_metadata(path, allow_pickle=weights_only is False)
            if not (path / META_FILE).is_file():
                return self._load_full(io, path, weights_only)  # a full checkpoint written by AsyncCheckpointIO
            assert self.lightning_module is not None  # each rank checks the CRC32 of the items it reads, once
            state = {"state_dict": self.model, **{f"optimizer_{i}": o for i, o in enumerate(self.optimizers)}}
            return loading.load_sharded(path, state, self.lightning_module.strict_loading, weights_only,
                                        io.verify_on_load, md)
        elif path.exists() and not path.is_dir():
            integrity.check_file(path, crc=io.verify_on_load)
        return self._load_stock(path, weights_only)

    def _load_stock(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """(all ranks) The stock strategy's ``load_checkpoint`` without its broadcast of the path from rank 0:
        ``path`` may be this rank's own local copy of a remote checkpoint, and rank 0's copy is on another
        node's disk, or already removed when rank 0's load returns (each rank reads ``meta.pt`` alone)."""
        _load_checkpoint = lightning_api.fabric_module("strategies.model_parallel")._load_checkpoint

        assert self.lightning_module is not None
        state = {"state_dict": self.model, **{f"optimizer_{i}": o for i, o in enumerate(self.optimizers)}}
        return _load_checkpoint(path=path, state=state, strict=self.lightning_module.strict_loading,
                                optimizer_states_from_list=True, weights_only=weights_only)

    def _load_tier(self, state: dict[str, object]) -> dict[str, Any]:
        """(all ranks) Loads this rank's own shards from the local tier into the model and optimizers, each
        ``DTensor`` rebuilt on the model's mesh; returns the rest of the checkpoint, as the stock load does."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None and self.lightning_module is not None
        checkpoint = shares.rebuild(state, shares.meshes_of(self.model), self.root_device)
        options = StateDictOptions(strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=options)
        for optimizer, saved in zip(self.optimizers, checkpoint.pop("optimizer_states", [])):
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=saved, options=options)
        return checkpoint

    def _load_full(self, io: AsyncCheckpointIO, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """The stock strategy's loading of a full (unsharded) checkpoint, for this package's directories."""
        model_parallel = lightning_api.fabric_module("strategies.model_parallel")
        _load_raw_module_state = model_parallel._load_raw_module_state
        _rekey_optimizer_state_if_needed = model_parallel._rekey_optimizer_state_if_needed
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        checkpoint = dcp_format.load(path, weights_only=weights_only, verify=io.verify_on_load)
        _load_raw_module_state(checkpoint.pop("state_dict"), self.model, world_size=self.world_size, strict=strict)
        options = StateDictOptions(broadcast_from_rank0=True, full_state_dict=True, strict=strict)
        for idx, optimizer in enumerate(self.optimizers):
            state = _rekey_optimizer_state_if_needed(checkpoint["optimizer_states"][idx], self.model)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state, options=options)
        return checkpoint

    @override
    def teardown(self) -> None:
        """(all ranks; Lightning calls it at the end of fit, validate and test) Commits or fails every
        pending save and stops the workers (the stock strategy never tears its checkpoint IO down), then
        tears the strategy down."""
        try:
            self.checkpoint_io.teardown()
        finally:
            super().teardown()
