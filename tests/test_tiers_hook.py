"""The local tier as a component the plugin drives (:mod:`lightning_asyncckpt.tiers.hook`): made by
``open_tier``, attached to ``AsyncCheckpointIO``, saved at step boundaries through ``step_end`` and
restored at resume through ``latest`` and the plugin's ``load_checkpoint`` (one process, real files)."""

from __future__ import annotations

import pytest
import torch

from lightning_asyncckpt import AsyncCheckpointIO, LocalTier
from lightning_asyncckpt.tiers.hook import LocalTierHook
from lightning_asyncckpt.tiers.setup import open_tier


def _state(step: int) -> dict:
    return {"state_dict": {"w": torch.full((256,), float(step))}, "global_step": step}


def test_step_end_saves_every_n_steps_and_a_later_run_restores_the_newest(tmp_path):
    """Every ``every_n_train_steps``: saved; before the first save, only the files made (from ``like``, not
    the checkpoint); the next start of the run restores the newest step, once."""
    tier = LocalTier(tmp_path, every_n_train_steps=2, replication_factor=1, emergency_signals=())
    run = open_tier(tier, node_rank=0, local_world_size=1)
    built, sized, saved = [], [], []
    try:
        assert isinstance(run, LocalTierHook)
        for step in range(1, 6):
            end = run.step_end(step, lambda s=step: built.append(s) or _state(s),
                               lambda s=step: sized.append(s) or _state(s))
            saved.append(end.saved)
            assert not end.preempted and not end.replicated
        assert run.finish() == 4
    finally:
        run.close()
    assert saved == [False, True, False, True, False]
    assert built == [2, 4] and sized == [1]  # the checkpoint built only for a save

    again = open_tier(tier, node_rank=0, local_world_size=1)
    try:
        key = again.latest(None)
        restored = again.take(key)
        assert restored is not None and restored["global_step"] == 4
        assert torch.equal(restored["state_dict"]["w"], _state(4)["state_dict"]["w"])
        assert again.take(key) is None  # handed over once
    finally:
        again.close()


def test_the_plugin_loads_what_its_attached_tier_restored_and_nothing_assigns_the_tier(tmp_path):
    """``attach_tier``/``detach_tier`` are the only way in and out: ``io.session.tier`` cannot be assigned, a second
    tier is refused while one is attached, and ``load_checkpoint`` of the restore's key gives the checkpoint
    the attached tier fetched."""
    tier = LocalTier(tmp_path, every_n_train_steps=1, replication_factor=1, emergency_signals=())
    run = open_tier(tier, node_rank=0, local_world_size=1)
    try:
        run.step_end(3, lambda: _state(3), lambda: _state(3))
        assert run.finish() == 3
    finally:
        run.close()

    io = AsyncCheckpointIO(local=tier)
    assert io.session.tier is None
    with pytest.raises(AttributeError):
        io.session.tier = run
    again = open_tier(tier, node_rank=0, local_world_size=1)
    try:
        io.session.attach_tier(again)
        assert io.session.tier is again
        with pytest.raises(RuntimeError, match="a local tier is attached already"):
            io.session.attach_tier(run)
        key = again.latest(None)
        assert io.load_checkpoint(key)["global_step"] == 3
        assert io.session.detach_tier() is again and io.session.tier is None
    finally:
        again.close()
