"""Fabric with `strategy="ddp"` and the plugin: two gloo ranks in real processes, under hard timeouts."""

from __future__ import annotations

import os

import pytest

from helpers import combo_params, run_ranks

JOB = os.path.join(os.path.dirname(__file__), "fabric_job.py")


@pytest.mark.parametrize(("engine", "worker"), combo_params())
def test_fabric_save_finalize_load_is_exact(tmp_path, engine, worker):
    r0, r1 = run_ranks(JOB, tmp_path, "exact", engine, worker)
    for r in (r0, r1):
        assert r["complete_right_after_save"] is False  # fabric.save returned before the write was done
        assert r["loaded_exact"] is True  # model, optimizer and plain values, on both ranks
        assert r["remainder"] == []
        assert r["children_after_exit"] == []  # leaving the `with io:` block stopped the worker


@pytest.mark.parametrize(("engine", "worker"), [("nvrx", "fork"), ("mcore", "persistent")], ids=["nvrx-fork", "mcore-persistent"])
def test_fabric_failed_write_raises_on_both_ranks(tmp_path, engine, worker):
    r0, r1 = run_ranks(JOB, tmp_path, "fail", engine, worker)
    for r in (r0, r1):
        assert r["raised"] is not None, f"rank {r['rank']} did not raise"
        assert r["raised"]["path"].endswith("bad") and r["raised"]["ranks"] == [0] and r["raised"]["errno"] == 28
        assert r["files"] == ["good"]
        assert r["children_after_exit"] == []
    assert r0["raised_at_step"] == r1["raised_at_step"]


@pytest.mark.parametrize(("engine", "worker"), [("nvrx", "persistent"), ("mcore", "fork")], ids=["nvrx-persistent", "mcore-fork"])
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


@pytest.mark.parametrize(("engine", "worker"), [("nvrx", "fork"), ("mcore", "persistent")], ids=["nvrx-fork", "mcore-persistent"])
def test_fabric_sharded_failing_rank_raises_on_both_ranks(tmp_path, engine, worker):
    r0, r1 = run_ranks(JOB, tmp_path, "sharded_fail", engine, worker)
    for r in (r0, r1):
        assert r["raised"] is not None, f"rank {r['rank']} did not raise"
        assert r["raised"]["path"].endswith("bad") and r["raised"]["ranks"] == [1]
        assert r["files"] == ["good"]
        assert r["children_after_exit"] == []
    assert r0["raised_at_step"] == r1["raised_at_step"]
