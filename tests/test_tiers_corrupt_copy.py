"""A copy that fails its CRC32 check, while its clique holds another good one: the restore leaves the bad
copy out and tries again, resumes at the same local step from the good copy, exactly, and the good copy
replaces the bad one. Two real processes of one gloo group, each rank its own "node" directory, both
nodes whole: only the bytes of one copy are wrong (a bit flip in node-local memory or on its disk)."""

from __future__ import annotations

import pytest
import torch

from helpers import log_lines
from lightning_asyncckpt import LocalTier
from lightning_asyncckpt.testing import local_tier
from processes import two_nodes

pytestmark = [pytest.mark.timeout(180)]


def _state(rank, layout):
    if layout == "sharded":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        w = distribute_tensor(torch.arange(100_000, dtype=torch.float32), init_device_mesh("cpu", (2,)), [Shard(0)])
        return {"w": w, "global_step": 2}
    gen = torch.Generator().manual_seed(0)
    return {"state_dict": {f"w{i}": torch.rand(5000 + i, generator=gen) for i in range(4)}, "global_step": 2}


def _plain(state):
    """The tensors of a state as plain, owned tensors (a DTensor, or a restored sharded share: this rank's
    shard)."""
    out = {}
    for k, v in (state.get("state_dict") or state).items():
        v = v.to_local() if hasattr(v, "to_local") else getattr(v, "local", v)
        if isinstance(v, torch.Tensor):
            out[k] = v.clone()
    return out


def _restore(tier, rank):
    """A new run's restore: the tensors it restored (None: it fell back) and the log lines."""
    from lightning_asyncckpt.tiers.setup import open_tier

    with log_lines() as lines:
        run = open_tier(tier, node_rank=rank, local_world_size=1)
        try:
            restored = run.take(run.latest(None))
            got = _plain(restored) if restored is not None else None
            run.finish()  # the first boundary: replicas a sharded restore left for later are sent here
        finally:
            run.close()
    return got, lines


def _own_copy_corrupt_rank(rank, root, layout):
    """Step 2 saved with replicas; then one byte of rank 1's own copy of its share flips. Both ranks
    restore (rank 1's copy fails, node 0's replica of it does not), then restore once more."""
    import torch.distributed as dist

    from lightning_asyncckpt.tiers.setup import open_tier

    state = _state(rank, layout)
    tier = LocalTier(f"{root}/node{rank}", replication_factor=2, timeout_s=60, emergency_signals=())
    run = open_tier(tier, node_rank=rank, local_world_size=1)
    run.save(2, state)
    assert run.finish() == 2
    run.close()
    if rank == 1:
        local_tier.corrupt_share(f"{root}/node1", owner=1, step=2)
    dist.barrier()
    first = _restore(tier, rank)
    dist.barrier()
    return _plain(state), first, _restore(tier, rank)


def _rank(layout):
    return lambda rank, root: _own_copy_corrupt_rank(rank, root, layout)


@pytest.mark.parametrize("layout", ["sharded", "replicated"])
def test_a_corrupt_copy_is_left_out_and_the_step_restored_from_the_good_one_which_replaces_it(tmp_path, layout):
    pytest.importorskip("nvidia_resiliency_ext")
    got = two_nodes(_rank(layout), tmp_path)
    for rank in (0, 1):
        live, (restored, lines), (again, lines_again) = got[rank]
        assert restored is not None, f"rank {rank} fell back: {lines}"
        assert restored.keys() == live.keys() and all(torch.equal(restored[k], live[k]) for k in live), rank
        assert again is not None and all(torch.equal(again[k], live[k]) for k in live), lines_again
    log = " | ".join(got[0][1][1])
    assert ("local tier: step 2 failed its checks: rank 1's share in the copy held by rank 1 has CRC32" in log
            and "trying again without rank 1's copy of rank 1's share" in log
            and "resuming from the local tier at step 2" in log), log
    # the good copy replaced the bad one: the next restore finds every copy good at once
    assert not any("failed its checks" in line for line in got[0][2][1]), got[0][2][1]
    mine = tmp_path / "node1/asyncckpt-local/default/holder-1/step-0000000002.owner-1.pt"
    replica = tmp_path / "node0/asyncckpt-local/default/holder-0/step-0000000002.owner-1.pt"
    assert mine.read_bytes() == replica.read_bytes()
