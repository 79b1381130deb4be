"""AsyncModelParallelStrategy with FSDP2 on 2 gloo ranks (and 1), in real processes under hard timeouts."""

from __future__ import annotations

import pytest

from helpers import combo_params
from processes import run_ranks

JOB = "mp_job"
LAZY_JOB = "mp_lazy_job"




@pytest.mark.parametrize(("engine", "worker"), combo_params(fast={("nvrx", "persistent")}))
def test_fsdp2_shards_on_every_rank_and_stock_compatible_resume(tmp_path, engine, worker):
    r0, r1 = run_ranks(JOB, tmp_path, "fit", engine, worker)
    expected = ["epoch=1-step=12.ckpt", "epoch=1-step=16.ckpt", "last.ckpt"]
    assert r0["files"] == r1["files"] == expected  # top-2 and last, nothing left over
    for name, files in r0["layout"].items():
        # the stock ModelParallelStrategy layout: one shard file per rank, .metadata and meta.pt
        assert sorted(files) == [".asyncckpt.json", ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], name
        small, large = sorted((files["__0_0.distcp"], files["__1_0.distcp"]))
        assert large < 1.5 * small, (name, files)  # each rank wrote its own shards
        # every rank's record counts the bytes of all ranks; its own share is less
        for r in (r0, r1):
            nbytes, local = r["records"][name]
            assert nbytes == small + large and 0 < local < nbytes, (name, r["records"][name], files)
    # every checkpoint, read with torch.distributed.checkpoint alone, holds the full state of its step
    assert r0["verified"] == expected
    info = r0["info"]
    assert (info["engine"], info["worker"], info["layout"]) == (engine, worker, "sharded")
    assert (info["world_size"], info["writing_ranks"], info["global_step"]) == (2, 2, 16)
    for r in (r0, r1):
        assert r["complete_on_return"] and not any(r["complete_on_return"])  # written after save returned
        assert r["stock_resume_exact"] and r["resume_from_stock_exact"]
        assert r["children_after_fit"] == [] and r["children_after_resume"] == []


@pytest.mark.parametrize(
    ("engine", "worker"),
    [pytest.param("nvrx", "fork", id="nvrx-fork"), pytest.param("mcore", "persistent", id="mcore-persistent", marks=pytest.mark.slow)],
)
@pytest.mark.slow  # make test-all: kept out of make test for its 15-minute budget
def test_fsdp2_resharding_two_to_one_to_two(tmp_path, engine, worker):
    (r0, _) = run_ranks(JOB, tmp_path / "two", "save", engine, worker)
    assert r0["verified"]
    two = tmp_path / "two" / "out" / "c" / "epoch=1-step=12.ckpt"
    (one,) = run_ranks(JOB, tmp_path / "one", "resume1", engine, worker, ranks=1, dir=two)
    assert one["resume_exact"] and one["children_after_fit"] == []
    back = run_ranks(JOB, tmp_path / "back", "resume2", engine, worker, dir=one["saved"])
    for r in back:
        assert r["resume_exact"] and r["children_after_fit"] == []


@pytest.mark.slow  # make test-all: kept out of make test for its 15-minute budget
@pytest.mark.parametrize(("engine", "worker"), combo_params(fast={("nvrx", "fork")}, combos=[("nvrx", "fork"), ("mcore", "persistent")]))
def test_fsdp2_one_failing_rank_raises_on_every_rank(tmp_path, engine, worker):
    r0, r1 = run_ranks(JOB, tmp_path, "fail", engine, worker)
    for r in (r0, r1):
        raised = r["raised"]
        assert raised is not None, f"rank {r['rank']} did not raise"
        assert raised["ranks"] == [1] and raised["path"].endswith("step=8.ckpt") and "rank 1" in raised["message"]
        assert r["files"] == ["epoch=0-step=4.ckpt"]  # the committed one survives, nothing partial
        assert r["children_after_fit"] == []
    assert r0["global_step"] == r1["global_step"] < 40


@pytest.mark.slow  # make test-all: kept out of make test for its 15-minute budget
def test_fsdp2_save_after_fit_is_complete_when_it_returns(tmp_path):
    """``trainer.save_checkpoint`` after ``fit`` (the plugin is torn down): the ranks commit the sharded
    save together before it returns, with the final state; it was dropped before."""
    r0, r1 = run_ranks(JOB, tmp_path, "after_fit", "nvrx", "persistent")
    for r in (r0, r1):
        assert r["complete_on_return"] and r["children_after_save"] == []
    assert r0["verified"]


@pytest.mark.slow  # make test-all: kept out of make test for its 15-minute budget
def test_fsdp2_save_after_fit_failing_on_one_rank_raises_on_both(tmp_path):
    """The save after ``fit`` fails on rank 1 alone, after the ranks agreed to save: rank 0 must not wait
    for rank 1 in the commit; both raise the same error, and nothing is left at the path."""
    r0, r1 = run_ranks(JOB, tmp_path, "after_fit_fail", "nvrx", "fork", timeout=120)
    for r in (r0, r1):
        assert r["raised"] is not None, f"rank {r['rank']} did not raise"
        assert r["raised"]["ranks"] == [1] and r["raised"]["path"].endswith("final.ckpt")
        assert "No space left" in r["raised"]["message"]
        assert r["children_after_save"] == [] and not r["final_exists"] and r["leftovers"] == []


@pytest.mark.slow  # make test-all: kept out of make test for its 15-minute budget
def test_fsdp2_a_sharded_save_in_flight_lands_when_every_rank_dies(tmp_path):
    """The ranks commit the sharded save they were writing together, on the way out of an error raised
    on every rank (over a gloo group whose collectives give up if a rank never comes)."""
    r0, r1 = run_ranks(JOB, tmp_path, "die", "nvrx", "persistent")
    for r in (r0, r1):
        assert r["raised"] == f"boom on rank {r['rank']}"
        assert r["files"] == ["epoch=0-step=4.ckpt"] and r["history"] == ["epoch=0-step=4.ckpt"]
        assert r["children_after_fit"] == []
        assert r["exit_group_at_start"]
    assert r0["verified"]


def test_fsdp2_lazy_snapshot_with_gradient_accumulation_is_exact(tmp_path):
    """snapshot="lazy" on sharded saves: each rank's local shards are copied after the save call returned,
    while the next steps (two micro-batches each) run; every checkpoint holds the state of its step."""
    r0, r1 = run_ranks(LAZY_JOB, tmp_path, "lazy", "nvrx", "persistent")
    expected = ["epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    assert r0["files"] == r1["files"] == r0["verified"] == expected
    for r in (r0, r1):
        # per save: this rank's shards of two 256x256 weights and their two Adam moments
        assert r["lazy_bytes"] == [2 * 3 * 128 * 256 * 4] * 6, r["lazy_bytes"]
        assert r["children_after_fit"] == []


@pytest.mark.slow  # make test-all
def test_fsdp2_lazy_save_behind_a_write_in_flight_follows_it_on_every_rank(tmp_path):
    """Sharded saves: the step-6 save is made while every rank's step-4 write is held; no rank takes a second
    staging copy, and every checkpoint (read with plain DCP) holds its own step's state."""
    r0, r1 = run_ranks(LAZY_JOB, tmp_path, "lazy_follow", "nvrx", "persistent")
    expected = ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"]
    assert r0["files"] == r1["files"] == r0["verified"] == expected
    for r in (r0, r1):
        assert r["staged"]["pending"] == 2 and r["staged"]["both"] == r["staged"]["one"] > 0, r["staged"]
        assert r["lazy_bytes"] == [2 * 3 * 128 * 256 * 4] * 4, r["lazy_bytes"]
        assert r["children_after_fit"] == []


@pytest.mark.slow  # make test-all: make test's budget; make test proves torn detection with DDP (test_ddp.py)
@pytest.mark.parametrize("edit", ["local_shard", "dtensor"])
def test_fsdp2_lazy_shard_edited_after_the_save_fails_on_every_rank(tmp_path, monkeypatch, edit):
    if edit == "dtensor":
        monkeypatch.setenv("EDIT_AS_DTENSOR", "1")
    r0, r1 = run_ranks(LAZY_JOB, tmp_path, "lazy_torn", "nvrx", "persistent")
    for r in (r0, r1):
        raised = r["raised"]
        assert raised is not None and raised["ranks"] == [1] and raised["error_type"] == "TornSnapshot", raised
        assert raised["path"].endswith("epoch=0-step=8.ckpt"), raised
        assert 'snapshot="eager"' in raised["message"]
        assert r["children_after_fit"] == []
    assert r0["files"] == r1["files"] == ["epoch=0-step=4.ckpt"]  # the torn save is nowhere; the earlier one stays
