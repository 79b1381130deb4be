"""The local tier in a Fabric loop.

Fabric has no hooks, so the loop calls two methods, on every rank, in the same order::

    io = AsyncCheckpointIO(local=LocalTier(dir="/dev/shm/ckpt", every_n_train_steps=50))
    fabric = Fabric(..., plugins=[io]); fabric.launch()
    tiers = FabricTiers(fabric)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    tiers.resume(state, persistent="ckpts/last.ckpt")  # the newest step complete in either tier (at every start)
    while ...:
        ...; optimizer.step(); state["step"] += 1
        if tiers.step_end(state["step"], state):  # a preemption signal: saved locally, drained
            break

With ``AsyncCheckpointIO(snapshot="lazy")``, ``io.track_optimizers([optimizer])`` once and
``io.wait_for_snapshot()`` right before each ``optimizer.step()``, as for the persistent saves: the local
saves' optimizer tensors are then copied while the next forward and backward run.

A run is named by the ``persistent`` path given to :meth:`FabricTiers.resume` (its persistent destination):
``resume`` restores only local steps written by a run that gave the same path, and a loop whose first local
save comes before any ``resume`` starts a new run, whose steps an older run's never replace
(:mod:`~lightning_asyncckpt.tiers.run_identity`). So call ``resume`` at every start, the first one too, with
the same path, whether that file exists yet or not.

Strategies: a single device, DDP (``plugins=[io]``), and FSDP2 or tensor parallel with
``AsyncFabricModelParallelStrategy(..., checkpoint_io=io)`` (or ``plugins=[io]``): each rank then saves its own
``DTensor`` shards, and ``resume`` loads them back onto the model's mesh.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_asyncckpt.integration import lightning_api, replaced_handlers
from lightning_asyncckpt.integration.fabric import sharded_state
from lightning_asyncckpt.integration.io import AsyncCheckpointIO, find_async_io
from lightning_asyncckpt.tiers import run_identity
from lightning_asyncckpt.tiers.hook import LocalTierHook
from lightning_asyncckpt.tiers.setup import open_tier

if TYPE_CHECKING:
    from lightning.fabric import Fabric

log = logging.getLogger(__name__)


class FabricTiers:
    """(every rank, after ``fabric.launch()``) The local tier of ``fabric``'s ``AsyncCheckpointIO(local=...)``.
    Making it is collective (process groups, setup checks)."""

    def __init__(self, fabric: Fabric, io: AsyncCheckpointIO | None = None) -> None:
        self.fabric = fabric
        self.io = io if io is not None else find_async_io(fabric.strategy)
        if self.io is None or getattr(self.io, "local", None) is None:
            sharded = isinstance(fabric.strategy, lightning_api.FabricModelParallelStrategy)
            where = ("give `AsyncFabricModelParallelStrategy(..., checkpoint_io=AsyncCheckpointIO(local=LocalTier(...)))`"
                     " as the strategy (Fabric's own ModelParallelStrategy takes no checkpoint plugin)" if sharded
                     else "the Fabric's plugins need an AsyncCheckpointIO(local=LocalTier(...))")
            raise ValueError(f"FabricTiers(fabric): {where}; found {self.io!r}.")
        if self.io.session.tier is None:
            nodes = max(int(getattr(fabric.strategy, "num_nodes", 1) or 1), 1)
            self.io.session.attach_tier(open_tier(self.io.local, node_rank=fabric.node_rank,
                                          local_world_size=max(fabric.world_size // nodes, 1)))
        self.tier: LocalTierHook = self.io.session.tier
        self.tier.arm()

    def resume(self, state: dict[str, object], persistent: Path | str | None = None, strict: bool = True,
               weights_only: bool | None = None) -> bool:
        """(every rank, before the first :meth:`step_end`) Loads the newest step complete in the local tier, or
        ``persistent`` where that is newer or the local tier has none complete, into ``state``
        (``fabric.load``). False: nothing loaded. ``persistent`` also names the run (module docstring); a local
        path that does not exist yet is no checkpoint (the first start's). ``weights_only`` as ``fabric.load``'s:
        either checkpoint is read with it (None: stock's default).

        Args:
            state: Fabric's state (model, optimizers, other values), loaded in place.
            persistent: the persistent checkpoint the loop would resume from (it need not exist yet).
            strict: as ``fabric.load``'s.
            weights_only: as ``fabric.load``'s.

        Returns:
            True where a checkpoint was loaded."""
        self.tier.begin(run_identity.destination_of(persistent), resuming=True)
        if persistent is not None and "://" not in str(persistent) and not os.path.exists(persistent):
            persistent = None  # nothing saved there yet
        path = self.tier.latest(persistent, weights_only)
        if path is None:
            return False
        self.fabric.load(path, state, strict=strict, weights_only=weights_only)
        return True

    def step_end(self, step: int, state: dict[str, object]) -> bool:
        """(every rank, after every optimizer step) Agrees on the step boundary; saves ``state`` to the local
        tier every ``every_n_train_steps``; on a preemption signal saves now, waits for the copies, drains
        the persistent saves, runs the handler that signal had before ``FabricTiers`` (on the ranks that
        received it) and returns True (the loop should stop).

        Args:
            step: the global step just completed.
            state: Fabric's state, as for ``fabric.save``.

        Returns:
            ``True`` on a preemption, when the loop should stop; else ``False``."""
        end = self.tier.step_end(step, lambda: self._convert(state), lambda: self._convert(state),
                                 lazy=self.io.session.lazy_rule(), hook=self.io.copy_hook)
        if not end.preempted:
            return False
        self.io.finalize(blocking=True)
        if self.tier.preemption_signal is not None:
            log.warning("lightning-asyncckpt: global rank %d received %s", self.fabric.global_rank,
                        self.tier.preemption_signal)
        if self.fabric.global_rank == 0:
            log.warning("lightning-asyncckpt: preemption requested: step %d is in the local tier; stop the loop",
                        end.complete)
        replaced_handlers.pass_on(self.tier, end.handlers_everywhere)  # a handler installed before, if any
        return True

    def _convert(self, state: dict[str, object]) -> dict[str, object]:
        """``state`` as ``fabric.save`` would write it: modules and optimizers as their state dicts (FSDP2,
        tensor parallel: their sharded ones, each rank's ``DTensor`` shards, as a sharded ``fabric.save``)."""
        unwrap = lightning_api.fabric_module("wrappers")._unwrap_objects
        if isinstance(self.fabric.strategy, lightning_api.FabricModelParallelStrategy):
            converted, meta = sharded_state(unwrap(state))
            return {**converted, **meta}
        return self.fabric.strategy._convert_stateful_objects_in_state(unwrap(state), filter={})

    def close(self) -> None:
        """(every rank) Waits for the local save in flight; gives the signals back; detaches the tier from
        the plugin."""
        self.io.session.detach_tier()
        self.tier.close()
