"""The local tier in the Lightning Trainer: started at setup, agreed on and saved at every step's end,
and consulted by ``ckpt_path="last"`` (:mod:`lightning_asyncckpt.integration.tier_resume`).

``AsyncFinalizerCallback`` calls these on every rank; nothing here is a hook of its own. The tier is made
by :func:`~lightning_asyncckpt.tiers.setup.open_tier`, attached to the plugin (``io.session.attach_tier``) and driven
through :class:`~lightning_asyncckpt.tiers.hook.LocalTierHook`; :func:`stop` detaches it.

One save path to either tier: the checkpoint a local save holds is the one ``ModelCheckpoint`` would save
(:func:`~lightning_asyncckpt.integration.lightning_api.dump_checkpoint`), built here while
:func:`building_local_checkpoint` is True, so that ``AsyncFinalizerCallback.on_save_checkpoint`` does not
count it as a persistent save.
"""

from __future__ import annotations

import contextvars
import logging
import signal
from typing import TYPE_CHECKING

from lightning_asyncckpt.integration import contract, lightning_api, replaced_handlers
from lightning_asyncckpt.tiers.cliques import TierConfigError
from lightning_asyncckpt.tiers.hook import LocalTierHook
from lightning_asyncckpt.tiers.setup import open_tier

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_asyncckpt.integration.io import AsyncCheckpointIO

log = logging.getLogger(__name__)

_BUILDING_LOCAL = contextvars.ContextVar("building_local_checkpoint", default=False)


def start(trainer: Trainer, io: AsyncCheckpointIO | None) -> LocalTierHook | None:
    """(all ranks, at setup, once the process group exists) Makes the run's local tier (collective: its
    groups and setup checks) and attaches it to ``io``, unless there is none or one is attached already."""
    if io is None or io.local is None:
        return None
    _refuse_stock_sharded(trainer.strategy)
    if io.session.tier is None:
        io.session.attach_tier(open_tier(io.local, node_rank=trainer.node_rank, local_world_size=trainer.num_devices))
    return io.session.tier


def _refuse_stock_sharded(strategy: object) -> None:
    """(every rank alike, before anything collective) A strategy that loads its checkpoints without the plugin
    (Lightning's own ``ModelParallelStrategy``, ``FSDPStrategy``, ``DeepSpeedStrategy``) could save to the
    local tier but never resume from it: refused, with the strategy to use."""
    if contract.capabilities_of(strategy).own_state_layout:  # AsyncModelParallelStrategy
        return
    strategies = lightning_api.trainer_module("strategies")
    stock = tuple(getattr(strategies, name) for name in ("ModelParallelStrategy", "FSDPStrategy", "DeepSpeedStrategy")
                  if hasattr(strategies, name))
    if isinstance(strategy, stock):
        raise TierConfigError(
            f"AsyncCheckpointIO(local=LocalTier(...)) with `{type(strategy).__name__}`: that strategy saves and"
            " loads its sharded checkpoints without the plugin, so it could never resume from the local tier."
            " Fix: for FSDP2 or tensor parallelism use `lightning_asyncckpt.AsyncModelParallelStrategy(...)`"
            " (the same arguments as `ModelParallelStrategy`); FSDP1 and DeepSpeed are not covered.")


def arm(trainer: Trainer, io: AsyncCheckpointIO | None) -> None:
    """(all ranks, at the start of training: after Lightning has installed its signal handlers) Lets a
    preemption signal request an emergency save. Under Lightning's SLURM auto-requeue, its requeue signal is
    passed on to Lightning's handler after that save (:func:`step_end`), so the job is still requeued; so is
    any signal to the user's own handler (:mod:`~lightning_asyncckpt.integration.replaced_handlers`)."""
    if io is not None and io.session.tier is not None:
        io.session.tier.arm(pass_on=_slurm_requeue_signal(trainer))


def _slurm_requeue_signal(trainer: Trainer) -> tuple[str, ...]:
    from lightning_asyncckpt.integration.lightning_api import fabric_module

    # the environment Lightning's signal connector reads when it decides to install its requeue handler
    env = getattr(getattr(trainer, "_accelerator_connector", None), "cluster_environment", None)
    slurm = fabric_module("plugins.environments").SLURMEnvironment
    if isinstance(env, slurm) and getattr(env, "auto_requeue", False):
        sig = signal.Signals(env.requeue_signal)
        # Lightning installs none where the user has a handler for that signal: that one is the user's own
        if replaced_handlers.is_lightnings_requeue(signal.getsignal(sig)):
            return (sig.name,)
    return ()


def building_local_checkpoint() -> bool:
    """(the training thread) Whether the checkpoint being built now is a local-tier save's (not counted as a
    persistent save by ``AsyncFinalizerCallback.on_save_checkpoint``)."""
    return _BUILDING_LOCAL.get()


def _dump(trainer: Trainer) -> dict[str, object]:
    """(all ranks) The checkpoint ``ModelCheckpoint`` would save now, for the local tier."""
    token = _BUILDING_LOCAL.set(True)
    try:
        return lightning_api.dump_checkpoint(trainer)
    finally:
        _BUILDING_LOCAL.reset(token)


def _like(trainer: Trainer) -> dict[str, object]:
    """The states that make up nearly all of a checkpoint's bytes: sizes the first save's files without
    :func:`_dump`, which would run the user's ``on_save_checkpoint``."""
    return {"state_dict": trainer.lightning_module.state_dict(),
            "optimizer_states": [trainer.strategy.optimizer_state(o) for o in trainer.optimizers]}


def step_end(trainer: Trainer, io: AsyncCheckpointIO) -> bool:
    """(all ranks, after every training batch) Agrees on the step boundary, saves to the local tier when
    one is due (the checkpoint as ``ModelCheckpoint`` would build it), and on a preemption request saves
    now, waits for the copies and their replicas, and stops training. Returns True then."""
    tier = io.session.tier
    # snapshot="lazy": the optimizers' tensors copied while the next forward and backward run
    end = tier.step_end(trainer.global_step, lambda: _dump(trainer), lambda: _like(trainer),
                        lazy=io.session.lazy_rule(), hook=io.copy_hook)
    if not end.preempted:
        return False
    trainer.should_stop = True  # Lightning's own way to end fit after this batch (its public attribute)
    if tier.preemption_signal is not None:
        log.warning("lightning-asyncckpt: global rank %d received %s", trainer.global_rank, tier.preemption_signal)
    if trainer.is_global_zero:
        log.warning("lightning-asyncckpt: preemption requested: step %d is in the local tier%s; stopping training",
                    end.complete, " with its replicas" if end.replicated else "")
    replaced_handlers.pass_on(tier, end.handlers_everywhere)
    return True


def stop(io: AsyncCheckpointIO | None, wait: bool = True) -> None:
    """(all ranks, at the end of fit; ``wait=False`` on an exception, where a peer may be gone) Detaches the
    run's tier from ``io``, waits for the local save in flight and agrees on it (raising a failed one), and
    closes it: gives the signals back and releases its lock."""
    tier = io.session.detach_tier() if io is not None else None
    if tier is not None:
        try:
            if wait:  # the last local save complete everywhere, and the steps before it removed
                tier.finish()
        finally:
            tier.close(wait)
