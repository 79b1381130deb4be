"""The plugin under Lightning's Trainer on one device: real engine queues, real workers, real files. What
the saves hold and how they are named: ModelCheckpoint's top-k and ``last`` checkpoints are bit-exact copies
of the state at save time, a resume continues exactly, dtypes survive, and names, pickling and threads are as
with stock Lightning (failed saves and interrupted training: test_trainer_failures.py; the finalizer callback:
test_trainer_finalizer.py)."""

import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import SnapshotRecorder, TinyModel, assert_tree_equal, clone_tree, dir_entries, loader, trainer
from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback, testing
from lightning_asyncckpt.storage import commit
from processes import live_children


def _ckpt_cb(dirpath, save_last=True, every=5):
    return ModelCheckpoint(
        dirpath=dirpath, monitor="step", mode="max", save_top_k=2, every_n_train_steps=every, save_last=save_last
    )


class _CommitLog:
    """Records publishes and removals of final checkpoint paths, in order (wraps the real functions)."""

    def __init__(self, monkeypatch):
        self.events = []
        publish, publish_file, remove = commit.publish, commit.publish_file, commit.remove_path

        def logged_publish(tmp, path):
            (publish_file if path.suffix and tmp.is_file() else publish)(tmp, path)
            self.events.append(("publish", path.name))

        def logged_remove(path):
            if not commit.is_leftover(path.name):
                self.events.append(("remove", path.name))
            remove(path)

        monkeypatch.setattr(commit, "publish", logged_publish)
        monkeypatch.setattr(commit, "publish_file", logged_publish)
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
