"""Remote checkpoint paths against a real S3-protocol server (moto, on loopback; see ``s3server.py``)."""

from __future__ import annotations

import io as _io
import os

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import SnapshotRecorder, TinyModel, assert_tree_equal, loader, trainer
from lightning_asyncckpt import (
    AsyncCheckpointIO,
    AsyncFinalizerCallback,
    CheckpointWriteError,
    last_checkpoint,
)
from lightning_asyncckpt.storage import remote
from processes import run_ranks

URL = "s3://ckpt/run1"


def _objects(s3, prefix="ckpt/run1"):
    s3.fs.invalidate_cache()
    return sorted(os.path.basename(p) for p in s3.fs.ls(prefix)) if s3.fs.exists(prefix) else []


def _load(s3, url):
    s3.fs.invalidate_cache()
    with s3.fs.open(url, "rb") as f:
        return torch.load(_io.BytesIO(f.read()), weights_only=False)


def _uploads(s3):
    """(pid, method, path) of every request that writes a checkpoint object (a PUT, or a multipart step)."""
    return [(who, m, p) for m, p, who in s3.requests()
            if m in ("PUT", "POST") and p.startswith("/ckpt/run1/") and "?delete" not in p]


@pytest.mark.parametrize("worker", ["persistent", pytest.param("fork", marks=pytest.mark.slow)])
def test_trainer_top_k_last_resume_and_load_from_s3(tmp_path, s3, worker):
    """The full Trainer flow on S3: top-k removals, ``last``, resume with ``ckpt_path="last"``,
    ``load_from_checkpoint`` from the URL; every byte is uploaded by the worker, none by the trainer."""
    io = AsyncCheckpointIO(worker=worker)
    rec = SnapshotRecorder()
    ck = ModelCheckpoint(dirpath=URL, monitor="step", mode="max", save_top_k=2, every_n_train_steps=2, save_last=True)
    t = trainer(tmp_path, [io], [AsyncFinalizerCallback(), rec, ck], max_steps=8)
    t.fit(TinyModel(width=32), loader(width=32, n=64))
    assert _objects(s3) == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    for name, step in (("epoch=0-step=6.ckpt", 6), ("epoch=0-step=8.ckpt", 8), ("last.ckpt", 8)):
        got = _load(s3, f"{URL}/{name}")
        assert got["global_step"] == step
        assert_tree_equal({"state_dict": got["state_dict"], "optimizer_states": got["optimizer_states"]},
                          rec.copies[step], name)
    uploads = _uploads(s3)
    assert uploads and all(who not in (None, os.getpid()) for who, _, _ in uploads), uploads  # by the worker

    model = TinyModel.load_from_checkpoint(f"{URL}/epoch=0-step=8.ckpt")
    assert_tree_equal(dict(model.state_dict()), rec.copies[8]["state_dict"], "load_from_checkpoint")

    io2 = AsyncCheckpointIO(worker=worker)
    ck2 = ModelCheckpoint(dirpath=URL, monitor="step", mode="max", save_top_k=2, every_n_train_steps=2, save_last=True)
    started = []

    class AtStart(SnapshotRecorder):
        def on_train_start(self, trainer, pl_module):
            started.append(trainer.global_step)

    t2 = trainer(tmp_path, [io2], [AsyncFinalizerCallback(), AtStart(), ck2], max_steps=12)
    assert last_checkpoint(URL) == f"{URL}/last.ckpt"
    t2.fit(TinyModel(width=32), loader(width=32, n=64), ckpt_path="last")  # stock finds nothing on S3 here
    assert started == [8]
    assert _objects(s3) == ["epoch=1-step=10.ckpt", "epoch=1-step=12.ckpt", "last.ckpt"]
    assert _load(s3, f"{URL}/last.ckpt")["global_step"] == 12


def test_a_server_error_is_a_write_error_and_keeps_the_checkpoint_there(s3):
    io = AsyncCheckpointIO()
    with io:
        io.save_checkpoint({"step": 1, "w": torch.ones(1000)}, f"{URL}/last.ckpt")
        io.finalize(blocking=True)
        s3.fail_writes.set()
        io.save_checkpoint({"step": 2, "w": torch.zeros(1000)}, f"{URL}/last.ckpt")
        with pytest.raises(CheckpointWriteError, match=r"(?s)s3://ckpt/run1/last.ckpt.*injected") as e:
            io.finalize(blocking=True)
        assert "s3://ckpt/run1/last.ckpt" in str(e.value)
        s3.fail_writes.clear()
        assert _objects(s3) == ["last.ckpt"]
        assert _load(s3, f"{URL}/last.ckpt")["step"] == 1  # the failed upload never became visible
        io.save_checkpoint({"step": 3, "w": torch.ones(1000)}, f"{URL}/last.ckpt")  # and saving goes on
        io.finalize(blocking=True)
    assert _load(s3, f"{URL}/last.ckpt")["step"] == 3


def test_a_bucket_deleted_mid_run_is_a_write_error(s3):
    io = AsyncCheckpointIO()
    with io:
        io.save_checkpoint({"step": 1}, f"{URL}/a.ckpt")
        io.finalize(blocking=True)
        s3.fs.rm("ckpt", recursive=True)
        s3.fs.invalidate_cache()
        assert not s3.fs.exists("ckpt")
        io.save_checkpoint({"step": 2}, f"{URL}/b.ckpt")
        with pytest.raises(CheckpointWriteError, match="NoSuchBucket|bucket does not exist|not exist"):
            io.finalize(blocking=True)


def test_bad_remote_paths_fail_at_save_time_and_lose_nothing(s3):
    io = AsyncCheckpointIO()
    with io:
        io.save_checkpoint({"step": 1}, f"{URL}/a.ckpt")
        io.finalize(blocking=True)
        with pytest.raises(CheckpointWriteError, match=r"'s3://no-such-bucket/run1'.*bucket 'no-such-bucket' does not exist"):
            io.save_checkpoint({"step": 2}, "s3://no-such-bucket/run1/a.ckpt")
        with pytest.raises(ImportError, match=r"'gs://b/a.ckpt'.*pip install gcsfs"):
            io.save_checkpoint({"step": 2}, "gs://b/a.ckpt")
        with pytest.raises(ValueError, match=r"'memory://b/a.ckpt'.*cannot reach"):
            io.save_checkpoint({"step": 2}, "memory://b/a.ckpt")
    assert _objects(s3) == ["a.ckpt"]
    assert _load(s3, f"{URL}/a.ckpt")["step"] == 1


def test_a_dcp_directory_on_s3_is_complete_only_with_its_metadata_and_loads(s3, hold):
    state = {"step": 1, "w": torch.arange(1000.0), "nested": {"b": torch.ones(3, dtype=torch.bfloat16)}}
    io = AsyncCheckpointIO(format="dcp")
    with io:
        io.write_hook = hold
        io.save_checkpoint(state, f"{URL}/d.ckpt")
        assert _objects(s3) == []  # held in the worker: nothing uploaded yet
        hold.release()
        io.finalize(blocking=True)
        names = _objects(s3, "ckpt/run1/d.ckpt")
        assert ".metadata" in names and any(n.endswith(".distcp") for n in names), names
        got = io.load_checkpoint(f"{URL}/d.ckpt")
        assert got["step"] == 1 and torch.equal(got["w"], state["w"]) and torch.equal(got["nested"]["b"], state["nested"]["b"])
        io.write_hook = None
        io.save_checkpoint({**state, "step": 2, "w": state["w"] + 1}, f"{URL}/d.ckpt")  # replaced in place
        io.finalize(blocking=True)
        got = io.load_checkpoint(f"{URL}/d.ckpt")
        assert got["step"] == 2 and torch.equal(got["w"], state["w"] + 1)
    # spool emptied of this process's parts (their names carry its pid; other tests may spool beside it)
    spool = remote.spool_root()
    assert not [p for p in spool.glob("*") if f".{os.getpid()}." in p.name] if spool.exists() else True
    s3.fs.rm(f"ckpt/run1/d.ckpt/{remote.METADATA}")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        AsyncCheckpointIO().load_checkpoint(f"{URL}/d.ckpt")


def test_load_checkpoint_reads_a_url_after_its_save_commits(s3):
    io = AsyncCheckpointIO()
    with io:
        io.save_checkpoint({"step": 7, "w": torch.arange(10.0)}, f"{URL}/x.ckpt")
        got = io.load_checkpoint(f"{URL}/x.ckpt")  # waits for the save first
        assert got["step"] == 7 and torch.equal(got["w"], torch.arange(10.0))
        assert io.history[-1].path == f"{URL}/x.ckpt"


@pytest.mark.slow  # the single-writer path of the tests above, under DDP (make test-all)
def test_ddp_save_to_s3(tmp_path, s3):
    r0, r1 = run_ranks("ddp_job", tmp_path, "remote", "nvrx", "persistent", dir=URL)
    assert r0["objects"] == r1["objects"] == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    assert r0["last_step"] == 8


@pytest.mark.slow  # make test-all: every rank's spooled upload runs in make test too, in the sharded case below
def test_async_ddp_strategy_every_rank_writes_to_s3(tmp_path, s3):
    r0, r1 = run_ranks("ddp_job", tmp_path, "remote_dcp", "nvrx", "persistent", dir=URL)
    assert r0["objects"] == r1["objects"] == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    assert r0["verified"] == r1["verified"] == r0["objects"]  # bit-exact against the state at each save
    assert r0["resumed_at"] == r1["resumed_at"] == [8]


def test_sharded_saves_to_s3_read_with_plain_dcp_and_resume(tmp_path, s3):
    r0, r1 = run_ranks("mp_job", tmp_path, "remote", "nvrx", "persistent", dir=URL, timeout=300)
    assert r0["objects"] == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    assert r0["verified"] == r0["objects"]
    assert r0["last"] == f"{URL}/last.ckpt"
    assert r0["resume_exact"] and r1["resume_exact"]


@pytest.mark.timeout(180)
def test_a_dcp_directory_is_published_off_the_training_thread(s3):
    """The commit's ``.metadata`` upload is held at the server: finalize keeps returning, the checkpoint
    is pending (and incomplete) meanwhile, and is recorded once the upload ends."""
    held, release = s3.hold_puts("/.metadata")
    io = AsyncCheckpointIO(format="dcp")
    with io:
        io.save_checkpoint({"step": 1, "w": torch.ones(100)}, f"{URL}/d.ckpt")
        while not held.is_set():  # each call returns: a finalize that uploaded itself would wait here
            io.finalize(blocking=False)
            held.wait(0.05)
        assert io.session.num_pending == 1 and io.history == []
        assert ".metadata" not in _objects(s3, "ckpt/run1/d.ckpt")
        release.set()
        io.finalize(blocking=True)
        assert [r.path for r in io.history] == [f"{URL}/d.ckpt"] and io.session.num_pending == 0
    assert ".metadata" in _objects(s3, "ckpt/run1/d.ckpt")
