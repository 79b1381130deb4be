"""The local tier in the Lightning Trainer: started at setup, agreed on and saved at every step's end,
and consulted by ``ckpt_path="last"`` (:mod:`lightning_asyncckpt.integration.tier_resume`).

``AsyncFinalizerCallback`` calls these on every rank; nothing here is a hook of its own.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

from lightning_asyncckpt.integration import contract, lightning_api, replaced_handlers
from lightning_asyncckpt.tiers.cliques import TierConfigError
from lightning_asyncckpt.tiers.run import TierRun

log = logging.getLogger(__name__)


def start(trainer: Any, io: Any) -> TierRun | None:
    """(all ranks, at setup, once the process group exists) Makes the run's local tier (collective: its
    groups and setup checks), unless there is none or it exists already."""
    if io is None or io.local is None:
        return None
    _refuse_stock_sharded(trainer.strategy)
    if io.session.tier is None:
        io.session.attach_tier(TierRun(io.local, node_rank=trainer.node_rank, local_world_size=trainer.num_devices))
    return io.session.tier


def _refuse_stock_sharded(strategy: Any) -> None:
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


def arm(trainer: Any, io: Any) -> None:
    """(all ranks, at the start of training: after Lightning has installed its signal handlers) Lets a
    preemption signal request an emergency save. Under Lightning's SLURM auto-requeue, its requeue signal is
    passed on to Lightning's handler after that save (:func:`step_end`), so the job is still requeued; so is
    any signal to the user's own handler (:mod:`~lightning_asyncckpt.integration.replaced_handlers`)."""
    if io is not None and io.session.tier is not None:
        io.session.tier.arm(pass_on=_slurm_requeue_signal(trainer))


def _slurm_requeue_signal(trainer: Any) -> tuple[str, ...]:
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


def step_end(trainer: Any, io: Any, dump: Callable[[], dict[str, Any]]) -> bool:
    """(all ranks, after every training batch) Agrees on the step boundary, saves to the local tier when
    one is due (``dump`` builds the checkpoint as ``ModelCheckpoint`` would), and on a preemption request
    saves now, waits for the copies and their replicas, and stops training. Returns True then."""
    tier = io.session.tier
    boundary = tier.boundary()
    step = trainer.global_step
    due = step > 0 and step % io.local.every_n_train_steps == 0
    if (due or boundary.preempted) and step != tier.saved_step:
        # snapshot="lazy": the optimizers' tensors copied while the next forward and backward run
        tier.save(step, dump(), lazy=io.session.lazy_rule(), hook=io.copy_hook)
    elif step > 0 and tier.wants_files:  # the first save's files, made while the next steps run; sized from
        # the states that make up nearly all its bytes, not dump(), which would run the user's on_save_checkpoint
        tier.prepare({"state_dict": trainer.lightning_module.state_dict(),
                      "optimizer_states": [trainer.strategy.optimizer_state(o) for o in trainer.optimizers]})
    if not boundary.preempted:
        return False
    complete = tier.finish()
    trainer.should_stop = True
    if tier.preemption_signal is not None:
        log.warning("lightning-asyncckpt: global rank %d received %s", trainer.global_rank, tier.preemption_signal)
    if trainer.is_global_zero:
        log.warning("lightning-asyncckpt: preemption requested: step %d is in the local tier%s; stopping training",
                    complete, " with its replicas" if tier.factor > 1 else "")
    replaced_handlers.pass_on(tier, boundary.handlers_everywhere)
    return True


def stop(io: Any, wait: bool = True) -> None:
    """(all ranks, at the end of fit; ``wait=False`` on an exception, where a peer may be gone) Waits for
    the local save in flight and agrees on it (raising a failed one), gives the signals back and forgets
    the run's tier."""
    if io is not None and io.session.tier is not None:
        try:
            if wait:  # the last local save complete everywhere, and the steps before it removed
                io.session.tier.finish()
        finally:
            io.session.tier.close(wait)
            io.session.detach_tier()
