"""Two tiers on 2 simulated nodes x 2 ranks (tests/nodes.py), each node with its own /dev/shm whose
``local`` directory survives a restart of the job: local saves every 2 steps, persistent every 8.

A node is lost after local step 10: both nodes' processes are SIGKILLed (the job restarts) and node 1
comes back with an empty local directory. Every launch has a hard timeout; every process is killed after."""

from __future__ import annotations

import os
import signal
import time

import pytest
from nodes import launch_nodes, node_local_dir, read_reports, skip_without_namespaces

from lightning_asyncckpt.testing import local_tier

JOB = "tiers_job"

# a test here is up to five 4-rank launches, each under its own hard deadline (launch_nodes' timeout, which
# kills every process); the whole test gets their sum's worth, not the suite's 240 s: two of them side by side
# (pytest -n 2 on 2 cores) took 157 s and over 240 s for the FSDP2 scenarios
pytestmark = [pytest.mark.scale, pytest.mark.timeout(900)]


@pytest.fixture(autouse=True)
def _namespaces():
    skip_without_namespaces()


def _wait_for(cluster, names):
    paths = [cluster.out / n for n in names]
    while not all(p.exists() for p in paths):
        if not all(n.running for n in cluster.nodes) or time.monotonic() > cluster.deadline:
            pytest.fail(f"never reached {names}; logs:\n{cluster.logs()}")
        time.sleep(0.05)


def _train_and_lose_node_1(tmp_path, extra, devices=2):
    """Trains until local step 10 is complete, then SIGKILLs node 1 and node 0 (the job restarts)."""
    with launch_nodes(JOB, ["--case", "train", *extra], tmp_path, devices=devices, timeout=300,
                      node_local=True) as cluster:
        _wait_for(cluster, [f"held-rank{r}" for r in range(2 * devices)])
        cluster.nodes[1].kill()
        cluster.nodes[0].kill()
        cluster.wait()
    for f in cluster.out.glob("rank*.json"):
        f.unlink()
    return cluster.out


def _resume(tmp_path, extra, devices=2):
    with launch_nodes(JOB, ["--case", "resume", *extra], tmp_path, devices=devices, timeout=300,
                      node_local=True) as cluster:
        cluster.wait()
        reports = read_reports(cluster, 2 * devices)
        logs = cluster.logs()
    for f in cluster.out.glob("rank*.json"):
        f.unlink()
    return reports, logs


def _empty(tmp_path, node):
    """The node comes back with an empty local directory (refused if a process of the job still held it)."""
    local_tier.lose_node(node_local_dir(tmp_path, node))


def _scenarios(tmp_path, extra, lost_clique=True):
    out = _train_and_lose_node_1(tmp_path, extra)
    assert sorted(p.name for p in (out / "c").iterdir()) == ["epoch=0-step=8.ckpt", "last.ckpt"]
    node0 = node_local_dir(tmp_path, 0) / "asyncckpt-local" / "default"
    # node 0 holds its ranks' own shares of step 10 and the replicas of node 1's (rank 0 <-> 2, 1 <-> 3)
    assert sorted(p.name for p in (node0 / "holder-0").glob("*.pt")) == [
        "step-0000000010.owner-0.pt", "step-0000000010.owner-2.pt"]

    # node 1 back with an empty local directory: step 10, its shares from node 0's replicas, exactly
    _empty(tmp_path, 1)
    reports, logs = _resume(tmp_path, extra)
    assert [r["start_step"] for r in reports] == [10] * 4, logs
    assert all(r["ckpt_path"].endswith("restore-step-10") and r["resume_exact"] for r in reports)
    # DDP: node 1 gets each of the four shares once (ranks 2 and 3: their own and their replica), then each
    # rank reads all four on its own node. FSDP2: ranks 2 and 3 get their own share, each reads it, and the
    # replicas of node 0's shares follow while training resumes
    assert ("at step 10 (4 share(s) sent between ranks, 16 read on their own node)" in logs
            or "at step 10 (2 share(s) sent between ranks, 4 read on their own node; 2 replica(s) sent after, while"
               " training resumes)" in logs), logs
    # and node 1 holds again what it held: its ranks' shares and node 0's replicas
    node1 = node_local_dir(tmp_path, 1) / "asyncckpt-local" / "default"
    assert sorted(p.name for p in (node1 / "holder-2").glob("*.pt")) == [
        "step-0000000010.owner-0.pt", "step-0000000010.owner-2.pt"], logs

    # a replica corrupted (one byte): its CRC check fails, and the job resumes at 8 from the persistent tier
    _empty(tmp_path, 1)
    replica = local_tier.corrupt_share(node_local_dir(tmp_path, 0), owner=2)
    assert replica == node0 / "holder-0" / "step-0000000010.owner-2.pt"
    reports, logs = _resume(tmp_path, extra)
    assert [r["start_step"] for r in reports] == [8] * 4, logs
    assert all(r["ckpt_path"].endswith("last.ckpt") and r["resume_exact"] for r in reports)
    # DDP: rank 0 reads that replica itself and checks it; FSDP2: only sends it, and rank 2 checks it on arrival
    checked_by = "sent by rank 0" if "fsdp2" in extra else "held by rank 0"
    assert f"step 10 failed its checks: rank 2's share in the copy {checked_by} has CRC32" in logs, logs

    # a lost clique: node 1 empty and node 0's copy of rank 2's share gone too, so it is nowhere
    if lost_clique:
        _empty(tmp_path, 1)
        local_tier.drop_share(node_local_dir(tmp_path, 0), owner=2)
        reports, logs = _resume(tmp_path, extra)
        assert [r["start_step"] for r in reports] == [8] * 4, logs
        assert all(r["ckpt_path"].endswith("last.ckpt") and r["resume_exact"] for r in reports)
        assert ("resuming from the persistent tier" in logs
                and "local tier: step 10 lacks the shares of rank(s) [2] (their whole clique lost them)" in logs), logs

    # both nodes' local tiers lost: step 8 from the persistent tier, with the reason
    _empty(tmp_path, 0)
    _empty(tmp_path, 1)
    reports, logs = _resume(tmp_path, extra)
    assert [r["start_step"] for r in reports] == [8] * 4, logs
    assert all(r["resume_exact"] for r in reports)
    assert "local tier: no rank holds any local checkpoint (every local directory is empty)" in logs


def test_ddp_node_lost_resumes_from_replicas_then_persistent(tmp_path):
    """DDP with the plugin (nvrx; the persistent tier written by rank 0, the local tier by every rank). The
    lost clique's launch (about 17 s on 2 cores) is left to the variants in `make test-all`: its plan is the
    same pure logic (tests/test_tiers.py), and its fallback the one the corrupt replica's launch takes."""
    _scenarios(tmp_path, ["--engine", "nvrx", "--strategy", "ddp"], lost_clique=False)


@pytest.mark.slow
def test_async_ddp_strategy_node_lost_resumes_from_replicas_then_persistent(tmp_path):
    """``AsyncDDPStrategy`` (every rank writes a share of each persistent checkpoint, a directory) with the
    local tier: the same scenarios, the persistent fallback read from those directories."""
    _scenarios(tmp_path, ["--engine", "nvrx", "--strategy", "async_ddp"])


@pytest.mark.slow
def test_ddp_node_lost_resumes_from_replicas_then_persistent_with_mcore(tmp_path):
    _scenarios(tmp_path, ["--engine", "mcore", "--strategy", "ddp"])


# overlap_agreement=True acting one boundary later is proven by test_tiers_overlap.py in `make test`; this
# run of it is in `make test-all` / `make test-scale`. One rank per node: what is proven (a signal on one
# rank of one node, agreed by all, saved with its replicas on the other node) needs no second rank per node,
# and 2 x 1 took half the time of 2 x 2 on 2 cores (43 s under `make test`)
# `make test-scale` and `make test-all` (183 s at load); `make test` keeps a one-node SIGTERM (test_tiers_trainer.py)
@pytest.mark.slow
@pytest.mark.parametrize("overlap", ["0", "1"])
def test_sigterm_on_one_rank_saves_the_agreed_step_locally_stops_every_rank_and_resumes_there(tmp_path, overlap):
    """SIGTERM to global rank 1 only (node 1) in the middle of training: the handler only sets a flag; at
    the next step boundary both ranks agree, save that step to the local tier with its replicas, drain
    and stop training without an error; the next launch resumes exactly there. With
    ``overlap_agreement=True`` the ranks agree one boundary later, both at the same step."""
    extra = ["--engine", "mcore", "--strategy", "ddp", "--overlap", overlap]
    with launch_nodes(JOB, ["--case", "preempt", *extra], tmp_path, devices=1, timeout=300,
                      node_local=True) as cluster:
        _wait_for(cluster, ["at-step-5-rank1"])
        os.kill(int((cluster.out / "at-step-5-rank1").read_text()), signal.SIGTERM)
        cluster.wait()
        reports = read_reports(cluster, 2)
        logs = cluster.logs()
    (stopped,) = {r["stopped_at"] for r in reports}
    assert 5 <= stopped < 400 and all(r["complete"] == stopped for r in reports), (reports, logs)
    assert f"preemption requested: step {stopped} is in the local tier with its replicas; stopping" in logs
    assert "global rank 1 received SIGTERM" in logs
    for f in cluster.out.glob("rank*.json"):
        f.unlink()
    reports, logs = _resume(tmp_path, extra, devices=1)
    assert [r["start_step"] for r in reports] == [stopped] * 2, logs
    assert all(r["ckpt_path"].endswith(f"restore-step-{stopped}") and r["resume_exact"] for r in reports)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["mcore", "nvrx"])
def test_fsdp2_node_lost_resumes_from_replicas_then_persistent(tmp_path, engine):
    """The same with FSDP2 over the 4 ranks (AsyncModelParallelStrategy): each rank's share is its own
    DTensor shards, rebuilt on the model's mesh at the resume."""
    _scenarios(tmp_path, ["--engine", engine, "--strategy", "fsdp2"])


FABRIC_JOB = "tiers_fabric_job"


def _fabric_case(tmp_path, case, args):
    """One launch of the Fabric job on 2 nodes x 1 rank: ``train`` (until local step 10 is complete, then both
    nodes SIGKILLed) returns nothing; any other case returns every rank's report and the logs."""
    with launch_nodes(FABRIC_JOB, ["--case", case, *args], tmp_path, nodes=2, devices=1, timeout=240,
                      node_local=True) as cluster:
        if case == "train":
            _wait_for(cluster, ["held-rank0", "held-rank1"])
            cluster.nodes[1].kill()
            cluster.nodes[0].kill()
        cluster.wait()
        got = None if case == "train" else (read_reports(cluster, 2), cluster.logs())
    for f in cluster.out.glob("rank*.json"):
        f.unlink()
    return got


@pytest.mark.parametrize("engine,strategy", [("mcore", "ddp"), pytest.param("nvrx", "ddp", marks=pytest.mark.slow),
                                             ("nvrx", "fsdp2"), pytest.param("mcore", "fsdp2", marks=pytest.mark.slow)])
def test_fabric_node_lost_resumes_from_the_replica_then_persistent(tmp_path, engine, strategy):
    """Fabric over 2 nodes x 1 rank, DDP or FSDP2 (``AsyncFabricModelParallelStrategy``: each rank's own
    DTensor shards, replicated by NVRx's clique replication): node 1 lost after local step 10 and back empty
    resumes at 10 from node 0's replica; with both local tiers lost, at 8 from the persistent checkpoint."""
    args = ["--engine", engine, "--strategy", strategy]
    _fabric_case(tmp_path, "train", args)
    for expect, lost in ((10, [1]), (8, [0, 1])):
        for node in lost:
            _empty(tmp_path, node)
        reports, logs = _fabric_case(tmp_path, "resume", args)
        assert [r["start_step"] for r in reports] == [expect] * 2, logs
        assert all(r["resumed"] and r["resume_exact"] for r in reports)
    assert "resuming from the persistent tier" in logs and "every local directory is empty" in logs


# DDP's keys are stock Fabric's own check on the checkpoint the tier returned (make test-all); FSDP2's go
# through this package's load of the shards (tier_fabric_load), so that one runs in make test
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp2"])
def test_fabric_tiers_resume_takes_keys_as_fabric_load_does(tmp_path, strategy):
    """``FabricTiers.resume(state, strict=...)`` of a local step: a key the step lacks raises under ``strict``
    (Fabric's own error) and is left alone without it; the step's name loaded again says what it is."""
    args = ["--engine", "nvrx", "--strategy", strategy]
    _fabric_case(tmp_path, "train", args)
    reports, _logs = _fabric_case(tmp_path, "keys", args)
    for r in reports:
        assert "'extra'" in r["strict_error"]
        assert r["resumed"] and r["start_step"] == 10 and r["extra"] == 1
        assert "names step 10 of the local tier" in r["again_error"]


@pytest.mark.slow  # `make test-scale` and `make test-all` run it; out of `make test` for its 15 minutes
def test_fsdp2_with_full_persistent_checkpoints_keeps_each_ranks_shards_locally(tmp_path):
    """``AsyncModelParallelStrategy(save_distributed_checkpoint=False)``: the persistent checkpoints are full
    states gathered on rank 0, but the local tier still keeps each rank's own shards (a gathered state exists
    on rank 0 alone; the local save's collectives failed on it before). Node 1 back empty resumes at 10 from
    the replicas; with both local tiers lost, at 8 from the persistent full file. On 2 nodes x 1 rank (the
    node tests above run 2 x 2): the subject is the gathered state on rank 0 alone, which 2 ranks show."""
    extra = ["--engine", "nvrx", "--strategy", "fsdp2", "--full", "1"]
    out = _train_and_lose_node_1(tmp_path, extra, devices=1)
    assert sorted(p.name for p in (out / "c").iterdir()) == ["epoch=0-step=8.ckpt", "last.ckpt"]
    assert (out / "c" / "last.ckpt").is_file()  # a full checkpoint, not a directory of shards
    for expect, lost in ((10, [1]), (8, [0, 1])):
        for node in lost:
            _empty(tmp_path, node)
        reports, logs = _resume(tmp_path, extra, devices=1)
        assert [r["start_step"] for r in reports] == [expect] * 2, logs
        assert all(r["resume_exact"] for r in reports)
