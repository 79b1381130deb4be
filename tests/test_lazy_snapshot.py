"""``AsyncCheckpointIO(snapshot="lazy")``: parameters and optimizer state copied in the background during the
next step, waited for before the optimizer step, proven untorn by version counters. Real worker processes,
real files; one engine (the subject does not depend on it)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import (
    SnapshotRecorder,
    TinyModel,
    assert_tree_equal,
    clone_tree,
    dir_entries,
    live_children,
    loader,
    trainer,
)
from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback, CheckpointWriteError, testing
from lightning_asyncckpt.format import commit
from lightning_asyncckpt.snapshot import staging

WIDTH = 256  # 256 KiB per weight: above the lazy threshold


class BatchNormModel(TinyModel):
    """A tiny model with buffers that change in every forward (BatchNorm's running statistics): they must be
    copied at save time, or the lazy snapshot would be torn (and fail)."""

    def __init__(self, width: int = WIDTH):
        super().__init__(width=width, layers=2)
        self.bn = torch.nn.BatchNorm1d(width)

    def training_step(self, batch, batch_idx):
        return self.bn(self.net(batch[0])).pow(2).mean()


def _lazy_io(**kw):
    return AsyncCheckpointIO("nvrx", worker="persistent", snapshot="lazy", **kw)


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


def _torch_state(model, opt, step):
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def _fabric_loop_parts(width=WIDTH):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(8, width)

    def forward_backward():
        opt.zero_grad()
        model(x).pow(2).mean().backward()

    return model, opt, forward_backward


@pytest.mark.parametrize("edit", ["in_place_add", "optimizer_step_without_wait"])
def test_plugin_state_changed_before_the_copy_fails_the_save(tmp_path, edit):
    model, opt, forward_backward = _fabric_loop_parts()
    forward_backward()
    opt.step()  # Adam's moments exist
    with _lazy_io() as io:
        io.track_optimizers([opt])
        io.save_checkpoint(_torch_state(model, opt, 1), tmp_path / "good")
        io.wait_for_snapshot()
        hold = io.copy_hook = testing.HoldCopy()
        io.save_checkpoint(_torch_state(model, opt, 2), tmp_path / "torn")
        assert io.is_pending(tmp_path / "torn") and io.num_pending == 2
        hold.wait_started()
        forward_backward()
        if edit == "in_place_add":
            with torch.no_grad():
                model[1].weight.add_(1)
        else:
            opt.step()  # the misuse the docstring warns of: no wait_for_snapshot() first
        hold.release()
        with pytest.raises(CheckpointWriteError) as info:
            io.wait_for_snapshot()
        assert info.value.path == str(tmp_path / "torn") and 'snapshot="eager"' in str(info.value)
        # the first changed tensor in copy order: the edited weight, or the first parameter the step changed
        assert ("'model.1.weight'" if edit == "in_place_add" else "'model.0.weight'") in str(info.value)
        io.finalize(blocking=True)
    assert dir_entries(tmp_path) == ["good"] and commit.is_complete(tmp_path / "good")


def test_a_lazy_write_starts_once_its_copy_is_proven_not_at_the_optimizer_step(tmp_path):
    """A single-writer lazy save is handed to the worker inside the save call, behind a gate: the write
    begins as soon as the background copy is proven, while nobody has called ``wait_for_snapshot`` yet."""
    model, opt, forward_backward = _fabric_loop_parts()
    forward_backward()
    opt.step()
    hold = testing.HoldWrite(str(tmp_path / "release"), started_file=str(tmp_path / "started"))
    try:
        with _lazy_io() as io:
            io.track_optimizers([opt])
            io.write_hook = hold
            expected = clone_tree(_torch_state(model, opt, 1))
            io.save_checkpoint(_torch_state(model, opt, 1), tmp_path / "c" / "a")
            hold.wait_started(timeout_s=60)  # the worker runs the write: no wait, no finalize called
            forward_backward()
            io.wait_for_snapshot()
            opt.step()
            hold.release()
            io.finalize(blocking=True)
    finally:
        hold.release()
    assert_tree_equal(io.load_checkpoint(tmp_path / "c" / "a", weights_only=False), expected, "a")
    assert [r.lazy_nbytes > 0 for r in io.history] == [True]


def test_the_save_after_a_torn_one_commits_its_own_state(tmp_path):
    """The torn save was already queued at its worker, which skips it: the next save's write and report
    are its own (the reports come in order), and nothing of the torn one is left."""
    model, opt, forward_backward = _fabric_loop_parts()
    forward_backward()
    opt.step()
    with _lazy_io() as io:
        io.track_optimizers([opt])
        hold = io.copy_hook = testing.HoldCopy()
        io.save_checkpoint(_torch_state(model, opt, 1), tmp_path / "torn")
        hold.wait_started()
        with torch.no_grad():
            model[1].weight.add_(1)
        hold.release()
        with pytest.raises(CheckpointWriteError, match="model.1.weight"):
            io.wait_for_snapshot()
        io.copy_hook = None
        expected = clone_tree(_torch_state(model, opt, 2))
        io.save_checkpoint(_torch_state(model, opt, 2), tmp_path / "next")
        io.wait_for_snapshot()
        io.finalize(blocking=True)
        _, tensors = staging.split(_torch_state(model, opt, 2))
        assert _staged_bytes(io) == sum(t.numel() * t.element_size() for t in tensors.values())  # the torn save's copy was reused
    assert dir_entries(tmp_path) == ["next"]
    assert_tree_equal(io.load_checkpoint(tmp_path / "next", weights_only=False), expected, "next")
    assert [r.path for r in io.history] == [str(tmp_path / "next")]


def test_a_lazy_write_whose_worker_dies_fails_loudly_and_the_next_save_commits(tmp_path):
    """The write a lazy save handed over behind its gate starts, then its worker dies: the save fails as
    ``WorkerDied`` (it is not handed over again: its own write was lost), nothing of it is left, and the
    next save gets a new worker and commits its own state."""
    model, opt, forward_backward = _fabric_loop_parts()
    forward_backward()
    opt.step()
    with _lazy_io() as io:
        io.track_optimizers([opt])
        io.write_hook = testing.CrashWrite()
        io.save_checkpoint(_torch_state(model, opt, 1), tmp_path / "c" / "a")
        forward_backward()
        io.wait_for_snapshot()
        opt.step()
        with pytest.raises(CheckpointWriteError) as info:
            io.finalize(blocking=True)
        assert info.value.path == str(tmp_path / "c" / "a") and info.value.error_type == "WorkerDied"
        io.write_hook = None
        expected = clone_tree(_torch_state(model, opt, 2))
        io.save_checkpoint(_torch_state(model, opt, 2), tmp_path / "c" / "b")
        io.wait_for_snapshot()
        io.finalize(blocking=True)
    assert dir_entries(tmp_path / "c") == ["b"]
    assert_tree_equal(io.load_checkpoint(tmp_path / "c" / "b", weights_only=False), expected, "b")
    assert live_children() == []


def test_a_copy_that_does_not_finish_within_timeout_s_fails_as_a_timeout(tmp_path):
    """A lazy copy still held after ``timeout_s`` drops its save as a ``TimeoutError`` (it is unfinished, not
    torn); the save before it is intact and nothing of the dropped one is left."""
    model, opt, forward_backward = _fabric_loop_parts()
    forward_backward()
    opt.step()
    hold = testing.HoldCopy()
    try:
        with _lazy_io(timeout_s=5) as io:
            io.warmup()  # the worker is up: timeout_s bounds the write, worker start included
            io.track_optimizers([opt])
            io.save_checkpoint(_torch_state(model, opt, 1), tmp_path / "good")
            io.wait_for_snapshot()
            io.finalize(blocking=True)  # its write ended: the next save's copy waits for nothing but the hold
            io.copy_hook = hold
            io.save_checkpoint(_torch_state(model, opt, 2), tmp_path / "slow")
            hold.wait_started()
            with pytest.raises(CheckpointWriteError) as info:
                io.wait_for_snapshot()  # the copy is still held after timeout_s
            assert info.value.path == str(tmp_path / "slow") and info.value.error_type == "TimeoutError"
            assert "timeout_s=5" in str(info.value)
            hold.release()
            io.finalize(blocking=True)
    finally:
        hold.release()
    assert dir_entries(tmp_path) == ["good"] and commit.is_complete(tmp_path / "good")


def test_fabric_style_loop_waits_before_the_step(tmp_path):
    model, opt, forward_backward = _fabric_loop_parts()
    copies = {}
    with _lazy_io() as io:
        io.track_optimizers([opt])
        for step in range(1, 7):
            forward_backward()
            io.wait_for_snapshot()  # the previous save's copy ran during this forward and backward
            opt.step()
            if step % 2 == 0:
                copies[step] = clone_tree(_torch_state(model, opt, step))
                io.save_checkpoint(_torch_state(model, opt, step), tmp_path / f"step-{step}")
            io.finalize()
        records = io.finalize(blocking=True)
    assert dir_entries(tmp_path) == ["step-2", "step-4", "step-6"]
    for step, expected in copies.items():
        assert_tree_equal(io.load_checkpoint(tmp_path / f"step-{step}", weights_only=False), expected, f"step {step}")
    assert all(r.lazy_nbytes == 6 * WIDTH * WIDTH * 4 for r in io.history), records


def test_fabric_style_never_waiting_the_next_save_waits(tmp_path):
    model, opt, forward_backward = _fabric_loop_parts()
    forward_backward()
    opt.step()
    first = clone_tree(_torch_state(model, opt, 1))
    with _lazy_io() as io:
        io.track_optimizers([opt])
        hold = io.copy_hook = testing.HoldCopy()
        io.save_checkpoint(_torch_state(model, opt, 1), tmp_path / "a")
        forward_backward()  # no step: the state the copy reads is unchanged
        hold.wait_started()
        hold.release()
        io.save_checkpoint(_torch_state(model, opt, 1), tmp_path / "b")  # waits for a's copy, hands it over
        assert io.num_pending == 2
    # leaving the block (teardown) waited for b's copy too
    for name in ("a", "b"):
        assert_tree_equal(io.load_checkpoint(tmp_path / name, weights_only=False), first, name)
    assert len(io.history) == 2 and all(r.lazy_nbytes > 0 for r in io.history)


def test_untracked_and_fork_saves_are_eager(tmp_path):
    model, opt, forward_backward = _fabric_loop_parts()
    forward_backward()
    opt.step()
    with _lazy_io() as io:  # no optimizer tracked: nothing may be copied later
        io.save_checkpoint(_torch_state(model, opt, 1), tmp_path / "untracked")
    with AsyncCheckpointIO("nvrx", worker="fork", snapshot="lazy") as io_fork:  # fork's snapshot is the fork
        io_fork.track_optimizers([opt])
        io_fork.save_checkpoint(_torch_state(model, opt, 1), tmp_path / "fork")
    assert io.history[0].lazy_nbytes == 0 and io_fork.history[0].lazy_nbytes == 0
    assert dir_entries(tmp_path) == ["fork", "untracked"]


def test_snapshot_argument_is_validated():
    with pytest.raises(ValueError, match=r"AsyncCheckpointIO\(snapshot='sometimes'\).*'eager', 'lazy'"):
        AsyncCheckpointIO(snapshot="sometimes")
    assert AsyncCheckpointIO().snapshot == "eager"  # the default


def test_lazy_staging_is_one_copy_of_the_state_and_does_not_grow(tmp_path):
    """Lazy mode copies into the same reused buffers as eager: one copy of the state, whatever the number of
    saves (the background copy adds no second one)."""
    model, opt, forward_backward = _fabric_loop_parts()
    forward_backward()
    opt.step()
    _, tensors = staging.split(_torch_state(model, opt, 0))
    state_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    held = []
    with _lazy_io() as io:
        io.track_optimizers([opt])
        for step in range(1, 5):
            io.save_checkpoint(_torch_state(model, opt, step), tmp_path / f"step-{step}")
            forward_backward()
            io.wait_for_snapshot()
            opt.step()
            io.finalize(blocking=True)
            held.append(sum(b.numel() * b.element_size() for b in io.staging_buffers()))
    assert all(r.lazy_nbytes > 0 for r in io.history)
    assert held == [state_bytes] * 4, (held, state_bytes)


def _staged_bytes(io):
    return sum(b.numel() * b.element_size() for b in io.staging_buffers())


def test_a_lazy_save_behind_a_write_in_flight_follows_it_into_one_copy(tmp_path):
    """A lazy save that finds the only staging copy still being written takes no second copy: its copy follows
    that write, off the save call, and neither checkpoint is torn (the first holds its own step's values, not
    the second's; the second its own step's, not the step after the wait). The write before it is held before
    its first byte."""
    model, opt, forward_backward = _fabric_loop_parts()
    forward_backward()
    opt.step()
    _, tensors = staging.split(_torch_state(model, opt, 0))
    state_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    hold = testing.HoldWrite(str(tmp_path / "release"), started_file=str(tmp_path / "started"), timeout_s=120)
    with _lazy_io() as io:
        io.track_optimizers([opt])
        io.write_hook = hold
        first = clone_tree(_torch_state(model, opt, 1))
        io.save_checkpoint(_torch_state(model, opt, 1), tmp_path / "c" / "a")
        io.wait_for_snapshot()  # a's copy is done and its write handed over: held at the writer
        hold.wait_started()
        forward_backward()
        opt.step()
        second = clone_tree(_torch_state(model, opt, 2))
        io.save_checkpoint(_torch_state(model, opt, 2), tmp_path / "c" / "b")  # returns: its copy follows a's write
        assert io.num_pending == 2 and _staged_bytes(io) == state_bytes
        forward_backward()
        hold.release()
        io.wait_for_snapshot()  # b's copy is done
        opt.step()  # changes nothing b holds
        io.finalize(blocking=True)
        assert _staged_bytes(io) == state_bytes
    for name, expected in (("a", first), ("b", second)):
        assert_tree_equal(io.load_checkpoint(tmp_path / "c" / name, weights_only=False), expected, name)
    assert [r.lazy_nbytes > 0 for r in io.history] == [True, True]


@pytest.mark.slow  # make test-all
@pytest.mark.parametrize("failure", ["worker_dies", "write_hangs"])
def test_a_lazy_save_following_a_write_that_fails_still_commits(tmp_path, failure):
    """The write before it fails: its worker dies mid-write, or it hangs and is given up after ``timeout_s``
    (its worker killed). The follower's buffers are then free: it is copied and committed by a new worker;
    the failed save is raised, and nothing of it is left."""
    model, opt, forward_backward = _fabric_loop_parts()
    forward_backward()
    opt.step()
    dies = failure == "worker_dies"
    hold = testing.HoldWrite(str(tmp_path / "release"), started_file=str(tmp_path / "started"))
    # a timeout far longer than the few steps before b's save, so that b follows a
    with _lazy_io(timeout_s=1800 if dies else 20) as io:
        io.track_optimizers([opt])
        io.write_hook = testing.Hooks((hold, testing.CrashWrite())) if dies else hold  # never released: a hung disk
        io.save_checkpoint(_torch_state(model, opt, 1), tmp_path / "c" / "a")
        io.wait_for_snapshot()
        hold.wait_started()
        forward_backward()
        opt.step()
        second = clone_tree(_torch_state(model, opt, 2))
        io.write_hook = None  # b's write is clean
        io.save_checkpoint(_torch_state(model, opt, 2), tmp_path / "c" / "b")
        assert io.num_pending == 2
        if dies:
            hold.release()
        io.wait_for_snapshot()  # sees a's worker die at once, or gives up on the hung write after timeout_s
        with pytest.raises(CheckpointWriteError) as info:
            io.finalize(blocking=True)
        assert info.value.path == str(tmp_path / "c" / "a")
        assert info.value.error_type == ("WorkerDied" if dies else "TimeoutError")
        io.finalize(blocking=True)
    assert dir_entries(tmp_path / "c") == ["b"]
    assert_tree_equal(io.load_checkpoint(tmp_path / "c" / "b", weights_only=False), second, "b")
    assert live_children() == []
