"""``LocalTier(overlap_agreement=True)`` across two real processes (one gloo group, each rank its own "node"
directory): each step boundary posts its round and reads the previous one, so a preemption is agreed one
boundary later, on both ranks alike; ``finish`` still agrees at once, reading a posted round first."""

from __future__ import annotations

import pytest
import torch

from lightning_asyncckpt import LocalTier
from processes import two_nodes


def _overlapped_rank(rank, root):
    import os
    import signal

    from lightning_asyncckpt.tiers.setup import open_tier

    tier = LocalTier(f"{root}/node{rank}", replication_factor=2, timeout_s=60, emergency_signals=("SIGUSR1",),
                     overlap_agreement=True)
    run = open_tier(tier, node_rank=rank, local_world_size=1)
    state = {"w": torch.arange(10_000, dtype=torch.float32), "global_step": 2}
    try:
        assert run.arm()
        run.save(2, state)
        complete_at_finish = run.finish()  # agreed at once, whatever the mode
        first = run.boundary()  # nothing was posted before it: nothing agreed yet
        if rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)  # only a flag is set
        second = run.boundary()  # reads the first boundary's round: no signal in it
        third = run.boundary()  # reads the second's: rank 0's signal
        state["w"].add_(1.0)
        state["global_step"] = 4
        run.save(4, state)
        run.boundary()  # posts a round while the save may still be running
        complete_after = run.finish()  # reads that round, then agrees at once
    finally:
        run.close()
    again = open_tier(LocalTier(f"{root}/node{rank}", replication_factor=2, timeout_s=60, emergency_signals=(),
                              overlap_agreement=True), node_rank=rank, local_world_size=1)
    restored = again.take(again.latest(None))
    again.close()
    return (complete_at_finish, first.preempted, second.preempted, (third.preempted, third.everywhere),
            complete_after, restored is not None and torch.equal(restored["w"], state["w"]))


def test_an_overlapped_agreement_acts_one_boundary_later_on_every_rank_and_finish_agrees_at_once(tmp_path):
    pytest.importorskip("nvidia_resiliency_ext")
    got = two_nodes(_overlapped_rank, tmp_path)
    for rank in (0, 1):
        assert got[rank] == (2, False, False, (True, False), 4, True), (rank, got[rank])


def test_overlap_agreement_must_be_a_bool(tmp_path):
    with pytest.raises(ValueError, match=r"LocalTier\(overlap_agreement=\.\.\.\) must be True or False; got 'yes'"):
        LocalTier(tmp_path, overlap_agreement="yes")
