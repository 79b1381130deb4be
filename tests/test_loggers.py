"""Loggers hear of a checkpoint (``after_save_checkpoint``) only once it is committed: real Trainer, real
workers, a real MLflow tracking store on local files."""

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from helpers import TinyModel, dir_entries, loader, trainer
from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback, CheckpointWriteError, testing
from lightning_asyncckpt.storage import commit


class RecordingLogger(Logger):
    """At each ``after_save_checkpoint``: every checkpoint the callback lists, whether it is on disk and
    loads (``torch.load``), and its ``global_step`` then."""

    def __init__(self):
        super().__init__()
        self.calls = []  # one {filename: global_step, or None if missing or unreadable} per call

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        pass

    def after_save_checkpoint(self, checkpoint_callback):
        seen = {}
        for path in [*checkpoint_callback.best_k_models, checkpoint_callback.last_model_path]:
            if path:
                seen[Path(path).name] = _step_on_disk(path)
        self.calls.append(seen)


def _step_on_disk(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)["global_step"]
    except (OSError, RuntimeError, EOFError, KeyError):
        return None


class ReleaseAt(L.Callback):
    """At the end of batch ``step`` (one step after the first save was scheduled, before the checkpoint
    callbacks of that batch run), notes what the logger heard so far and releases the held writes."""

    def __init__(self, hold, logger, step):
        self.hold, self.logger, self.step = hold, logger, step
        self.heard_while_held = None
        self.on_disk_while_held = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.heard_while_held = list(self.logger.calls)
            self.on_disk_while_held = dir_entries(trainer.checkpoint_callback.dirpath)
            self.hold.release()


def _every_save(dirpath, every=2):
    return ModelCheckpoint(dirpath=dirpath, monitor="step", mode="max", every_n_train_steps=every, save_top_k=-1)


def _assert_saves_before_on_disk(seen, step):
    """Every checkpoint scheduled up to this call's (``step``) is on disk and loads; a later one may not be."""
    for s in range(2, step + 1, 2):
        assert seen.get(f"epoch=0-step={s}.ckpt") == s, (step, seen)


def test_mlflow_log_model_all_uploads_every_committed_checkpoint(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 refuses its file store otherwise
    uri = f"file:{tmp_path}/mlruns"
    mlf = MLFlowLogger(experiment_name="asyncckpt", tracking_uri=uri, log_model="all")
    io = AsyncCheckpointIO()
    io.write_hook = testing.DelayWrite(0.1)  # every write outlasts a few steps: the calls are deferred
    ck = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="step", mode="max", save_top_k=2,
                         every_n_train_steps=2, save_last=True)
    t = trainer(tmp_path, [io], [AsyncFinalizerCallback(), ck], max_steps=10, logger=mlf)
    t.fit(TinyModel(width=32), loader(width=32))

    names = dir_entries(tmp_path / "ckpts")
    assert sorted(names) == sorted(["epoch=1-step=10.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]), names
    client = MlflowClient(uri)
    for name in names:
        stem = Path(name).stem
        listed = [a.path for a in client.list_artifacts(mlf.run_id, stem)]
        assert f"{stem}/{name}" in listed, (name, listed)
        got = client.download_artifacts(mlf.run_id, f"{stem}/{name}", str(tmp_path / "download"))
        assert Path(got).read_bytes() == (tmp_path / "ckpts" / name).read_bytes(), name


def test_logger_hears_of_a_save_only_once_it_is_committed(tmp_path, hold):
    rec = RecordingLogger()
    io = AsyncCheckpointIO()
    io.write_hook = hold  # the step-2 write is held while ModelCheckpoint calls the logger
    release = ReleaseAt(hold, rec, step=3)
    ck = _every_save(tmp_path / "ckpts")
    t = trainer(tmp_path, [io], [AsyncFinalizerCallback(), release, ck], max_steps=8, logger=rec)
    t.fit(TinyModel(width=32), loader(width=32))

    # while the step-2 write was held, the logger had heard nothing and no checkpoint was there: only the hidden
    # file of the write in flight (made at save time, so that another rank sees the save)
    assert release.heard_while_held == []
    assert [e for e in release.on_disk_while_held if not commit.is_leftover(e)] == []
    assert all(e.startswith(commit.INCOMPLETE_PREFIX) for e in release.on_disk_while_held)
    # then one call per save, in order, each seeing its checkpoint on disk and complete
    steps = [2, 4, 6, 8]
    assert len(rec.calls) == len(steps), rec.calls
    for seen, step in zip(rec.calls, steps):
        _assert_saves_before_on_disk(seen, step)
    # the loggers have their own method back
    assert "after_save_checkpoint" not in vars(rec)


def test_failed_save_is_never_announced(tmp_path):
    rec = RecordingLogger()
    io = AsyncCheckpointIO(faults=testing.FaultList([testing.Fault("enospc", saves=[2])]))
    ck = _every_save(tmp_path / "ckpts")
    t = trainer(tmp_path, [io], [AsyncFinalizerCallback(), ck], max_steps=8, logger=rec)
    with pytest.raises(CheckpointWriteError, match="step=4"):
        t.fit(TinyModel(width=32), loader(width=32))

    assert not os.path.exists(tmp_path / "ckpts" / "epoch=0-step=4.ckpt")
    # the save before the failed one was announced, with its file there; the failed one never was
    assert len(rec.calls) == 1, rec.calls
    _assert_saves_before_on_disk(rec.calls[0], 2)
    assert "after_save_checkpoint" not in vars(rec)  # given back on the way out too


def test_saves_settled_tells_pending_committed_and_failed(tmp_path, hold):
    state = {"global_step": 1, "state_dict": {"w": torch.randn(8, 8)}}
    io = AsyncCheckpointIO(faults=testing.FaultList([testing.Fault("enospc", saves=[3])]))
    io.write_hook = hold
    try:
        assert io.session.saves_scheduled == 0 and io.session.saves_settled(0) is True  # nothing in the range
        io.save_checkpoint(state, tmp_path / "a.ckpt")
        io.save_checkpoint(state, tmp_path / "b.ckpt")
        assert io.session.saves_scheduled == 2
        assert io.session.saves_settled(1) is None and io.session.saves_settled(2, since=1) is None  # held: pending
        hold.release()
        io.finalize(blocking=True)
        assert io.session.saves_settled(2) is True and io.session.saves_settled(2, since=1) is True
        io.save_checkpoint(state, tmp_path / "c.ckpt")  # its write fails
        with pytest.raises(CheckpointWriteError):
            io.finalize(blocking=True)
        assert io.session.saves_settled(3) is False and io.session.saves_settled(3, since=2) is False
        assert io.session.saves_settled(2) is True  # the saves before it still committed
    finally:
        io.teardown()


class ReleaseAtEnd(L.Callback):
    """Releases the held writes at the end of training, before the finalizer's blocking finalize: the
    saves then commit together, in one finalize."""

    def __init__(self, hold):
        self.hold = hold

    def on_train_end(self, trainer, pl_module):
        self.hold.release()


def test_a_checkpoint_that_left_the_top_k_is_announced_as_stock_would(tmp_path, hold):
    """Stock tells the logger of step 2's checkpoint while it is the best; here its call is made after the
    save of step 4 (which pushes it out of the top 1) committed too. The logger still sees what stock's
    saw: the callback's state as it was, and the file still there."""
    io = AsyncCheckpointIO()
    io.write_hook = hold
    logger = RecordingLogger()
    ck = ModelCheckpoint(dirpath=tmp_path / "c", monitor="step", mode="max", save_top_k=1, every_n_train_steps=2)
    t = trainer(tmp_path, [io], [ReleaseAtEnd(hold), AsyncFinalizerCallback(), ck], max_steps=4, logger=logger)
    t.fit(TinyModel(width=32), loader(width=32))
    assert logger.calls == [{"epoch=0-step=2.ckpt": 2}, {"epoch=0-step=4.ckpt": 4}]
    assert dir_entries(tmp_path / "c") == ["epoch=0-step=4.ckpt"]  # and the removal ran afterwards
