"""A sharded (DTensor) state restored after a node loss, across two real processes (one gloo group, each
rank its own "node" directory): the node back empty receives only its own share before it resumes; the
replica it holds for its peer follows in the background from the first step boundary on, and then protects
against the next loss."""

from __future__ import annotations

import pytest
import torch

from helpers import log_lines
from lightning_asyncckpt import LocalTier
from lightning_asyncckpt.testing import local_tier
from processes import two_nodes, two_ranks


def _lose(root, node):
    import shutil

    shutil.rmtree(f"{root}/node{node}/asyncckpt-local")


def _restore(tier, rank):
    """A new run's restore on this rank: the checkpoint's local shard, the log lines, what it holds after."""
    from lightning_asyncckpt.tiers.setup import open_tier

    with log_lines() as lines:
        run = open_tier(tier, node_rank=rank, local_world_size=1)
        try:
            restored = run.take(run.latest(None))
            held_at_resume = sorted((h.step, h.owner) for h in run.store.holdings(run.topology))
            local = restored["w"].local.clone() if restored is not None else None
            if restored is not None:  # training changes what the checkpoint's views hold before the first boundary
                restored["w"].local.add_(1.0)
            run.finish()  # the first boundary: the replicas left for later are sent, and waited for here
            held = sorted((h.step, h.owner) for h in run.store.holdings(run.topology))
        finally:
            run.close()
    return local, lines, held, held_at_resume


def _saved_step_2(rank, root):
    """A sharded weight over both ranks, saved at step 2 with its replicas; returns it and the tier's config."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_asyncckpt.tiers.setup import open_tier

    w = distribute_tensor(torch.arange(100_000, dtype=torch.float32), init_device_mesh("cpu", (2,)), [Shard(0)])
    tier = LocalTier(f"{root}/node{rank}", replication_factor=2, timeout_s=60, emergency_signals=())
    run = open_tier(tier, node_rank=rank, local_world_size=1)
    run.save(2, {"w": w, "global_step": 2})
    assert run.finish() == 2
    run.close()
    return w, tier


def _restore_lose_restore(tier, rank, root, node):
    """Both ranks restore; then ``node`` loses its local directory, and both restore again."""
    import torch.distributed as dist

    dist.barrier()
    first = _restore(tier, rank)
    dist.barrier()
    if rank == node:
        _lose(root, node)
    dist.barrier()
    return first, _restore(tier, rank)


def _node_lost_twice_rank(rank, root):
    """Step 2 saved with replicas; node 1 comes back empty and resumes; then node 0 is lost before any new
    save: step 2 is still restorable, from the replica node 1 received after its resume."""
    w, tier = _saved_step_2(rank, root)
    if rank == 1:
        _lose(root, 1)
    return (w.to_local().clone(), *_restore_lose_restore(tier, rank, root, node=0))


@pytest.mark.timeout(180)
def test_a_node_back_empty_receives_only_its_own_share_first_and_the_replica_after(tmp_path):
    pytest.importorskip("nvidia_resiliency_ext")
    got = two_nodes(_node_lost_twice_rank, tmp_path)
    for rank in (0, 1):
        live, first, second = got[rank]
        assert first[0] is not None and second[0] is not None, f"rank {rank} fell back: {first[1]} {second[1]}"
        assert torch.equal(first[0], live) and torch.equal(second[0], live), f"rank {rank} restored other bytes"
        assert first[2] == [(2, 0), (2, 1)], f"rank {rank} holds {first[2]} after the first restore"
    # at the resume, before its first boundary, node 1 holds its own share only
    assert got[1][1][3] == [(2, 1)], got[1][1][3]
    # rank 1's own share on the critical path; rank 0's replica sent after, while training would resume
    assert any("1 share(s) sent between ranks" in line and "1 replica(s) sent after" in line
               for line in got[0][1][1]), got[0][1][1]
    # node 0 lost next: its share comes back from the replica that node 1 received after the first restore
    assert any("resuming from the local tier at step 2" in line for line in got[0][2][1]), got[0][2][1]


def _unused_replica_corrupt_rank(rank, root):
    """Step 2 saved with replicas; rank 0's replica of rank 1's share is then corrupted (one byte). With both
    nodes whole, no rank uses that replica, so both restore step 2 from their own shares. Then node 1 is
    lost: now the replica is sent to rank 1, fails its check on arrival, and both fall back."""
    w, tier = _saved_step_2(rank, root)
    if rank == 0:  # while this job runs: a bit flip in memory, under the tier
        local_tier.corrupt_share(f"{root}/node0", owner=1, step=2)
    return (w.to_local().clone(), *_restore_lose_restore(tier, rank, root, node=1))


@pytest.mark.timeout(180)
def test_a_corrupt_replica_is_checked_when_a_restore_uses_it_and_only_then(tmp_path):
    pytest.importorskip("nvidia_resiliency_ext")
    got = two_nodes(_unused_replica_corrupt_rank, tmp_path)
    for rank in (0, 1):
        live, whole, node1_lost = got[rank]
        assert whole[0] is not None and torch.equal(whole[0], live), f"rank {rank} fell back: {whole[1]}"
        assert node1_lost[0] is None, f"rank {rank} restored from the corrupt replica: {node1_lost[1]}"
    why = " ".join(got[0][2][1])
    assert "step 2 failed its checks: rank 1's share in the copy sent by rank 0 has CRC32" in why, why


def _room_for_one_share_rank(rank, root):
    """Step 2 saved with replicas; node 1 comes back empty, its directory with room for its own share (200
    kB) but not for the replica it held for rank 0: it resumes from the local tier all the same, and the
    replica it cannot hold is left out after the resume, without rank 0 waiting to send it."""
    import contextlib

    import torch.distributed as dist

    w, tier = _saved_step_2(rank, root)
    if rank == 1:
        _lose(root, 1)
        with open(f"{root}/node1/filler", "wb") as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            f.truncate(max(0, f.tell() - 320 * 1024))
    dist.barrier()
    restored = _restore(tier, rank)
    from lightning_asyncckpt.tiers.setup import open_tier

    run = open_tier(tier, node_rank=rank, local_world_size=1)  # the resumed job's first local save
    try:
        run.save(4, {"w": w, "global_step": 4})
        refused = None
    except Exception as e:  # noqa: BLE001 - its text is the test's subject
        refused = str(e)
    finally:
        run.close()
    return (w.to_local().clone(), restored, refused)


@pytest.mark.timeout(180)
def test_a_node_back_with_room_for_its_own_share_only_resumes_locally_and_leaves_the_replica_out(tmp_path,
                                                                                                  tmpfs_1m):
    pytest.importorskip("nvidia_resiliency_ext")
    (tmp_path / "node0").mkdir()
    (tmp_path / "node1").symlink_to(tmpfs_1m)
    got = two_ranks(_room_for_one_share_rank, tmp_path)
    for rank in (0, 1):
        assert isinstance(got[rank], tuple), got[rank]
        live, (local, lines, held, _held_at_resume), refused = got[rank]
        assert local is not None and torch.equal(local, live), f"rank {rank} fell back: {lines}"
        # rank 0 did not wait for a receive that was never posted (that ends in the group's timeout, logged)
        assert not any("replicas refilled after the restore failed" in line for line in lines), lines
    assert got[0][1][2] == [(2, 0), (2, 1)] and got[1][1][2] == [(2, 1)], (got[0][1][2], got[1][1][2])
    why = " ".join(got[1][1][1])
    assert "rank 1 could not reserve the replicas it is sent after the restore" in why and "No space left" in why, why
    # the first local save after the resume refuses that directory on every rank, with the sizes and the fix
    for rank in (0, 1):
        assert got[rank][2] is not None and "on node 1 has" in got[rank][2] and "Fix:" in got[rank][2], got[rank][2]
