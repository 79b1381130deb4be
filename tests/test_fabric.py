"""Fabric with `strategy="ddp"` and the plugin: two gloo ranks in real processes, under hard timeouts."""

from __future__ import annotations

import os

import pytest

from helpers import combo_params
from processes import run_ranks

JOB = "fabric_job"


# one combination in make test (the engines' single-writer path runs there in test_io); all four in make test-all
@pytest.mark.parametrize(("engine", "worker"), combo_params(fast={("nvrx", "persistent")}))
def test_fabric_save_finalize_load_is_exact(tmp_path, engine, worker):
    r0, r1 = run_ranks(JOB, tmp_path, "exact", engine, worker)
    for r in (r0, r1):
        assert r["complete_right_after_save"] is False  # fabric.save returned before the write was done
        assert r["loaded_exact"] is True  # model, optimizer and plain values, on both ranks
        assert r["remainder"] == []
        assert r["children_after_exit"] == []  # leaving the `with io:` block stopped the worker


def test_fabric_load_right_after_save_waits_for_rank_0s_write_on_every_rank(tmp_path):
    """Lightning's own ``test_ddp_save_load`` with the plugin: ``fabric.save`` then ``fabric.load`` on both
    ranks at once, no finalize between; before, rank 1 found no file (``FileNotFoundError``)."""
    r0, r1 = run_ranks(JOB, tmp_path, "load_right_after_save", "nvrx", "persistent")
    assert r0["loaded_exact"] is True and r1["loaded_exact"] is True


@pytest.mark.slow  # make test-all: kept out of make test for its 15-minute budget
@pytest.mark.parametrize(("engine", "worker"), [("nvrx", "fork"), pytest.param("mcore", "persistent", marks=pytest.mark.slow)],
                         ids=["nvrx-fork", "mcore-persistent"])
def test_fabric_failed_write_raises_on_both_ranks(tmp_path, engine, worker):
    r0, r1 = run_ranks(JOB, tmp_path, "fail", engine, worker)
    for r in (r0, r1):
        assert r["raised"] is not None, f"rank {r['rank']} did not raise"
        assert r["raised"]["path"].endswith("bad") and r["raised"]["ranks"] == [0] and r["raised"]["errno"] == 28
        assert r["files"] == ["good"]
        assert r["children_after_exit"] == []
    assert r0["raised_at_step"] == r1["raised_at_step"]


@pytest.mark.parametrize(("engine", "worker"), [("nvrx", "persistent"), pytest.param("mcore", "fork", marks=pytest.mark.slow)],
                         ids=["nvrx-persistent", "mcore-fork"])
def test_fabric_sharded_save_finalize_load_is_exact(tmp_path, engine, worker):
    r0, r1 = run_ranks(JOB, tmp_path, "sharded", engine, worker)
    for r in (r0, r1):
        assert r["complete_right_after_save"] is False  # fabric.save returned before the write was done
        assert r["files"] == [".asyncckpt.json", ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]  # Fabric's layout + who wrote it
        assert r["loaded_exact"] is True and r["remainder"] == ["note"]
        # finalize() returned the save's record once, with the bytes of both ranks' shard files
        [(name, step, nbytes, local, keys)] = r["records"]
        assert name == "step-5" and step == 5
        assert nbytes == r["sizes"]["__0_0.distcp"] + r["sizes"]["__1_0.distcp"] and 0 < local < nbytes
        assert keys == sorted(f"asyncckpt/{k}" for k in ("stall_seconds", "write_seconds", "bytes_written",
                                                         "write_gb_per_second", "pending_saves"))
        assert r["children_after_exit"] == []


# make test-all only (make test's time): one failing rank raised on every rank runs in make test for DDP,
# AsyncDDPStrategy and FSDP2 under the Trainer
@pytest.mark.parametrize(("engine", "worker"), combo_params(fast=set(), combos=[("nvrx", "fork"), ("mcore", "persistent")]))
def test_fabric_sharded_failing_rank_raises_on_both_ranks(tmp_path, engine, worker):
    r0, r1 = run_ranks(JOB, tmp_path, "sharded_fail", engine, worker)
    for r in (r0, r1):
        assert r["raised"] is not None, f"rank {r['rank']} did not raise"
        assert r["raised"]["path"].endswith("bad") and r["raised"]["ranks"] == [1]
        assert r["files"] == ["good"]
        assert r["children_after_exit"] == []
    assert r0["raised_at_step"] == r1["raised_at_step"]


def test_fabric_sharded_save_lands_when_the_script_just_ends(tmp_path):
    """Both ranks leave right after a sharded save, without finalize or teardown: at interpreter exit they
    commit it together, and it holds the state of its step."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from helpers import assert_tree_equal
    from lightning_asyncckpt.storage import commit

    r0, r1 = run_ranks(JOB, tmp_path, "sharded_exit", "nvrx", "persistent")
    assert r0["complete_right_after_save"] is False and r1["complete_right_after_save"] is False
    out = tmp_path / "out"
    path = out / "ckpt" / "step-5"
    assert commit.is_complete(path), sorted(os.listdir(out / "ckpt"))
    assert sorted(os.listdir(out / "ckpt")) == ["step-5"]  # nothing partial
    dcp_to_torch_save(path, out / "read.pt")
    got = torch.load(out / "read.pt", weights_only=False)
    assert torch.load(path / "meta.pt", weights_only=False)["step"] == 5  # Fabric keeps non-tensors there
    expected = torch.load(out / "expected_model.pt", weights_only=False)
    assert_tree_equal({k: got["model"][k] for k in sorted(got["model"])}, expected, "model")
    assert "1 of 1 checkpoint write(s) in flight committed before stopping" in (out / "log.txt").read_text()


def test_fabric_sharded_drain_gives_up_when_a_rank_never_comes(tmp_path):
    """Rank 0 leaves through an exception with a sharded save in flight; rank 1 never joins the commit.
    Rank 0 stops waiting when the exit group's collective times out and drops the save (under the job's
    hard timeout: a hang fails the test)."""
    r0, r1 = run_ranks(JOB, tmp_path, "sharded_abandoned", "nvrx", "persistent")
    assert r0["raised"] == "boom on rank 0" and r1["left"]
    assert r0["files"] == []  # dropped, nothing partial
    assert r0["had_worker"] and r0["workers_left"] == []
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "not every rank could commit the saves in flight" in log
