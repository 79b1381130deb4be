"""A sharded (FSDP2) share's replication across two real processes (one gloo group, each rank its own "node"
directory): what arrives from a clique peer is received straight into the file reserved for it, and a
rank with no room for a replica still finishes the exchange, so that every rank raises its error instead
of waiting in a broadcast."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lightning_asyncckpt import LocalTier
from processes import two_nodes, two_ranks

pytest.importorskip("nvidia_resiliency_ext")


def _landing_rank(rank, _root):
    """Each rank sends two tensors over NVRx's clique loop; the peer's land in tensors this rank made."""
    import torch.distributed as dist

    from lightning_asyncckpt.tiers.replication import LandingGroup

    given = {}

    def land(owner, index, shape, dtype):
        given[(owner, index)] = torch.full(shape, -1, dtype=dtype)
        return given[(owner, index)]

    mine = [torch.arange(3, dtype=torch.uint8) + rank, torch.full((5,), 10 + rank, dtype=torch.uint8)]
    got = LandingGroup(dist.group.WORLD, land).all_gather_batch(mine)
    peer = 1 - rank
    return (
        [[t.tolist() for t in row] for row in got],
        sorted(given) == [(peer, 0), (peer, 1)],
        all(got[peer][i] is given[(peer, i)] for i in (0, 1)),  # the very tensors land gave, filled
        got[rank][0] is mine[0] and got[rank][1] is mine[1],
    )


def test_what_a_peer_sends_is_received_into_the_tensors_land_gives(tmp_path):
    got = two_ranks(_landing_rank, tmp_path)
    for rank in (0, 1):
        assert isinstance(got[rank], tuple), got[rank]
        rows, asked_for_the_peers_only, landed, own_kept = got[rank]
        assert rows == [[[0, 1, 2], [10] * 5], [[1, 2, 3], [11] * 5]]
        assert asked_for_the_peers_only and landed and own_kept


def _full_for_the_replica_rank(rank, root):
    """Step 2 is saved with its replicas. Then rank 1's directory (a small tmpfs) is filled but for room for
    its own next share, not for rank 0's replica: the replica arrives all the same (rank 0 is in the
    broadcast), step 4 fails on both ranks with rank 1's reason, and step 2 stays complete."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_asyncckpt.errors import CheckpointWriteError
    from lightning_asyncckpt.tiers.setup import open_tier

    mesh = init_device_mesh("cpu", (2,))
    tier = LocalTier(f"{root}/node{rank}", replication_factor=2, timeout_s=600, emergency_signals=())
    run = open_tier(tier, node_rank=rank, local_world_size=1)
    run.save(2, {"w": distribute_tensor(torch.ones(2_000), mesh, [Shard(0)]), "global_step": 2})
    assert run.finish() == 2
    if rank == 1:
        with open(f"{root}/node1/filler", "wb", buffering=0) as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 4096)
            f.truncate(max(0, f.tell() - 48 * 1024))  # room for one 40 kB share and its small files, not two
    dist.barrier()
    run.save(4, {"w": distribute_tensor(torch.ones(20_000), mesh, [Shard(0)]), "global_step": 4})
    try:
        run.finish()
        outcome = "no error"
    except CheckpointWriteError as e:
        outcome = str(e)
    complete = run.finish()
    run.close(wait=False)
    return outcome, complete


def test_a_rank_without_room_for_a_replica_finishes_the_exchange_and_every_rank_raises(tmp_path, tmpfs_1m):
    (tmp_path / "node0").mkdir()
    (tmp_path / "node1").symlink_to(tmpfs_1m)
    got = two_ranks(_full_for_the_replica_rank, tmp_path)  # a rank left in a broadcast fails it at its timeout
    for rank in (0, 1):
        assert isinstance(got[rank], tuple), got[rank]
        outcome, complete = got[rank]
        assert "rank 1: LocalTierError: local save of step 4: OSError: no room for the replicas of step 4" in outcome
        assert "rank 0's replica" in outcome and "No space left" in outcome, outcome
        assert "rank 0:" not in outcome, outcome
        assert complete == 2


def _replicas_rank(rank, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_asyncckpt.tiers.setup import open_tier

    mesh = init_device_mesh("cpu", (2,))
    tier = LocalTier(f"{root}/node{rank}", replication_factor=2, timeout_s=60, emergency_signals=())
    run = open_tier(tier, node_rank=rank, local_world_size=1)
    w = distribute_tensor(torch.arange(40_000, dtype=torch.float32), mesh, [Shard(0)])
    for step in (2, 4, 6):  # from the third save on, the files are reused ones
        w.to_local().add_(step)
        run.save(step, {"w": w, "global_step": step})
        assert run.finish() == step
    run.close()
    return ()


def test_every_replica_holds_its_owners_bytes_save_after_save(tmp_path):
    two_nodes(_replicas_rank, tmp_path)
    for owner, holder in ((0, 1), (1, 0)):
        name = f"step-0000000006.owner-{owner}.pt"
        mine = tmp_path / f"node{owner}/asyncckpt-local/default/holder-{owner}" / name
        replica = tmp_path / f"node{holder}/asyncckpt-local/default/holder-{holder}" / name
        assert mine.read_bytes() == replica.read_bytes() and len(mine.read_bytes()) >= 80_000


def _empty_share_rank(rank, root):
    """One element sharded over two ranks: rank 1's share holds no tensor bytes, yet is replicated,
    committed and restored like any other."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_asyncckpt.tiers.setup import open_tier

    tier = LocalTier(f"{root}/node{rank}", replication_factor=2, timeout_s=60, emergency_signals=())
    run = open_tier(tier, node_rank=rank, local_world_size=1)
    w = distribute_tensor(torch.full((1,), 7.0), init_device_mesh("cpu", (2,)), [Shard(0)])
    run.save(2, {"w": w, "global_step": 2})
    complete = run.finish()
    run.close()
    again = open_tier(tier, node_rank=rank, local_world_size=1)
    restored = again.take(again.latest(None))
    again.close()
    return complete, None if restored is None else restored["w"].local.tolist()


def test_an_empty_share_is_replicated_and_restored(tmp_path):
    got = two_nodes(_empty_share_rank, tmp_path)
    assert got[0] == (2, [7.0]) and got[1] == (2, []), got
    name = "step-0000000002.owner-1.pt"  # rank 1's share and its replica on node 0: no bytes
    assert (tmp_path / "node1/asyncckpt-local/default/holder-1" / name).stat().st_size == 0
    assert (tmp_path / "node0/asyncckpt-local/default/holder-0" / name).stat().st_size == 0
