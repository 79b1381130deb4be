"""Two-rank DDP (gloo) jobs in real processes, each under a hard timeout, with the process group killed after."""

from __future__ import annotations

import pytest

from helpers import combo_params, latest_raise_step
from processes import run_ranks

JOB = "ddp_job"


def run_job(tmp_path, case, engine, worker, **extra):
    return run_ranks(JOB, tmp_path, case, engine, worker, **extra)


@pytest.mark.parametrize(("engine", "worker"), combo_params(fast={("nvrx", "persistent")}))
def test_ddp_top_k_snapshots_and_exact_resume(tmp_path, engine, worker):
    r0, r1 = run_job(tmp_path, "fit", engine, worker)
    expected = ["epoch=0-step=8.ckpt", "epoch=1-step=12.ckpt", "epoch=1-step=16.ckpt", "last.ckpt"]
    assert r0["files"] == r1["files"] == expected
    assert r0["verified"] == expected  # bit-exact against copies taken at save time
    assert r0["steps_while_pending"] >= 4
    assert r0["resume_exact"] and r1["resume_exact"]
    assert r0["resumed_steps"] == r1["resumed_steps"] == [16, 16]
    for r in (r0, r1):
        assert r["children_after_fit"] == [] and r["children_after_resume"] == []


@pytest.mark.slow  # make test-all: kept out of make test for its 15-minute budget
def test_ddp_a_save_in_flight_lands_when_every_rank_dies(tmp_path):
    """Rank 0 commits the save it was writing on the way out of an error raised on every rank."""
    r0, r1 = run_job(tmp_path, "die", "nvrx", "persistent")
    assert r0["raised"] == "boom on rank 0" and r1["raised"] == "boom on rank 1"
    assert r0["children_after_fit"] == [] and r1["children_after_fit"] == []
    assert r0["files"] == ["epoch=0-step=4.ckpt"] and r0["verified"]


def _assert_failed_everywhere(r0, r1, path_end, error_type, ranks=(0,)):
    for r in (r0, r1):
        raised = r["raised"]
        assert raised is not None, f"rank {r['rank']} did not raise"
        assert raised["type"] == "CheckpointWriteError" and raised["ranks"] == list(ranks)
        assert raised["path"].endswith(path_end) and raised["error_type"] == error_type
        assert all(f"rank {k}" in raised["message"] for k in ranks) and path_end in raised["message"]
        assert r["children_after_fit"] == []
        assert r["files"] == ["epoch=0-step=4.ckpt"]  # the committed one survives, nothing partial
    assert r0["global_step"] == r1["global_step"] < 40  # training stopped, at the same point on both ranks


@pytest.mark.parametrize(("engine", "worker"), combo_params(fast={("nvrx", "persistent")}))
def test_ddp_real_disk_full_raises_on_every_rank(tmp_path, small_tmpfs, engine, worker):
    r0, r1 = run_job(tmp_path, "enospc", engine, worker, dir=small_tmpfs)
    _assert_failed_everywhere(r0, r1, "epoch=1-step=8.ckpt", "OSError")
    assert r0["raised"]["errno"] == 28 and "ENOSPC" in r0["raised"]["message"]


@pytest.mark.parametrize(("engine", "worker"), combo_params(fast={("mcore", "fork")}))
def test_ddp_killed_worker_raises_on_every_rank(tmp_path, engine, worker):
    r0, r1 = run_job(tmp_path, "kill", engine, worker)
    _assert_failed_everywhere(r0, r1, "epoch=1-step=8.ckpt", "WorkerDied")
    assert "SIGKILL" in r0["raised"]["message"]


@pytest.mark.parametrize(("engine", "worker"), combo_params(fast={("mcore", "fork")}, combos=[("nvrx", "persistent"), ("mcore", "fork")]))
def test_ddp_plugin_alone_gets_the_finalizer_on_every_rank(tmp_path, engine, worker):
    r0, r1 = run_job(tmp_path, "auto", engine, worker)
    _assert_failed_everywhere(r0, r1, "epoch=1-step=8.ckpt", "OSError")


@pytest.mark.slow  # make test-all: kept out of make test for its 15-minute budget
def test_ddp_weights_only_save_error_raises_on_every_rank_within_steps(tmp_path):
    """``ModelCheckpoint(save_weights_only=True)``: Lightning skips callbacks' ``on_save_checkpoint``,
    yet the failed write stops both ranks a few steps after it, not at the end of fit."""
    r0, r1 = run_job(tmp_path, "weights_only", "nvrx", "persistent")
    _assert_failed_everywhere(r0, r1, "epoch=1-step=8.ckpt", "OSError")
    assert r0["global_step"] <= latest_raise_step(8)  # raised within steps of the failure


@pytest.mark.slow  # make test-all: kept out of make test for its 15-minute budget
def test_ddp_bad_input_on_rank0_raises_on_every_rank(tmp_path):
    """A save that fails at save time on rank 0 must not leave rank 1 waiting in Lightning's barrier."""
    r0, r1 = run_job(tmp_path, "badinput", "nvrx", "persistent")
    _assert_failed_everywhere(r0, r1, "epoch=1-step=8.ckpt", "TypeError")
    assert "pickle" in r0["raised"]["message"]


# make test-all only (make test's time): in make test, AsyncDDPStrategy's every-rank writes are saved and resumed
# exactly on two simulated nodes (test_nodes.py), and one failing rank is raised on both (below)
@pytest.mark.parametrize(("engine", "worker"), combo_params(fast=set()))
def test_async_ddp_strategy_writes_on_every_rank(tmp_path, engine, worker):
    r0, r1 = run_job(tmp_path, "parallel", engine, worker)
    assert r0["files"] == r1["files"] == ["epoch=1-step=12.ckpt", "epoch=1-step=16.ckpt", "last.ckpt"]
    for name, shards in r0["shards"].items():
        assert sorted(shards) == [".asyncckpt-skeleton.pt", ".asyncckpt.json", ".metadata", "__0_0.distcp", "__1_0.distcp"], name  # both ranks wrote
        a, b = shards["__0_0.distcp"], shards["__1_0.distcp"]
        assert 0.7 < a / b < 1.4, (name, shards)  # comparable shares
        # one copy of the state, plus torch.save's per-tensor framing and the skeleton
        assert r0["state_bytes"] <= a + b < 1.3 * r0["state_bytes"] + 65536, (name, shards, r0["state_bytes"])
    for r in (r0, r1):
        assert r["resume_exact"] and r["children_after_fit"] == [] and r["children_after_resume"] == []
    # the same checkpoint resumes exactly on a single rank
    from lightning.pytorch import Callback

    from helpers import TinyModel, assert_tree_equal, clone_tree, loader, trainer
    from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback

    path = tmp_path / "out" / "c" / "epoch=1-step=12.ckpt"
    io = AsyncCheckpointIO(engine, worker=worker)
    saved = io.load_checkpoint(path, weights_only=False)
    seen = {}

    class Check(Callback):
        def on_train_start(self, trainer, pl_module):
            seen["step"] = trainer.global_step
            seen["weights"] = clone_tree(pl_module.state_dict())

    t = trainer(tmp_path, [io], [AsyncFinalizerCallback(), Check()], max_steps=14, enable_checkpointing=False)
    t.fit(TinyModel(width=96, layers=3), loader(width=96), ckpt_path=str(path))
    assert seen["step"] == 12
    assert_tree_equal(seen["weights"], clone_tree(dict(saved["state_dict"])))


@pytest.mark.parametrize(("engine", "worker"), combo_params(fast={("nvrx", "persistent")}, combos=[("nvrx", "persistent"), ("mcore", "fork")]))
def test_async_ddp_strategy_one_failing_rank_raises_on_every_rank(tmp_path, engine, worker):
    r0, r1 = run_job(tmp_path, "parallel_fail", engine, worker)
    _assert_failed_everywhere(r0, r1, "epoch=1-step=8.ckpt", "OSError", ranks=(1,))
    assert "rank 1" in r0["raised"]["message"] and "ENOSPC" in r0["raised"]["message"]


@pytest.mark.slow  # make test-all: kept out of make test for its 15-minute budget
@pytest.mark.parametrize(("engine", "worker"), combo_params(fast={("nvrx", "fork")}, combos=[("nvrx", "fork"), ("mcore", "persistent")]))
def test_checkpoint_from_one_rank_resumes_on_two(tmp_path, engine, worker):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from helpers import TinyModel, loader, trainer
    from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback

    io = AsyncCheckpointIO(engine, worker=worker)
    ck = ModelCheckpoint(dirpath=tmp_path / "one", every_n_train_steps=6, save_top_k=-1)
    trainer(tmp_path, [io], [AsyncFinalizerCallback(), ck], max_steps=6).fit(TinyModel(width=96, layers=3), loader(width=96))
    r0, r1 = run_job(tmp_path, "load1", engine, worker, dir=tmp_path / "one" / "epoch=0-step=6.ckpt")
    for r in (r0, r1):
        assert r["resume_exact"] and r["children_after_fit"] == []


@pytest.mark.slow  # make test-all: kept out of make test for its 15-minute budget
def test_async_ddp_strategy_local_failure_before_planning_does_not_hang(tmp_path):
    """A rank that fails before the collective planning must not leave the other ranks inside it."""
    r0, r1 = run_job(tmp_path, "parallel_snapfail", "nvrx", "persistent", timeout=120)
    _assert_failed_everywhere(r0, r1, "epoch=1-step=8.ckpt", "MemoryError", ranks=(1,))


@pytest.mark.slow  # make test-all: kept out of make test for its 15-minute budget
def test_ddp_lazy_snapshot_from_rank0_and_from_every_rank_is_exact(tmp_path):
    r0, r1 = run_job(tmp_path, "lazy", "nvrx", "persistent")
    files = ["epoch=0-step=8.ckpt", "epoch=1-step=12.ckpt", "last.ckpt"]
    assert r0["ddp_files"] == r1["ddp_files"] == r0["ddp_verified"] == files  # bit-exact against save-time copies
    lazy = 2 * 3 * 160 * 160 * 4  # two weights and their Adam moments, copied after the save call returned
    assert r0["ddp_lazy_bytes"] == [lazy] * 6 and r1["ddp_lazy_bytes"] == []  # rank 0 writes alone
    assert r0["parallel_files"] == r0["parallel_verified"] == files
    # collective: each rank copies its share (whole tensors, size-balanced) after the call returned
    shares = [r0["parallel_lazy_bytes"][i] + r1["parallel_lazy_bytes"][i] for i in range(6)]
    assert shares == [lazy] * 6 and all(r0["parallel_lazy_bytes"]) and all(r1["parallel_lazy_bytes"])
    for r in (r0, r1):
        assert r["ddp_children_after_fit"] == [] and r["parallel_children_after_fit"] == []


@pytest.mark.slow  # make test-all
def test_ddp_lazy_save_behind_a_write_in_flight_follows_it_on_every_rank(tmp_path):
    """AsyncDDPStrategy: the step-6 save is made while every rank's step-4 write is held; it takes no second
    staging copy anywhere, and both checkpoints (and the rest) are exact."""
    r0, r1 = run_job(tmp_path, "lazy_follow", "nvrx", "persistent", timeout=180)
    files = ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"]
    assert r0["files"] == r1["files"] == r0["verified"] == files  # bit-exact against save-time copies
    for r in (r0, r1):
        assert r["staged"]["pending"] == 2 and r["staged"]["both"] == r["staged"]["one"] > 0, r["staged"]
        assert len(r["lazy_bytes"]) == 4 and all(r["lazy_bytes"]), r["lazy_bytes"]
        assert r["children_after_fit"] == []


@pytest.mark.parametrize("case", ["lazy_torn", pytest.param("lazy_torn_parallel", marks=pytest.mark.slow)])
def test_ddp_lazy_snapshot_edited_after_the_save_fails_on_every_rank(tmp_path, case):
    r0, r1 = run_job(tmp_path, case, "nvrx", "persistent", timeout=120)
    rank = 1 if case == "lazy_torn_parallel" else 0
    _assert_failed_everywhere(r0, r1, "epoch=1-step=8.ckpt", "TornSnapshot", ranks=(rank,))
    torn = "'state_dict.net.0.weight'" if rank == 0 else "'state_dict.net."  # rank 1: a weight of its share
    assert torn in r0["raised"]["message"] and 'snapshot="eager"' in r1["raised"]["message"]
