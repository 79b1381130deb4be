"""4 ranks on 2 simulated nodes (tests/nodes.py): each node launched as a multi-node launch does, with its
own /dev/shm, TMPDIR and scratch; checkpoints in the shared directory. Every launch has a hard timeout, and
every process of every node is killed after it."""

from __future__ import annotations

import json
import time

import pytest
from nodes import launch_nodes, read_reports, run_nodes, skip_without_namespaces

from reports import read_report

JOB = "nodes_job"
RANKS = [0, 1, 2, 3]
SHARDS = [f"__{r}_0.distcp" for r in RANKS]

pytestmark = [pytest.mark.scale]


@pytest.fixture(autouse=True)
def _namespaces():
    skip_without_namespaces()


def _assert_identities(reports):
    """Global rank = node * 2 + local rank on every rank, and each node's /dev/shm is its own."""
    for r in reports:
        g = r.rank
        assert r["identity"] == {"global": g, "local": g % 2, "node": g // 2, "dist": g, "world": 4}, r["identity"]
        assert r["shm_marks"] == [2 * (g // 2), 2 * (g // 2) + 1], r["shm_marks"]  # only its own node's ranks


def _assert_every_rank_wrote_its_share(reports, name, extra):
    """Shard files of all four global ranks in ``name``, none empty, and each rank's record its own share."""
    layout = reports[0]["layout"][name]
    assert sorted(layout) == sorted([*SHARDS, *extra]), (name, layout)
    assert all(layout[f] > 0 for f in SHARDS), layout
    (nbytes,) = {r["records"][name][0] for r in reports}  # every rank's record counts all ranks' bytes
    local = [r["records"][name][1] for r in reports]
    assert all(0 < n < nbytes for n in local), local


def _assert_shares_written_and_resumed(reports, small_files):
    """Every rank has its own identity, wrote its share of both checkpoints (beside ``small_files``), rank 0
    verified them bit for bit, and every rank resumed exactly."""
    _assert_identities(reports)
    for name in ("epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"):
        _assert_every_rank_wrote_its_share(reports, name, small_files)
    assert reports[0]["verified"] and all(r["resume_exact"] for r in reports)


def test_async_ddp_strategy_on_two_nodes_saves_every_share_and_resumes_exactly(tmp_path):
    """The representative case of ``make test``: AsyncDDPStrategy, 2 x 2 ranks, fit with two saves that
    rank 0 checks bit for bit, and an exact resume on 4 ranks. A rank that took its identity from
    ``LOCAL_RANK`` would write node 0's shares again on node 1 (and global ranks 2 and 3's never)."""
    reports = run_nodes(JOB, tmp_path, "ddp", timeout=240, engine="mcore", worker="fork")
    _assert_shares_written_and_resumed(reports, [".asyncckpt-skeleton.pt", ".asyncckpt.json", ".metadata"])


@pytest.mark.slow
def test_ddp_plugin_on_two_nodes_rank0_writes_and_resumes_exactly(tmp_path):
    """Plain DDP with the plugin: global rank 0 (on node 0) writes each checkpoint alone; exact resume on 4."""
    reports = run_nodes(JOB, tmp_path, "ddp", timeout=240, strategy="plain")
    _assert_identities(reports)
    assert reports[0]["files"] == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]
    assert reports[0]["verified"] and all(r["resume_exact"] for r in reports)
    assert [sorted(r["records"]) for r in reports] == [["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"], [], [], []]


@pytest.mark.slow
def test_fsdp2_over_four_ranks_on_two_nodes_saves_every_shard_and_resumes_exactly(tmp_path):
    reports = run_nodes(JOB, tmp_path, "mp", timeout=300)
    _assert_shares_written_and_resumed(reports, [".asyncckpt.json", ".metadata", "meta.pt"])


@pytest.mark.slow
def test_tensor_parallel_within_nodes_fsdp2_across_on_two_nodes(tmp_path):
    """2 x 2: 2-way tensor parallel inside each node, FSDP2 across the nodes; exact save and resume."""
    reports = run_nodes(JOB, tmp_path, "mp", timeout=300, tp=2)
    _assert_shares_written_and_resumed(reports, [".asyncckpt.json", ".metadata", "meta.pt"])


@pytest.mark.slow
def test_fsdp2_resharding_four_to_two_to_four_ranks(tmp_path):
    """Saved on 4 ranks (2 nodes), resumed exactly on 2 (one node) and saved, resumed exactly on 4 again."""
    four = run_nodes(JOB, tmp_path / "four", "mp", timeout=300, dir="no-resume")
    assert four[0]["verified"]
    saved = tmp_path / "four" / "out" / "c" / "epoch=0-step=8.ckpt"
    two = run_nodes(JOB, tmp_path / "two", "resume", nodes=1, timeout=240, dir=saved)
    assert all(r["resume_exact"] for r in two)
    back = run_nodes(JOB, tmp_path / "back", "resume", timeout=300, dir=two[0]["saved"])
    _assert_identities(back)
    assert all(r["resume_exact"] for r in back)


@pytest.mark.slow
def test_a_write_failure_on_node_1_raises_on_all_four_ranks(tmp_path):
    """ENOSPC in the background write of global rank 3 (node 1, local rank 1) raises CheckpointWriteError
    naming rank 3 on every rank, at the same step; the committed checkpoint stays, nothing partial."""
    reports = run_nodes(JOB, tmp_path, "fail", timeout=300)
    for r in reports:
        raised = r["raised"]
        assert raised is not None, f"rank {r['rank']} did not raise"
        assert raised["type"] == "CheckpointWriteError" and raised["ranks"] == [3], raised
        assert raised["path"].endswith("epoch=0-step=8.ckpt") and raised["error_type"] == "OSError", raised
        assert "rank 3" in raised["message"] and "ENOSPC" in raised["message"], raised
        assert r["files"] == ["epoch=0-step=4.ckpt"]
    assert len({r["global_step"] for r in reports}) == 1 and reports[0]["global_step"] < 40


def _wait_for_files(cluster, paths):
    """Returns once every path exists (the handshake); fails the test if a node exits or the deadline passes."""
    while not all(p.exists() for p in paths):
        if not all(n.running for n in cluster.nodes) or time.monotonic() > cluster.deadline:
            pytest.fail(f"the save was never held on node 1 ({[p.name for p in paths]}); logs:\n{cluster.logs()}")
        time.sleep(0.05)


def _gone(node, deadline):
    """Seconds until every process of ``node`` has exited (zombies count as exited), polled until ``deadline``."""
    import psutil

    while time.monotonic() < deadline:
        alive = []
        for p in node.processes():
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                pass
        if not alive:
            return time.monotonic()
        time.sleep(0.05)
    return None


@pytest.mark.slow
def test_node_lost_mid_save_ends_node_0_and_the_next_launch_resumes_from_last(tmp_path):
    """FSDP2 over 4 ranks; the step-4 save is committed, then node 1's writes of the step-8 save are held
    and node 1 is SIGKILLed (every process of it) while that save is in flight. Node 0's ranks must exit
    by themselves (no hang in any checkpoint path), nothing is left at a final path of the lost save, and
    a new 4-rank launch resumes from ``ckpt_path="last"``: the step-4 checkpoint, exactly."""
    lost = tmp_path / "lost"
    args = ["--case", "loss", "--engine", "nvrx", "--worker", "persistent"]
    with launch_nodes(JOB, args, lost, timeout=400) as cluster:
        node0, node1 = cluster.nodes
        _wait_for_files(cluster, [cluster.out / "held-rank2", cluster.out / "held-rank3"])
        killed = node1.kill()
        t_kill = time.monotonic()
        exited = _gone(node0, cluster.deadline)
        assert exited is not None, f"node 0 still running {cluster.timeout}s after the launch:\n{cluster.logs()}"
        exit_s = exited - t_kill
        (code,) = cluster.wait([node0])
        logs = cluster.logs()
    assert len(killed) >= 2, killed  # both ranks of node 1 (and their writers)
    ckdir = cluster.out / "c"
    # nothing of the lost save at a final path: the committed step-4 checkpoints only (leftovers of the
    # unfinished one may remain under a temporary name; the next launch's rank 0 removes them)
    finals = sorted(p.name for p in ckdir.iterdir() if not p.name.startswith(".asyncckpt-incomplete-"))
    assert finals == ["epoch=0-step=4.ckpt", "last.ckpt"], (finals, logs[-4000:])
    assert json.loads((ckdir / "last.ckpt" / ".asyncckpt.json").read_text())["global_step"] == 4
    for rank in (0, 1):  # node 0's ranks ended by an error, not by the test's timeout
        path = cluster.out / f"rank{rank}.json"
        if path.exists():
            assert read_report(path).crash is not None
    print(f"node 0 exited {exit_s:.1f}s after node 1 was killed, with status {code}")
    (tmp_path / "exit_s.txt").write_text(f"{exit_s:.2f}\n")

    # the next launch, in the same directory (the reports and logs of the lost one go aside first)
    for f in [*cluster.out.glob("rank*.json"), *(n.home / "log.txt" for n in cluster.nodes)]:
        f.rename(f.with_name(f"lost-{f.name}"))
    with launch_nodes(JOB, ["--case", "last"], lost, timeout=300) as again:
        again.wait()
        reports = read_reports(again, 4)
    for r in reports:
        assert r["start_step"] == 4, r
        assert not any(n.startswith(".asyncckpt-incomplete-") for n in r["after"]), r["after"]
    assert reports[0]["resume_exact"]
