"""The plugin under Lightning's Trainer on one device, when a save fails or training stops early: a full
disk or a killed worker stops training within steps of the failed save; a user's exception is not masked;
a save in flight is committed on the way out of an error, Ctrl-C or SIGTERM (unless ``drain_timeout_s=0``);
Lightning's SLURM requeue save is on disk before the requeue.
"""

import os
import signal
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import (
    SlowSteps,
    SnapshotRecorder,
    TinyModel,
    assert_tree_equal,
    dir_entries,
    latest_raise_step,
    loader,
    slurm_job,
    trainer,
)
from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback, CheckpointWriteError, testing
from lightning_asyncckpt.storage import commit
from processes import live_children


class _FillDisk(L.Callback):
    def __init__(self, mnt, at_step):
        self.mnt, self.at_step = mnt, at_step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.at_step:
            trainer.strategy.checkpoint_io.finalize(blocking=True)  # the earlier save is committed first
            st = os.statvfs(self.mnt)
            with open(self.mnt / "filler", "wb") as f:
                f.write(b"\0" * (st.f_bavail * st.f_frsize - 4096))


def test_real_disk_full_stops_training(engine_worker, small_tmpfs, tmp_path):
    engine, worker = engine_worker
    io = AsyncCheckpointIO(engine, worker=worker)
    ck = ModelCheckpoint(dirpath=small_tmpfs / "c", every_n_train_steps=4, save_top_k=1, monitor="step", mode="max")
    cbs = [AsyncFinalizerCallback(), SlowSteps(), _FillDisk(small_tmpfs, at_step=6), ck]
    t = trainer(tmp_path, [io], cbs, max_steps=40)
    with pytest.raises(CheckpointWriteError) as exc_info:
        t.fit(TinyModel(width=128), loader(width=128))
    err = exc_info.value
    assert err.errno == 28 and "ENOSPC" in str(err) and err.path.endswith("epoch=0-step=8.ckpt")
    assert 8 <= t.global_step <= latest_raise_step(8), t.global_step  # stopped within steps of the failure
    assert live_children() == []
    (small_tmpfs / "filler").unlink()
    assert dir_entries(small_tmpfs / "c") == ["epoch=0-step=4.ckpt"]  # nothing partial, nothing left over
    assert io.load_checkpoint(small_tmpfs / "c" / "epoch=0-step=4.ckpt")["global_step"] == 4


def test_killed_worker_stops_training(engine_worker, tmp_path, hold):
    engine, worker = engine_worker
    io = AsyncCheckpointIO(engine, worker=worker)
    io.write_hook = hold  # never released: the step-4 write is in flight when its worker is killed

    class Kill(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step == 5:
                hold.wait_started()
                for pid in io.session.worker_pids():
                    os.kill(pid, signal.SIGKILL)

    ck = ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=4, save_top_k=-1)
    t = trainer(tmp_path, [io], [AsyncFinalizerCallback(), SlowSteps(), Kill(), ck], max_steps=40)
    with pytest.raises(CheckpointWriteError, match="SIGKILL") as exc_info:
        t.fit(TinyModel(), loader())
    assert exc_info.value.path.endswith("epoch=0-step=4.ckpt")
    assert 5 <= t.global_step <= latest_raise_step(4), t.global_step  # stopped within steps of the failure
    assert not (tmp_path / "c").exists() or dir_entries(tmp_path / "c") == []


def test_user_exception_is_not_masked_and_workers_stop(engine_worker, tmp_path):
    engine, worker = engine_worker
    io = AsyncCheckpointIO(engine, worker=worker)
    io.write_hook = testing.FailWrite()  # a failing save is pending when the user's code raises

    class Boom(TinyModel):
        def training_step(self, batch, batch_idx):
            if self.global_step == 5:
                raise ValueError("boom in training_step")
            return super().training_step(batch, batch_idx)

    # the step-5 save is scheduled after the finalizer's batch-end hook (checkpoint callbacks run last), and
    # the next training_step raises: the failing write is still pending
    ck = ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=5, save_top_k=-1)
    t = trainer(tmp_path, [io], [ck], max_steps=20)
    with pytest.raises(ValueError, match="boom in training_step"):
        t.fit(Boom(), loader())
    assert live_children() == []
    assert not (tmp_path / "c").exists() or dir_entries(tmp_path / "c") == []


class _DiesAtStep(TinyModel):
    """Training dies at global step ``at``: a Python error, Ctrl-C, or a SIGTERM (a preemption), which
    Lightning turns into ``SIGTERMException`` at the end of the batch."""

    def __init__(self, how: str, at: int = 7, **kw):
        super().__init__(**kw)
        self.how, self.at = how, at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.at:
            if self.how == "error":
                raise ValueError("boom in training_step")
            if self.how == "ctrl-c":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


class _ReleaseOnException(L.Callback):
    """Lets a held write go when training dies, before the finalizer's own ``on_exception`` (list it first)."""

    def __init__(self, hold):
        self.hold = hold

    def on_exception(self, trainer, pl_module, exception):
        self.hold.release()


@pytest.mark.parametrize("how", ["error", "ctrl-c", "sigterm"])
def test_a_save_in_flight_lands_when_training_dies(engine_worker, tmp_path, how, caplog, hold):
    """A checkpoint scheduled before a crash, Ctrl-C or preemption is committed on the way out (as a
    synchronous save would be on disk), and the original exception still propagates."""
    engine, worker = engine_worker
    io = AsyncCheckpointIO(engine, worker=worker)
    io.write_hook = hold  # the step-5 write is still running when step 7 dies
    rec = SnapshotRecorder()
    ck = ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=5, save_top_k=-1)
    t = trainer(tmp_path, [io], [_ReleaseOnException(hold), AsyncFinalizerCallback(), rec, ck], max_steps=20)
    expected = ValueError if how == "error" else SystemExit  # Lightning exits on Ctrl-C and SIGTERM
    try:
        with pytest.raises(expected), caplog.at_level("WARNING", logger="lightning_asyncckpt"):
            t.fit(_DiesAtStep(how), loader())
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignores SIGINT while it exits
    assert live_children() == []
    assert dir_entries(tmp_path / "c") == ["epoch=0-step=5.ckpt"]
    path = tmp_path / "c" / "epoch=0-step=5.ckpt"
    assert commit.is_complete(path)
    loaded = io.load_checkpoint(path, weights_only=False)
    assert_tree_equal({"state_dict": loaded["state_dict"], "optimizer_states": loaded["optimizer_states"]},
                      rec.copies[5])
    assert "1 of 1 checkpoint write(s) in flight committed before stopping" in caplog.text
    io.teardown()


def test_drain_timeout_zero_drops_the_save_in_flight(tmp_path, hold):
    io = AsyncCheckpointIO("nvrx", worker="persistent", drain_timeout_s=0)
    io.write_hook = hold  # never released: the step-5 write is in flight when training dies
    ck = ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=5, save_top_k=-1)
    t = trainer(tmp_path, [io], [AsyncFinalizerCallback(), ck], max_steps=20)
    with pytest.raises(ValueError, match="boom"):
        t.fit(_DiesAtStep("error"), loader())
    assert live_children() == []
    assert dir_entries(tmp_path / "c") == []  # no partial directory either
    with pytest.raises(ValueError, match="drain_timeout_s"):
        AsyncCheckpointIO("nvrx", drain_timeout_s=-1)


class _RequeueSignalAt(L.Callback):
    """Sends SLURM's requeue signal (SIGUSR1) to this process at ``step``; Lightning's handler saves
    ``hpc_ckpt_1.ckpt`` and requeues the job before ``os.kill`` returns. Records whether that checkpoint
    was on disk, complete, by then (the requeue stops the job soon after)."""

    def __init__(self, step):
        self.step, self.complete_after_handler = step, None

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)
            self.complete_after_handler = commit.is_complete(_hpc_path(trainer))


def _hpc_path(trainer):
    return Path(trainer.default_root_dir) / "hpc_ckpt_1.ckpt"


def test_slurm_requeue_save_is_on_disk_before_the_requeue(tmp_path, monkeypatch, caplog):
    """Lightning's SLURM auto-requeue saves ``hpc_ckpt_<N>.ckpt`` and runs ``scontrol requeue`` right
    after, which stops the job: the write must be finished and committed before that, not in flight."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    slurm_job(monkeypatch, tmp_path)
    io = AsyncCheckpointIO("nvrx", worker="persistent")
    io.write_hook = testing.DelayWrite(1.0)
    rec = SnapshotRecorder()
    requeue = _RequeueSignalAt(3)
    t = trainer(tmp_path, [io, SLURMEnvironment(auto_requeue=True)], [AsyncFinalizerCallback(), rec, requeue],
                max_steps=6, enable_checkpointing=False)
    old_handler = signal.getsignal(signal.SIGUSR1)
    try:
        with caplog.at_level("INFO", logger="lightning_asyncckpt"):
            t.fit(TinyModel(), loader())
    finally:
        signal.signal(signal.SIGUSR1, old_handler)
    assert requeue.complete_after_handler
    loaded = io.load_checkpoint(_hpc_path(t), weights_only=False)
    assert_tree_equal({"state_dict": loaded["state_dict"], "optimizer_states": loaded["optimizer_states"]},
                      rec.copies[3])
    assert "waiting for 1 checkpoint write(s) before going on" in caplog.text
    assert live_children() == []
