"""Lazy saves that fail, with ``AsyncCheckpointIO(snapshot="lazy")`` on its own: state changed before the
background copy ran (a torn snapshot, found by version counters), a worker that dies mid-write, a copy held past
``timeout_s``, and a save that follows a write which fails. The failed save is raised as its own, nothing of it
is left, and the next or following save commits its own state. Real worker processes, real files."""

from __future__ import annotations

import pytest
import torch
from lazy_snapshot_parts import fabric_loop_parts as _fabric_loop_parts
from lazy_snapshot_parts import lazy_io as _lazy_io
from lazy_snapshot_parts import staged_bytes as _staged_bytes
from lazy_snapshot_parts import torch_state as _torch_state

from helpers import assert_tree_equal, clone_tree, dir_entries
from lightning_asyncckpt import CheckpointWriteError, testing
from lightning_asyncckpt.snapshot import staging
from lightning_asyncckpt.storage import commit
from processes import live_children


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
        assert io.session.is_pending(tmp_path / "torn") and io.session.num_pending == 2
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
        assert io.session.num_pending == 2
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
