"""The plugin under Lightning's Trainer on one device: real engine queues, real workers, real files."""

import os
import re
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import (
    SlowSteps,
    SnapshotRecorder,
    TinyModel,
    assert_tree_equal,
    clone_tree,
    dir_entries,
    latest_raise_step,
    live_children,
    loader,
    trainer,
)
from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback, CheckpointWriteError, testing
from lightning_asyncckpt.format import commit
from lightning_asyncckpt.write import torch_file


def _ckpt_cb(dirpath, save_last=True, every=5):
    return ModelCheckpoint(
        dirpath=dirpath, monitor="step", mode="max", save_top_k=2, every_n_train_steps=every, save_last=save_last
    )


class _CommitLog:
    """Records publishes and removals of final checkpoint paths, in order (wraps the real functions)."""

    def __init__(self, monkeypatch):
        self.events = []
        publish, publish_file, remove = commit.publish, torch_file.publish_file, commit.remove_path

        def logged_publish(tmp, path):
            (publish_file if path.suffix and tmp.is_file() else publish)(tmp, path)
            self.events.append(("publish", path.name))

        def logged_remove(path):
            if not commit.is_leftover(path.name):
                self.events.append(("remove", path.name))
            remove(path)

        monkeypatch.setattr(commit, "publish", logged_publish)
        monkeypatch.setattr(torch_file, "publish_file", logged_publish)
        monkeypatch.setattr(commit, "remove_path", logged_remove)


def _step(name):
    return int(name.split("step=")[1].split(".")[0].split("-")[0])


@pytest.mark.parametrize("save_last", [True, "link"])
def test_model_checkpoint_top_k_last_and_snapshots(engine_worker, tmp_path, monkeypatch, save_last):
    engine, worker = engine_worker
    io = AsyncCheckpointIO(engine, worker=worker)
    io.write_hook = testing.DelayWrite(0.15)  # every write outlasts several training steps
    log = _CommitLog(monkeypatch)
    rec = SnapshotRecorder()
    ck = _ckpt_cb(tmp_path / "ckpts", save_last=save_last)
    t = trainer(tmp_path, [io], [AsyncFinalizerCallback(), rec, ck], max_steps=40)
    t.fit(TinyModel(width=256, layers=3), loader(width=256, n=128))
    assert live_children() == []  # no worker outlives fit

    assert rec.steps_while_pending >= 4, "the writes should overlap training steps"
    names = dir_entries(tmp_path / "ckpts")
    assert names == ["epoch=2-step=35.ckpt", "epoch=2-step=40.ckpt", "last.ckpt"]
    for name in names:
        path = tmp_path / "ckpts" / name
        assert commit.is_complete(path)
        loaded = io.load_checkpoint(path, weights_only=False)
        step = loaded["global_step"]
        assert step == (40 if name == "last.ckpt" else _step(name))
        got = {"state_dict": loaded["state_dict"], "optimizer_states": loaded["optimizer_states"]}
        assert_tree_equal(got, rec.copies[step], f"{name}")  # bit for bit the state at save time
    if save_last == "link":
        assert os.readlink(tmp_path / "ckpts" / "last.ckpt").endswith("epoch=2-step=40.ckpt")

    # an old checkpoint is removed only after a newer one was committed
    published = set()
    for kind, name in log.events:
        if kind == "publish":
            published.add(name)
        else:
            assert any(p != "last.ckpt" and _step(p) > _step(name) for p in published), (name, log.events)
    io.teardown()


def test_resume_continues_exactly(engine_worker, tmp_path):
    engine, worker = engine_worker
    data = dict(width=32, n=64, batch_size=8)  # 8 steps per epoch: checkpoints at epoch ends

    L.seed_everything(7)
    full = TinyModel(width=32)
    io_a = AsyncCheckpointIO(engine, worker=worker)
    ck = ModelCheckpoint(dirpath=tmp_path / "a", every_n_train_steps=8, save_top_k=-1)
    trainer(tmp_path, [io_a], [AsyncFinalizerCallback(), ck], max_steps=16).fit(full, loader(**data))
    final = clone_tree(full.state_dict())

    L.seed_everything(123)
    resumed = TinyModel(width=32)
    io_b = AsyncCheckpointIO(engine, worker=worker)
    start = {}

    class Check(L.Callback):
        def on_train_start(self, trainer, pl_module):
            start["step"] = trainer.global_step
            start["weights"] = clone_tree(pl_module.state_dict())
            start["optim"] = clone_tree(trainer.optimizers[0].state_dict()["state"])

    t = trainer(tmp_path, [io_b], [AsyncFinalizerCallback(), Check()], max_steps=16, enable_checkpointing=False)
    t.fit(resumed, loader(**data), ckpt_path=str(tmp_path / "a" / "epoch=0-step=8.ckpt"))
    saved = io_b.load_checkpoint(tmp_path / "a" / "epoch=0-step=8.ckpt", weights_only=False)
    assert start["step"] == 8 == saved["global_step"]
    assert_tree_equal(start["weights"], clone_tree(dict(saved["state_dict"])))
    assert_tree_equal(start["optim"], saved["optimizer_states"][0]["state"])
    assert t.global_step == 16
    assert_tree_equal(clone_tree(resumed.state_dict()), final)  # identical to the uninterrupted run


@pytest.mark.slow  # make test-all: kept out of make test for its 15-minute budget
def test_fit_twice_then_validate_and_test(engine_worker, tmp_path):
    engine, worker = engine_worker
    io = AsyncCheckpointIO(engine, worker=worker)
    model = TinyModel()
    ck = _ckpt_cb(tmp_path / "c", every=4)
    t = trainer(tmp_path, [io], [AsyncFinalizerCallback(), ck], max_steps=8, limit_val_batches=2)
    t.fit(model, loader(), loader())
    assert live_children() == []
    t.fit_loop.epoch_loop.max_steps = 16
    t.fit(model, loader(), loader())
    assert live_children() == []
    assert t.global_step == 16
    assert dir_entries(tmp_path / "c") == ["epoch=1-step=12.ckpt", "epoch=1-step=16.ckpt", "last.ckpt"]
    t.validate(model, loader(), ckpt_path="last")
    t.test(model, loader(), ckpt_path=str(tmp_path / "c" / "epoch=1-step=12.ckpt"))
    assert live_children() == []
    # a save after fit completes before it returns (nobody would finalize it later)
    t.save_checkpoint(tmp_path / "final.ckpt")
    assert commit.is_complete(tmp_path / "final.ckpt") and live_children() == []
    assert io.load_checkpoint(tmp_path / "final.ckpt")["global_step"] == 16
    # the engines' own helper processes were never started (nvrx keeps a Manager in a module global)
    from megatron.core.dist_checkpointing.strategies import filesystem_async as mcore_fs
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as nvrx_fs

    assert nvrx_fs._results_queue is None and mcore_fs._results_queue is None


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
                for pid in io.worker_pids():
                    os.kill(pid, signal.SIGKILL)

    ck = ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=4, save_top_k=-1)
    t = trainer(tmp_path, [io], [AsyncFinalizerCallback(), SlowSteps(), Kill(), ck], max_steps=40)
    with pytest.raises(CheckpointWriteError, match="SIGKILL") as exc_info:
        t.fit(TinyModel(), loader())
    assert exc_info.value.path.endswith("epoch=0-step=4.ckpt")
    assert 5 <= t.global_step <= latest_raise_step(4), t.global_step  # stopped within steps of the failure
    assert not (tmp_path / "c").exists() or dir_entries(tmp_path / "c") == []


@pytest.mark.parametrize("entry_point", [True, False], ids=["installed", "source-checkout"])
def test_plugin_alone_gets_exactly_one_finalizer_with_or_without_the_entry_point(tmp_path, monkeypatch, entry_point):
    """Run from a source checkout (no entry point installed), a Trainer made after the plugin gets the finalizer
    all the same; installed, the entry point gives it and nothing adds a second."""
    if not entry_point:
        from lightning_asyncckpt.integration.lightning_api import trainer_module

        monkeypatch.setattr(trainer_module("trainer.connectors.callback_connector"), "_load_external_callbacks",
                            lambda group: [])
    io = AsyncCheckpointIO("nvrx")
    t = trainer(tmp_path, [io], [], max_steps=1)
    auto = [cb for cb in t.callbacks if isinstance(cb, AsyncFinalizerCallback)]
    assert len(auto) == 1


def test_plugin_alone_registers_the_finalizer(tmp_path):
    io = AsyncCheckpointIO("nvrx")
    ck = ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=4, save_top_k=-1)
    t = trainer(tmp_path, [io], [ck], max_steps=40)
    auto = [cb for cb in t.callbacks if isinstance(cb, AsyncFinalizerCallback)]
    assert len(auto) == 1 and auto[0]._auto  # from the package's Lightning entry point

    class BreakDisk(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 6:
                io.write_hook = testing.FailWrite()

    t.callbacks[:0] = [BreakDisk(), SlowSteps()]
    with pytest.raises(CheckpointWriteError, match="ENOSPC"):
        t.fit(TinyModel(), loader())
    assert 8 <= t.global_step <= latest_raise_step(8), t.global_step  # raised by the finalizer within steps
    assert dir_entries(tmp_path / "c") == ["epoch=0-step=4.ckpt"]


def test_plugin_without_any_finalizer_on_one_device(tmp_path):
    io = AsyncCheckpointIO("nvrx")
    io.write_hook = testing.FailWrite()
    ck = ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=4, save_top_k=-1)
    t = trainer(tmp_path, [io], [ck], max_steps=12)
    t.callbacks[:] = [cb for cb in t.callbacks if not isinstance(cb, AsyncFinalizerCallback)]
    with pytest.raises(CheckpointWriteError, match="ENOSPC"):  # at the next save or at teardown
        t.fit(TinyModel(), loader())
    assert live_children() == []
    assert not (tmp_path / "c").exists() or dir_entries(tmp_path / "c") == []


def test_explicit_callback_makes_the_automatic_one_inert(tmp_path):
    io = AsyncCheckpointIO("nvrx", worker="fork")
    mine = AsyncFinalizerCallback()
    t = trainer(tmp_path, [io], [mine], max_steps=2)
    t.fit(TinyModel(), loader())
    auto = [cb for cb in t.callbacks if isinstance(cb, AsyncFinalizerCallback) and cb._auto]
    assert mine._io is io and all(cb._io is None for cb in auto)


def test_state_from_checkpoint_dtypes(engine_worker, tmp_path):
    engine, worker = engine_worker
    io = AsyncCheckpointIO(engine, worker=worker)
    model = TinyModel().to(torch.bfloat16)
    t = trainer(tmp_path, [io], [AsyncFinalizerCallback()], max_steps=1, enable_checkpointing=False)
    t.fit(model, loader())
    t.save_checkpoint(tmp_path / "manual.ckpt")
    io.finalize(blocking=True)
    loaded = io.load_checkpoint(tmp_path / "manual.ckpt", weights_only=False)
    assert all(v.dtype == torch.bfloat16 for v in loaded["state_dict"].values())
    assert loaded["hyper_parameters"]["width"] == 64
    io.teardown()


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


def test_staging_buffers_are_ready_before_the_first_save(tmp_path):
    """After the first optimizer step, the callback allocates the staging buffers (the persistent worker's
    shared memory), so that the first save only copies, as later saves do."""
    import lightning as L

    io = AsyncCheckpointIO("nvrx", worker="persistent")
    seen = {}

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, *a):
            if trainer.global_step == 1:
                seen["buffers"] = dict(enumerate(io.staging_buffers()))
                seen["saved"] = len(io.history) + io.num_pending

        def on_train_end(self, trainer, *a):
            seen["after"] = io.staging_buffers()

    ck = ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=1, save_top_k=1, monitor="step", mode="max")
    trainer(tmp_path, [io], [AsyncFinalizerCallback(), Look(), ck], max_steps=3).fit(TinyModel(width=128), loader(width=128))
    assert seen["saved"] == 0  # before the first save
    model_bytes = 2 * (128 * 128 + 128) * 4
    assert sum(b.numel() * b.element_size() for b in seen["buffers"].values()) >= 3 * model_bytes  # weights + Adam
    assert all(b.is_shared() for b in seen["buffers"].values()), [(n, b.is_shared()) for n, b in seen["buffers"].items()]
    assert all(any(b is a for a in seen["after"]) for b in seen["buffers"].values())  # reused by the saves


def test_every_committed_save_reaches_the_loggers_and_the_log(tmp_path):
    """Rank 0 logs each committed save's figures under ``asyncckpt/`` and one INFO line per checkpoint."""
    import csv
    import logging

    from lightning.pytorch.loggers import CSVLogger

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Collect(level=logging.INFO)
    logging.getLogger("lightning_asyncckpt").addHandler(handler)
    try:
        io = AsyncCheckpointIO("nvrx", worker="persistent")
        ck = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_train_steps=5)
        logger = CSVLogger(tmp_path / "logs", name="", version="")
        t = trainer(tmp_path, [io], [AsyncFinalizerCallback(), ck], max_steps=20, logger=logger, log_every_n_steps=1)
        t.fit(TinyModel(width=64, layers=2), loader(width=64, n=64))
    finally:
        logging.getLogger("lightning_asyncckpt").removeHandler(handler)

    assert len(io.history) == 4
    with open(tmp_path / "logs" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("asyncckpt/bytes_written")]
    assert len(rows) == 4
    for row, record in zip(rows, io.history):
        on_disk = os.path.getsize(record.path)  # stock's one torch.save file
        assert int(float(row["asyncckpt/bytes_written"])) == record.nbytes == on_disk
        assert float(row["asyncckpt/stall_seconds"]) == pytest.approx(record.stall_s)
        assert float(row["asyncckpt/write_seconds"]) == pytest.approx(record.write_s)
        assert float(row["asyncckpt/write_seconds"]) > 0 and float(row["asyncckpt/stall_seconds"]) > 0
        assert float(row["asyncckpt/write_gb_per_second"]) == pytest.approx(record.nbytes / record.write_s / 1e9)
        assert 0 <= float(row["asyncckpt/pending_saves"]) < 2
    assert [r.step for r in io.history] == [5, 10, 15, 20]
    committed = [ln for ln in lines if ln.startswith("lightning-asyncckpt: committed ")]
    assert [ln.split()[2].rstrip(":") for ln in committed] == [os.path.basename(r.path) for r in io.history]
    assert all(re.search(r" in \d+\.\d+ s \(\d+(\.\d+)? [kMG]?B/s\); training stalled \d+\.\d+ s$", ln) for ln in committed)


def test_log_metrics_false_logs_nothing(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    io = AsyncCheckpointIO("mcore", worker="fork")
    ck = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_train_steps=5)
    t = trainer(tmp_path, [io], [AsyncFinalizerCallback(log_metrics=False), ck], max_steps=10,
                logger=CSVLogger(tmp_path / "logs", name="", version=""), log_every_n_steps=1)
    t.fit(TinyModel(width=32, layers=1), loader(width=32, n=32))
    assert len(io.history) == 2
    text = (tmp_path / "logs" / "metrics.csv").read_text() if (tmp_path / "logs" / "metrics.csv").exists() else ""
    assert "asyncckpt/" not in text


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

    for key, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
                       "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", str(tmp_path))  # no `scontrol` here: Lightning logs that the requeue failed
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


def test_drop_in_names_pickling_and_threads_as_stock(tmp_path):
    """With the plugin, ModelCheckpoint picks the same names as stock (``-v1`` suffixes while the earlier
    save is still being written), ``torch.save(trainer)`` works, no thread of ours outlives ``fit``, and
    ``load_from_checkpoint`` reads the best checkpoint."""
    import io as _io
    import threading

    def run(plugins, name):
        ck = ModelCheckpoint(dirpath=tmp_path / name, filename="same", save_top_k=-1, every_n_train_steps=2,
                             monitor="step", mode="max")
        t = trainer(tmp_path / f"root-{name}", plugins, [ck], max_steps=8)
        t.fit(TinyModel(), loader())
        return t, ck, sorted(os.listdir(tmp_path / name))

    _, _, stock_names = run([], "stock")
    threads_before = set(threading.enumerate())
    io = AsyncCheckpointIO("nvrx")
    io.write_hook = testing.DelayWrite(0.3)  # each save is still pending when the next name is picked
    t, ck, names = run([io], "ours")
    assert names == stock_names == ["same-v1.ckpt", "same-v2.ckpt", "same-v3.ckpt", "same.ckpt"], (names, stock_names)
    assert set(threading.enumerate()) <= threads_before
    torch.save(t, _io.BytesIO())
    model = TinyModel.load_from_checkpoint(ck.best_model_path)
    assert isinstance(model, TinyModel) and ck.best_model_path.endswith("same-v3.ckpt")
    t.test(model, loader(), ckpt_path="best")  # Lightning's own path resolution and loading
    assert torch.load(tmp_path / "ours" / "same.ckpt", weights_only=True)["global_step"] == 2
