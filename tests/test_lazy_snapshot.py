"""``AsyncCheckpointIO(snapshot="lazy")`` on its own, in a Fabric-style loop: parameters and optimizer state
copied in the background during the next step, waited for before the optimizer step, proven untorn by version
counters. The write starts as soon as its copy is proven, a save behind a write in flight shares its one staging
copy, and saves with no tracked optimizer or a fork worker stay eager. Real worker processes, real files; one
engine (the subject does not depend on it). Failures are in ``test_lazy_snapshot_failures.py``, the Trainer in
``test_lazy_snapshot_trainer.py``."""

from __future__ import annotations

import pytest
from lazy_snapshot_parts import WIDTH
from lazy_snapshot_parts import fabric_loop_parts as _fabric_loop_parts
from lazy_snapshot_parts import lazy_io as _lazy_io
from lazy_snapshot_parts import staged_bytes as _staged_bytes
from lazy_snapshot_parts import torch_state as _torch_state

from helpers import assert_tree_equal, clone_tree, dir_entries
from lightning_asyncckpt import AsyncCheckpointIO, testing
from lightning_asyncckpt.snapshot import staging


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
        assert io.session.num_pending == 2
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
    assert AsyncCheckpointIO().settings.snapshot == "eager"  # the default


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
            held.append(sum(b.numel() * b.element_size() for b in io.session.staging_buffers()))
    assert all(r.lazy_nbytes > 0 for r in io.history)
    assert held == [state_bytes] * 4, (held, state_bytes)


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
        assert io.session.num_pending == 2 and _staged_bytes(io) == state_bytes
        forward_backward()
        hold.release()
        io.wait_for_snapshot()  # b's copy is done
        opt.step()  # changes nothing b holds
        io.finalize(blocking=True)
        assert _staged_bytes(io) == state_bytes
    for name, expected in (("a", first), ("b", second)):
        assert_tree_equal(io.load_checkpoint(tmp_path / "c" / name, weights_only=False), expected, name)
    assert [r.lazy_nbytes > 0 for r in io.history] == [True, True]
