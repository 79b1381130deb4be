"""The local tier across two real processes (one gloo group, each rank its own "node" directory): setup
checks agreed on by both ranks, replicas of a replicated state, and failures on one rank that every rank
must learn of at once (a full directory while saving, or while refilling a node at recovery)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lightning_asyncckpt import LocalTier
from processes import two_nodes, two_ranks


@pytest.fixture
def small_node1(tmpfs_1m, tmp_path):
    """Two nodes' directories, ``node0`` and ``node1``, under ``tmp_path``: node 1's is the small tmpfs."""
    (tmp_path / "node0").mkdir()
    (tmp_path / "node1").symlink_to(tmpfs_1m)
    return tmp_path


def _shared_dir_rank(rank, path):
    from lightning_asyncckpt.tiers.setup import open_tier

    open_tier(LocalTier(path, replication_factor=2, timeout_s=30, emergency_signals=()), node_rank=rank,
              local_world_size=1)


def test_a_directory_shared_between_nodes_is_refused_on_every_rank(tmp_path):
    """Two real processes that say they are on nodes 0 and 1 but share one directory: both refuse it."""
    got = two_ranks(_shared_dir_rank, tmp_path)
    for rank in (0, 1):
        assert got[rank] and "TierConfigError" in got[rank] and "is shared between nodes" in got[rank], got[rank]
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # the probes are gone


def _default_factor_rank(rank, root):
    """Without ``replication_factor``: two ranks of one node, the same with ``replication_jump=1`` (which
    does not say how many nodes there are), then the same two as two nodes. Then two nodes with
    ``replication_jump=2``, which would put a clique's ranks two nodes apart in a job of two: refused."""
    from lightning_asyncckpt.tiers.cliques import TierConfigError
    from lightning_asyncckpt.tiers.setup import open_tier

    got = []
    for node_rank, per_node, jump in ((0, 2, None), (0, 2, 1), (rank, 1, None), (rank, 1, 2)):
        tier = LocalTier(f"{root}/node{node_rank}", replication_jump=jump, timeout_s=30, emergency_signals=())
        try:
            run = open_tier(tier, node_rank=node_rank, local_world_size=per_node)
        except TierConfigError as e:
            got.append(str(e))
            continue
        got.append((run.factor, run.clique))
        run.close()
    return tuple(got)


def test_without_a_factor_one_node_keeps_no_replica_and_two_nodes_keep_one(tmp_path):
    """The same script on a workstation and on a cluster: the default factor follows the job's nodes (as
    the node ranks say, whatever ``replication_jump`` is)."""
    got = two_nodes(_default_factor_rank, tmp_path)
    for rank in (0, 1):
        assert got[rank][:3] == ((1, [rank]), (1, [rank]), (2, [0, 1])), got
        assert "world size 2 does not divide by replication_jump x replication_factor = 2 x 2" in got[rank][3], got
        assert "one node" not in got[rank][3], got

def _replicas_rank(rank, root):
    """Two ranks on two "nodes" (each its own directory), a DDP-like state of which one tensor differs
    between the ranks: each rank copies both shares from its own memory; the replica of the differing one
    is repaired (sent by its owner). Then both ranks restore from their own directories."""
    from lightning_asyncckpt.tiers.setup import open_tier

    gen = torch.Generator().manual_seed(0)
    state = {"state_dict": {f"w{i}": torch.rand(1000 + i, generator=gen) for i in range(6)}, "global_step": 2}
    state["state_dict"]["running_mean"] = torch.full((500,), float(rank))  # not replicated bit for bit
    tier = LocalTier(f"{root}/node{rank}", replication_factor=2, timeout_s=60, emergency_signals=())
    run = open_tier(tier, node_rank=rank, local_world_size=1)
    run.save(2, state)
    assert run.finish() == 2
    repaired = run.writer.repaired
    run.close()
    again = open_tier(tier, node_rank=rank, local_world_size=1)
    key = again.latest(None)
    restored = again.take(key)
    assert restored is not None, "the local tier did not restore (see the log line: a check failed)"
    again.close()
    return (repaired, {k: v.clone() for k, v in restored["state_dict"].items()},
            {k: v.clone() for k, v in state["state_dict"].items()})


def test_replicas_of_a_replicated_state_are_copied_locally_and_hold_their_owners_bytes(tmp_path):
    got = two_nodes(_replicas_rank, tmp_path)
    # every replica file holds exactly its owner's bytes
    for owner, holder in ((0, 1), (1, 0)):
        name = f"step-0000000002.owner-{owner}.pt"
        mine = tmp_path / f"node{owner}/asyncckpt-local/default/holder-{owner}" / name
        replica = tmp_path / f"node{holder}/asyncckpt-local/default/holder-{holder}" / name
        assert mine.read_bytes() == replica.read_bytes()
    (repaired0, restored0, live0), (repaired1, restored1, live1) = got[0], got[1]
    assert repaired0 == repaired1 == 1  # only the share with running_mean was sent
    # both ranks restored the same state, each tensor its owner's, from their own directories
    for name in live0:
        assert torch.equal(restored0[name], restored1[name])
        assert torch.equal(restored0[name], live0[name]) or torch.equal(restored0[name], live1[name])


def _full_peer_rank(rank, root):
    """Rank 1's directory is a small tmpfs that fills up before the second save: its files cannot be
    reserved, yet it joins the clique's exchange, so rank 0's thread finishes; both ranks raise rank 1's
    ENOSPC at the boundary, and rank 0 reports no failure of its own."""
    import torch.distributed as dist

    from lightning_asyncckpt.errors import CheckpointWriteError
    from lightning_asyncckpt.tiers.setup import open_tier

    tier = LocalTier(f"{root}/node{rank}", replication_factor=2, timeout_s=60, emergency_signals=())
    run = open_tier(tier, node_rank=rank, local_world_size=1)
    run.save(2, {"w": torch.ones(1000), "global_step": 2})
    assert run.finish() == 2
    if rank == 1:
        with open(f"{root}/node1/filler", "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    dist.barrier()
    run.save(4, {"w": torch.ones(20_000), "global_step": 4})  # another size: new files needed
    try:
        run.finish()
        outcome = "no error"
    except CheckpointWriteError as e:
        outcome = ("error", str(e))
    run.close(wait=False)
    return outcome


def test_a_rank_whose_directory_is_full_still_joins_the_exchange_and_every_rank_raises_its_error(small_node1):
    got = two_ranks(_full_peer_rank, small_node1)
    for rank in (0, 1):
        assert isinstance(got[rank], tuple), got[rank]
        text = got[rank][1]
        assert "rank 1: LocalTierError: local save of step 4: OSError" in text and "No space left" in text, text
        assert "rank 0:" not in text, text  # rank 0's thread did not wait for a peer that never came


def _refill_full_rank(rank, root):
    """Node 1 comes back with an empty directory that has too little space for the shares it must hold
    again: its refill files cannot be reserved. Both ranks fall back to the persistent tier at once, with
    rank 1's reason, and neither waits for the other in a transfer (``timeout_s`` is far above the test's
    limit)."""
    import logging
    import shutil

    import torch.distributed as dist

    from lightning_asyncckpt.tiers.setup import open_tier

    tier = LocalTier(f"{root}/node{rank}", replication_factor=2, timeout_s=600, emergency_signals=())
    run = open_tier(tier, node_rank=rank, local_world_size=1)
    run.save(2, {"w": torch.ones(100_000), "global_step": 2})  # two shares of 200 kB
    assert run.finish() == 2
    run.close()
    if rank == 1:  # node 1 is back empty, its directory nearly full
        shutil.rmtree(f"{root}/node1/asyncckpt-local")
        with open(f"{root}/node1/filler", "wb") as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            f.truncate(max(0, f.tell() - 128 * 1024))  # room for the probes, not for a share
    dist.barrier()
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("lightning_asyncckpt").addHandler(handler)
    again = open_tier(tier, node_rank=rank, local_world_size=1)
    key = again.latest(None)
    again.close()
    return key, lines


def test_a_node_back_without_room_for_its_shares_makes_every_rank_fall_back_at_once(small_node1):
    got = two_ranks(_refill_full_rank, small_node1)
    for rank in (0, 1):
        assert isinstance(got[rank], tuple), got[rank]
        key, lines = got[rank]
        assert key is None  # the persistent tier's answer (none here), not a local restore
    why = [line for line in got[0][1] if "resuming from the persistent tier" in line]
    assert why and "rank 1 could not get ready for the refill transfers" in why[0] and "No space left" in why[0], why


def _torn_lazy_rank(rank, root):
    """A DDP-like state; rank 0 changes both tensors in place once the copies are held."""
    a, b = torch.ones(50_000), torch.full((50_000,), 2.0)  # 200 kB each: over the lazy minimum, one per share
    watched = {a.data_ptr(): [a], b.data_ptr(): [b]}
    return _lazy_save_torn_on_rank0(rank, root, {"a": a, "b": b, "global_step": 2},
                                    lambda t: watched.get(t.data_ptr()), lambda: (a.add_(1.0), b.add_(1.0)))


def test_a_torn_lazy_copy_on_one_rank_commits_nothing_in_its_clique_and_every_rank_raises(tmp_path):
    """Rank 0's copy is torn. Had its clique gone on, the replica check would have sent rank 0's torn share to
    rank 1 as a repair, and rank 1 would have committed it: a step that looks complete, holding bytes from
    after it. Instead no rank commits any share of that step, and both raise at the boundary."""
    got = two_nodes(_torn_lazy_rank, tmp_path)
    for rank in (0, 1):
        outcome, files = got[rank]
        assert "changed in place" in outcome and "rank(s) [0]" in outcome, outcome
        assert files == [], f"rank {rank} committed {files}"


def _torn_sharded_rank(rank, root):
    """A sharded (DTensor) state over both ranks; rank 0 changes its local shard in place once the copies are held."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    w = distribute_tensor(torch.ones(100_000), init_device_mesh("cpu", (2,)), [Shard(0)])  # 200 kB per rank
    local = w.to_local()
    return _lazy_save_torn_on_rank0(rank, root, {"w": w, "global_step": 2},
                                    lambda t: [local] if t.data_ptr() == local.data_ptr() else None,
                                    lambda: local.add_(1.0))


def test_a_torn_lazy_copy_of_a_sharded_share_is_sent_marked_and_no_peer_commits_it(tmp_path):
    """NVRx's clique replication still sends rank 0's torn shard (its peer waits for it), marked: rank 1 keeps
    no replica of it, so step 2 is not complete anywhere, and both ranks raise rank 0's error."""
    pytest.importorskip("nvidia_resiliency_ext")
    got = two_nodes(_torn_sharded_rank, tmp_path)
    for rank in (0, 1):
        outcome, files = got[rank]
        assert "changed in place" in outcome, outcome
        assert not [f for f in files if ".owner-0." in f], f"rank {rank} committed rank 0's torn share: {files}"
    assert got[1][1], "rank 1's own share, copied untorn, is committed"


def _lazy_save_torn_on_rank0(rank, root, state, lazy, edit):
    """A lazy local save of ``state`` at step 2, both ranks' copies held while rank 0 runs ``edit`` (a change in
    place: its copy is torn). Returns the error each rank raised at the boundary, and its committed files."""
    from pathlib import Path

    from lightning_asyncckpt.errors import CheckpointWriteError
    from lightning_asyncckpt.testing import HoldCopy
    from lightning_asyncckpt.tiers.setup import open_tier

    tier = LocalTier(f"{root}/node{rank}", replication_factor=2, timeout_s=60, emergency_signals=())
    run = open_tier(tier, node_rank=rank, local_world_size=1)
    hold = HoldCopy(timeout_s=60)
    run.save(2, state, lazy=lazy, hook=hold)
    hold.wait_started()
    if rank == 0:
        edit()
    hold.release()
    run.wait_copy()
    try:
        run.finish()
        outcome = "no error"
    except CheckpointWriteError as e:
        outcome = str(e)
    files = sorted(p.name for p in Path(f"{root}/node{rank}").rglob("step-*") if not p.name.endswith(".tmp"))
    run.close(wait=False)
    return outcome, files


def _signals_rank(rank, root):
    """For each case, a fresh tier on both ranks; each rank sends itself its case's signal (or none), then
    both take a step boundary: what they agreed on."""
    import os
    import signal

    from lightning_asyncckpt.tiers.setup import open_tier

    cases = {"one rank": ("SIGUSR1", None), "both, the same": ("SIGUSR1", "SIGUSR1"),
             "both, different": ("SIGUSR1", "SIGUSR2")}
    seen = {}
    for case, sent in cases.items():
        run = open_tier(LocalTier(f"{root}/node{rank}", replication_factor=2, timeout_s=30,
                                emergency_signals=("SIGUSR1", "SIGUSR2")), node_rank=rank, local_world_size=1)
        try:
            assert run.arm()
            if sent[rank]:
                os.kill(os.getpid(), getattr(signal, sent[rank]))  # only a flag is set
            b = run.boundary()
            seen[case] = (b.preempted, b.everywhere)
        finally:
            run.close()
    return seen


def test_the_ranks_agree_whether_every_rank_received_the_same_preemption_signal(tmp_path):
    """What decides whether Lightning's SLURM requeue handler may run after the emergency save: its save is
    collective, so every rank must have received the signal."""
    for rank in (0, 1):
        (tmp_path / f"node{rank}").mkdir()
    got = two_ranks(_signals_rank, tmp_path)
    for rank in (0, 1):
        assert got[rank] == {"one rank": (True, False), "both, the same": (True, True),
                             "both, different": (True, False)}, got[rank]


def _pass_on_rank(rank, root):
    """Both ranks receive SIGUSR1, which is to be passed on; before the tier armed, rank 0 always had a Python
    handler for it, rank 1 only in the second case: whether both may run the handler they replaced."""
    import os
    import signal

    from lightning_asyncckpt.tiers.setup import open_tier

    seen = {}
    for case, rank1_had_one in (("rank 1 had none", False), ("both had one", True)):
        before = signal.getsignal(signal.SIGUSR1)
        signal.signal(signal.SIGUSR1, (lambda *_: None) if rank == 0 or rank1_had_one else signal.SIG_DFL)
        run = open_tier(LocalTier(f"{root}/node{rank}", replication_factor=2, timeout_s=30,
                                emergency_signals=("SIGUSR1",)), node_rank=rank, local_world_size=1)
        try:
            assert run.arm(pass_on=("SIGUSR1",))
            os.kill(os.getpid(), signal.SIGUSR1)
            b = run.boundary()
            seen[case] = (b.everywhere, b.handlers_everywhere)
        finally:
            run.close()
            signal.signal(signal.SIGUSR1, before)
    return seen


def test_a_replaced_handler_is_passed_on_only_where_every_rank_has_one(tmp_path):
    """Lightning's SLURM requeue handler saves collectively: if one rank had no such handler to run, no rank
    runs its own (else the others would wait in that save)."""
    for rank in (0, 1):
        (tmp_path / f"node{rank}").mkdir()
    got = two_ranks(_pass_on_rank, tmp_path)
    for rank in (0, 1):
        assert got[rank] == {"rank 1 had none": (True, False), "both had one": (True, True)}, got[rank]
