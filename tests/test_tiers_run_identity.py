"""A local step belongs to one run (``tiers/run_identity.py``) and a session to one job at a time
(``tiers/job_lock.py``): real Trainers and real files in this process, real gloo ranks for the node replaced,
and a real second process for the second job."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import traceback

import pytest
import torch
from test_tiers_trainer import _fit

from helpers import assert_tree_equal
from lightning_asyncckpt import LocalTier
from processes import two_ranks

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def local_dir(tmp_path):
    (tmp_path / "local").mkdir()
    return tmp_path / "local"


def _holder(local_dir):
    return local_dir / "asyncckpt-local" / "default" / "holder-0"


def test_another_experiment_in_the_same_session_starts_at_step_0_not_from_the_other_runs_local_step(
        tmp_path, local_dir, caplog):
    """Run A trains 20 steps with a local tier; run B (another ModelCheckpoint dirpath, the same dir and
    session) starts with ``ckpt_path="last"`` and an empty dirpath: as stock, it starts at step 0."""
    _fit(tmp_path, 20, every=100, dirpath=tmp_path / "a")
    assert (_holder(local_dir) / "step-0000000020.owner-0.json").is_file()
    with caplog.at_level("WARNING"):
        t, b = _fit(tmp_path, 22, ckpt_path="last", every=100, dirpath=tmp_path / "b")
    assert b.start_step == 0 and t.ckpt_path is None
    assert "resuming from the local tier" not in caplog.text
    assert "written for the persistent destination" in caplog.text  # the log line says why
    # A's steps are not B's: removed, and B's own saves are what the session holds now
    assert sorted(p.name for p in _holder(local_dir).glob("*.json")) == ["step-0000000022.owner-0.json"]


def test_a_fresh_start_never_resumes_the_older_runs_higher_local_step(tmp_path, local_dir):
    """A run trains to step 20; the same experiment restarted from scratch (no ckpt_path) trains to 6 and is
    requeued with ``ckpt_path="last"``: it resumes its own step 6, not the older run's 20."""
    _fit(tmp_path, 20, every=100)
    _, again = _fit(tmp_path, 6, every=100)
    t, requeued = _fit(tmp_path, 22, ckpt_path="last", every=100)
    assert requeued.start_step == 6 and t.ckpt_path.endswith("restore-step-6")
    assert_tree_equal(requeued.start, again.saved[6], "resume of the restarted run")


# a guard of the requeue (it passed before run ids too): three fits, in `make test-all`; the resumes of
# test_tiers_trainer.py and test_tiers_trainer_cases.py keep a fresh start then ckpt_path="last" in `make test`
@pytest.mark.slow
def test_a_requeue_with_a_path_then_with_last_resumes_the_runs_own_local_steps(tmp_path, local_dir):
    """Requeues of one run keep its identity: resumed from a persistent path (step 8), it trains to 12; the
    next requeue with ``ckpt_path="last"`` resumes its local step 12 (whatever its pid)."""
    _fit(tmp_path, 10, every=8)  # persistent at 8, local at 2, ..., 10
    _, second = _fit(tmp_path, 12, ckpt_path=str(tmp_path / "c" / "epoch=0-step=8.ckpt"), every=8)
    assert second.start_step == 8
    t, third = _fit(tmp_path, 13, ckpt_path="last", every=8)
    assert third.start_step == 12 and t.ckpt_path.endswith("restore-step-12")
    assert_tree_equal(third.start, second.saved[12], "resume after two requeues")


def _node_replaced_rank(rank, root):
    """Two nodes, replication 2: steps 2 and 4 saved by a run for destination ``ckpts``. Node 1 comes back
    with an empty directory: the requeued run (same destination) takes its peers' run and restores step 4.
    Then a run for another destination, with ``ckpt_path="last"``, restores nothing of it."""
    import torch.distributed as dist

    from lightning_asyncckpt.tiers.setup import open_tier

    tier = LocalTier(f"{root}/node{rank}", replication_factor=2, timeout_s=60, emergency_signals=())
    run = open_tier(tier, node_rank=rank, local_world_size=1)
    run.begin("ckpts", resuming=False)
    for step in (2, 4):
        run.save(step, {"w": torch.full((1000,), float(step)), "global_step": step})
        run.boundary()
    assert run.finish() == 4
    run.close()
    if rank == 1:
        shutil.rmtree(f"{root}/node1/asyncckpt-local")  # the node replaced: nothing left of the session
    dist.barrier()
    again = open_tier(tier, node_rank=rank, local_world_size=1)
    again.begin("ckpts", resuming=True)
    restored = again.take(again.latest(None))
    again.close()
    other = open_tier(tier, node_rank=rank, local_world_size=1)
    other.begin("elsewhere", resuming=True)
    key = other.latest(None)
    other.close()
    return (None if restored is None else restored["global_step"]), key


def test_a_node_replaced_takes_its_peers_run_and_another_destination_restores_nothing(tmp_path):
    for r in range(2):
        (tmp_path / f"node{r}").mkdir()
    got = two_ranks(_node_replaced_rank, tmp_path)
    for rank in (0, 1):
        assert isinstance(got[rank], tuple), got[rank]
        assert got[rank] == (4, None), got[rank]


def _second_job(directory, q):
    """Another job (its own process) on the same directory and session: its tier's setup, reported back."""
    torch.set_num_threads(1)
    try:
        from lightning_asyncckpt.tiers.setup import open_tier

        run = open_tier(LocalTier(directory, replication_factor=1, emergency_signals=()), node_rank=0,
                        local_world_size=1)
        run.close()
        q.put("no error")
    except BaseException as e:  # noqa: BLE001
        q.put(f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")


def test_a_second_job_on_the_same_directory_and_session_is_refused_at_setup_naming_the_first(local_dir):
    """The first job (this process) holds the session; a second job's setup is refused, naming this
    host and pid, and touches nothing; the first then saves on, unharmed (before, the second's start
    removed the first's spare files: its next save failed with ``FileNotFoundError``)."""
    from lightning_asyncckpt.tiers.cliques import TierConfigError
    from lightning_asyncckpt.tiers.setup import open_tier

    tier = LocalTier(local_dir, replication_factor=1, emergency_signals=())
    first = open_tier(tier, node_rank=0, local_world_size=1)
    try:
        state = {"w": torch.ones(10_000), "global_step": 2}
        for step in (2, 4):
            state["global_step"] = step
            first.save(step, state)
            first.boundary()
        assert first.finish() == 4
        before = {p: p.stat().st_mtime_ns for p in tier.root.rglob("*")}
        assert any(p.name.startswith(".free-") for p in before)  # a spare file for the next save

        ctx = mp.get_context("fork")
        q = ctx.Queue()
        second = ctx.Process(target=_second_job, args=(str(local_dir), q))
        second.start()
        try:
            got = q.get(timeout=60)
        finally:
            second.join(30)
            if second.is_alive():
                second.kill()
        assert got.startswith(TierConfigError.__name__), got
        assert f"host {socket.gethostname()!r}, pid {os.getpid()}" in got and "session=" in got, got
        assert {p: p.stat().st_mtime_ns for p in tier.root.rglob("*")} == before  # nothing touched

        for step in (6, 8):
            state["global_step"] = step
            first.save(step, state)
            first.boundary()
        assert first.finish() == 8
    finally:
        first.close()
    # the first job's end lets the session go: the next job takes it (a requeue after a crash likewise)
    open_tier(tier, node_rank=0, local_world_size=1).close()
    with pytest.raises(TierConfigError):  # and this process's own second tier is a second job too
        held = open_tier(tier, node_rank=0, local_world_size=1)
        try:
            open_tier(tier, node_rank=0, local_world_size=1)
        finally:
            held.close()


def _outlive(r):
    os.read(r, 1)  # until the test lets it end
    os._exit(0)


def test_a_process_forked_from_the_job_never_keeps_the_session_locked(local_dir):
    """A child forked while the job holds the session (a fork-per-save writer, a DataLoader worker) may outlive
    it: the next job still takes the session at once."""
    from lightning_asyncckpt.tiers.setup import open_tier

    tier = LocalTier(local_dir, replication_factor=1, emergency_signals=())
    first = open_tier(tier, node_rank=0, local_world_size=1)
    r, w = os.pipe()
    child = mp.get_context("fork").Process(target=_outlive, args=(r,))
    child.start()
    try:
        first.close()
        open_tier(tier, node_rank=0, local_world_size=1).close()  # the child still runs: it holds no lock
        assert child.is_alive()
    finally:
        os.write(w, b"x")
        child.join(30)
        if child.is_alive():
            child.kill()
        os.close(r)
        os.close(w)


def test_which_run_a_start_takes():
    """Pure logic: a fresh start is always a new run; a resume takes the newest record's run where its
    destination is this run's (ranks without a record: a replaced node), else a new one."""
    from lightning_asyncckpt.tiers import run_identity
    from lightning_asyncckpt.tiers.run_identity import RunRecord, decide

    a1, b2 = RunRecord("a", "/ckpt/a", 1), RunRecord("b", "/ckpt/b", 2)
    fresh = decide([a1, a1], "/ckpt/a", False, "new")
    assert fresh.record == RunRecord("new", "/ckpt/a", 2) and not fresh.adopted and fresh.replaced == a1
    assert decide([a1, None], "/ckpt/a", True, "new").record == a1  # node 1 replaced
    assert decide([a1, b2], "/ckpt/a", True, "new").record == RunRecord("new", "/ckpt/a", 3)  # b is newer
    assert decide([a1, b2], "/ckpt/b", True, "new").record == b2
    assert decide([None, None], "/ckpt/a", True, "new").record == RunRecord("new", "/ckpt/a", 1)
    assert run_identity.destination_of(["b", "s3://x/y", None]) == "\n".join(
        sorted([os.path.abspath("b"), "s3://x/y"]))
