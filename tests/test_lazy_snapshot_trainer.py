"""``AsyncCheckpointIO(snapshot="lazy")`` under Lightning's Trainer: every checkpoint holds, bit for bit, the
state its save was handed (BatchNorm buffers that change in every forward, gradient accumulation), a resume
starts from it, and a weight edited after a save fails that save as torn before the optimizer step that follows.
Real worker processes, real files; one engine (the subject does not depend on it)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lazy_snapshot_parts import WIDTH
from lazy_snapshot_parts import lazy_io as _lazy_io
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import SnapshotRecorder, TinyModel, assert_tree_equal, clone_tree, dir_entries, loader, trainer
from lightning_asyncckpt import AsyncFinalizerCallback, CheckpointWriteError, testing
from processes import live_children


class BatchNormModel(TinyModel):
    """A tiny model with buffers that change in every forward (BatchNorm's running statistics): they must be
    copied at save time, or the lazy snapshot would be torn (and fail)."""

    def __init__(self, width: int = WIDTH):
        super().__init__(width=width, layers=2)
        self.bn = torch.nn.BatchNorm1d(width)

    def training_step(self, batch, batch_idx):
        return self.bn(self.net(batch[0])).pow(2).mean()


def _assert_exact(io, rec, folder):
    """Every checkpoint in ``folder`` holds, bit for bit, the state its save was handed; returns the names."""
    names = dir_entries(folder)
    for name in names:
        loaded = io.load_checkpoint(folder / name, weights_only=False)
        got = {"state_dict": loaded["state_dict"], "optimizer_states": loaded["optimizer_states"]}
        assert_tree_equal(got, rec.copies[loaded["global_step"]], name)
    return names


def test_trainer_lazy_saves_are_exact_and_resume(tmp_path):
    io = _lazy_io()
    rec = SnapshotRecorder()
    ck = ModelCheckpoint(dirpath=tmp_path / "c", monitor="step", mode="max", save_top_k=2, every_n_train_steps=3, save_last=True)
    t = trainer(tmp_path, [io], [AsyncFinalizerCallback(), rec, ck], max_steps=12)
    t.fit(BatchNormModel(), loader(width=WIDTH, n=64))
    assert live_children() == []
    assert _assert_exact(io, rec, tmp_path / "c") == ["epoch=1-step=12.ckpt", "epoch=1-step=9.ckpt", "last.ckpt"]
    # every save was taken lazily: the weights and Adam moments (not the BatchNorm buffers) after it returned
    assert len(io.history) == 8 and all(r.lazy_nbytes > 0 for r in io.history)  # 4 top-k, 4 last
    lazy_bytes = 2 * 3 * WIDTH * WIDTH * 4  # two weights, each with two Adam moments
    assert {r.lazy_nbytes for r in io.history} == {lazy_bytes}

    start = {}

    class Start(L.Callback):
        def on_train_start(self, trainer, pl_module):
            start["weights"] = clone_tree(pl_module.state_dict())
            start["optim"] = clone_tree(trainer.optimizers[0].state_dict()["state"])

    io_b = _lazy_io()
    resumed = trainer(tmp_path, [io_b], [AsyncFinalizerCallback(), Start()], max_steps=14, enable_checkpointing=False)
    resumed.fit(BatchNormModel(), loader(width=WIDTH, n=64), ckpt_path=str(tmp_path / "c" / "last.ckpt"))
    saved = io_b.load_checkpoint(tmp_path / "c" / "last.ckpt", weights_only=False)
    assert_tree_equal(start["weights"], clone_tree(dict(saved["state_dict"])))
    assert_tree_equal(start["optim"], saved["optimizer_states"][0]["state"])
    assert resumed.global_step == 14


def test_trainer_gradient_accumulation_is_exact(tmp_path):
    io = _lazy_io()
    rec = SnapshotRecorder()
    ck = ModelCheckpoint(dirpath=tmp_path / "c", save_top_k=-1, every_n_train_steps=2)
    t = trainer(tmp_path, [io], [AsyncFinalizerCallback(), rec, ck], max_steps=6, accumulate_grad_batches=2)
    t.fit(TinyModel(width=WIDTH), loader(width=WIDTH, n=128))
    # each copy ran over a whole non-stepping batch and the next forward/backward, waited for on the boundary
    assert _assert_exact(io, rec, tmp_path / "c") == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"]
    assert len(io.history) == 3 and all(r.lazy_nbytes > 0 for r in io.history)


class _EditAfterSave(L.Callback):
    """Edits a weight in place at the start of the batch after the save at ``step``, while the held lazy copy
    has surely not run, then lets the copy go: the optimizer step's wait must fail the save."""

    def __init__(self, hold, step):
        self.hold, self.step = hold, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.hold.wait_started()
            with torch.no_grad():
                pl_module.net[0].weight.add_(1)
            self.hold.release()


def test_trainer_state_edited_after_a_save_fails_it_loudly(tmp_path):
    io = _lazy_io()
    hold = testing.HoldCopy()
    ck = ModelCheckpoint(dirpath=tmp_path / "c", save_top_k=-1, every_n_train_steps=2)
    cbs = [AsyncFinalizerCallback(), ck, _EditAfterSave(hold, step=4)]

    class HoldFromStep4(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                io.copy_hook = hold  # only the save at step 4 is held

    t = trainer(tmp_path, [io], [*cbs, HoldFromStep4()], max_steps=8)
    with pytest.raises(CheckpointWriteError) as info:
        t.fit(TinyModel(width=WIDTH), loader(width=WIDTH))
    err = info.value
    assert err.path.endswith("epoch=0-step=4.ckpt") and err.error_type == "TornSnapshot"
    assert "'state_dict.net.0.weight'" in str(err) and 'snapshot="eager"' in str(err)
    assert t.global_step == 4  # raised before the optimizer step that follows the save
    assert dir_entries(tmp_path / "c") == ["epoch=0-step=2.ckpt"]  # nothing torn, nothing left over
    assert live_children() == []
