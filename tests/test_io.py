"""AsyncCheckpointIO on its own (no Trainer, no process group): real engine queues, real workers, real files."""

import dataclasses
import errno
import gc
import os
import signal
import threading
import time

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from helpers import assert_tree_equal, clone_tree
from lightning_asyncckpt import AsyncCheckpointIO, CheckpointWriteError, testing
from lightning_asyncckpt.storage import commit
from processes import live_children


@dataclasses.dataclass
class Config:
    name: str
    depth: int


def _checkpoint(scale=1.0):
    return {
        "epoch": 3,
        "global_step": 120,
        "state_dict": {"layer.weight": torch.randn(32, 16) * scale, "layer.bias": torch.randn(32).to(torch.bfloat16)},
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(32, 16)}, 1: {"step": torch.tensor(5.0)}},
                "param_groups": [{"params": [0, 1], "lr": 1e-3, "betas": (0.9, 0.999)}],
            }
        ],
        "extras": {"half": torch.ones(4, dtype=torch.float16), "ints": torch.arange(5), "mask": torch.tensor([True, False])},
        "hyper_parameters": {"cfg": Config("x", 2), "names": ["a", "b"]},
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 3}}}},
    }


@pytest.fixture
def io(engine_worker):
    engine, worker = engine_worker
    plugin = AsyncCheckpointIO(engine, worker=worker, timeout_s=60)
    yield plugin
    plugin.teardown()


def test_round_trip_is_exact(io, tmp_path):
    ckpt = _checkpoint()
    expected = clone_tree(ckpt)
    io.save_checkpoint(ckpt, tmp_path / "a.ckpt")
    loaded = io.load_checkpoint(tmp_path / "a.ckpt", weights_only=False)
    assert_tree_equal(loaded, expected)
    assert type(next(iter(loaded["optimizer_states"][0]["state"]))) is int


def test_save_returns_before_the_write_and_is_a_snapshot(io, tmp_path, hold):
    io.write_hook = hold  # the write waits until the state has changed
    ckpt = _checkpoint()
    expected = clone_tree(ckpt)
    path = tmp_path / "a.ckpt"
    io.save_checkpoint(ckpt, path)
    assert not path.exists() and io.session.num_pending == 1
    for t in (ckpt["state_dict"]["layer.weight"], ckpt["optimizer_states"][0]["state"][0]["exp_avg"]):
        t.mul_(-3.0).add_(7.0)  # the training step changes everything right away
    hold.release()
    assert [r.path for r in io.finalize(blocking=True)] == [str(path)]
    assert commit.is_complete(path)
    assert_tree_equal(io.load_checkpoint(path, weights_only=False), expected)


def test_the_file_is_stock_lightnings_file(io, tmp_path):
    """The default format: the very file stock ``TorchCheckpointIO`` writes for the same checkpoint dict,
    byte for byte (so key by key, tensor by tensor, dtype by dtype), and it loads the stock ways."""
    from lightning.fabric.plugins import TorchCheckpointIO

    ckpt = _checkpoint()
    ckpt["state_dict"]["tied"] = ckpt["state_dict"]["layer.weight"]  # tied weights stay one storage
    ckpt["state_dict"]["half"] = torch.arange(6, dtype=torch.bfloat16)
    TorchCheckpointIO().save_checkpoint(ckpt, tmp_path / "stock.ckpt")
    io.save_checkpoint(ckpt, tmp_path / "ours.ckpt")
    io.finalize(blocking=True)
    ours, stock = torch.load(tmp_path / "ours.ckpt", weights_only=False), torch.load(tmp_path / "stock.ckpt", weights_only=False)
    assert_tree_equal(ours, stock, strict=True)
    assert ours["state_dict"]["tied"].untyped_storage().data_ptr() == ours["state_dict"]["layer.weight"].untyped_storage().data_ptr()
    assert (tmp_path / "ours.ckpt").read_bytes() == (tmp_path / "stock.ckpt").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["ours.ckpt", "stock.ckpt"]


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return [t for v in values for t in _tensors(v)]


def test_dcp_format_is_readable_with_plain_torch_dcp(engine_worker, tmp_path):
    engine, worker = engine_worker
    io = AsyncCheckpointIO(engine, worker=worker, format="dcp")
    ckpt = _checkpoint()
    io.save_checkpoint(ckpt, tmp_path / "a.ckpt")
    io.finalize(blocking=True)
    dcp_to_torch_save(tmp_path / "a.ckpt", tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    # the plain DCP view is the checkpoint dict and nothing else (no placeholders, no extra items); DCP
    # itself turns the optimizer state's int keys into list positions
    assert sorted(plain) == sorted(ckpt)
    assert torch.equal(plain["state_dict"]["layer.weight"], ckpt["state_dict"]["layer.weight"])
    assert torch.equal(plain["optimizer_states"][0]["state"][0]["exp_avg"], ckpt["optimizer_states"][0]["state"][0]["exp_avg"])
    assert plain["global_step"] == 120 and plain["epoch"] == 3
    assert not any(t.device.type == "meta" for t in _tensors(plain))
    assert sorted(os.listdir(tmp_path / "a.ckpt")) == [".asyncckpt-skeleton.pt", ".asyncckpt.json", ".metadata", "__0_0.distcp"]
    assert_tree_equal(io.load_checkpoint(tmp_path / "a.ckpt", weights_only=False), ckpt)  # ours: exact
    info = commit.read_info(tmp_path / "a.ckpt")
    assert (info["engine"], info["worker"], info["layout"]) == (io.engine, io.settings.worker, "single-writer")
    assert (info["world_size"], info["writing_ranks"], info["global_step"]) == (1, 1, 120)
    io.teardown()


def test_resave_replaces_only_at_commit_and_removal_waits(io, tmp_path, hold):
    last = tmp_path / "last.ckpt"
    old = clone_tree(_checkpoint(1.0))
    io.save_checkpoint(clone_tree(old), last)
    io.finalize(blocking=True)
    io.write_hook = hold
    io.save_checkpoint(_checkpoint(2.0), last)
    io.save_checkpoint(_checkpoint(3.0), tmp_path / "b.ckpt")
    io.remove_checkpoint(last)  # asked while `last` is still being rewritten: must wait
    # meanwhile `last` is the old checkpoint, complete (read without settling the pending saves)
    assert commit.is_complete(last)
    assert_tree_equal(torch.load(last, weights_only=False), old)
    hold.release()
    io.finalize(blocking=True)
    assert not last.exists()  # removed only after the newer saves committed
    assert commit.is_complete(tmp_path / "b.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["b.ckpt"]


def test_load_waits_for_pending_saves(io, tmp_path):
    io.write_hook = testing.DelayWrite(0.5)
    ckpt = _checkpoint()
    expected = clone_tree(ckpt)
    io.save_checkpoint(ckpt, tmp_path / "a.ckpt")
    assert_tree_equal(io.load_checkpoint(tmp_path / "a.ckpt", weights_only=False), expected)


def test_real_enospc_is_raised_once_and_nothing_is_left(io, small_tmpfs):
    good = small_tmpfs / "good.ckpt"
    io.save_checkpoint({"w": torch.ones(1000)}, good)
    io.finalize(blocking=True)
    big = small_tmpfs / "big.ckpt"
    io.save_checkpoint({"w": torch.ones(2_000_000)}, big)  # 8 MB into a 4 MiB tmpfs
    with pytest.raises(CheckpointWriteError) as exc_info:
        io.finalize(blocking=True)
    err = exc_info.value
    assert err.path == str(big) and err.ranks == (0,) and err.errno == errno.ENOSPC
    assert "ENOSPC" in str(err) and str(big) in str(err)
    io.finalize(blocking=True)  # raised once only
    assert sorted(os.listdir(small_tmpfs)) == ["good.ckpt"]
    assert torch.equal(io.load_checkpoint(good)["w"], torch.ones(1000))


def test_killed_worker_is_detected_and_the_next_save_works(io, tmp_path, hold):
    io.write_hook = hold  # never released: the worker dies in the middle of the write
    io.save_checkpoint({"w": torch.ones(10)}, tmp_path / "a.ckpt")
    pids = io.session.worker_pids()
    assert pids
    hold.wait_started()
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(CheckpointWriteError, match="SIGKILL") as exc_info:
        io.finalize(blocking=True)
    assert time.monotonic() - t0 < 10
    assert exc_info.value.error_type == "WorkerDied"
    assert not (tmp_path / "a.ckpt").exists() and os.listdir(tmp_path) == []
    io.write_hook = None
    io.save_checkpoint({"w": torch.ones(10)}, tmp_path / "b.ckpt")
    io.finalize(blocking=True)
    assert commit.is_complete(tmp_path / "b.ckpt")


def test_hung_write_times_out(engine_worker, tmp_path):
    engine, worker = engine_worker
    io = AsyncCheckpointIO(engine, worker=worker, timeout_s=1.0)
    try:
        io.write_hook = testing.DelayWrite(60.0)
        io.save_checkpoint({"w": torch.ones(10)}, tmp_path / "a.ckpt")
        with pytest.raises(CheckpointWriteError, match="timeout_s=1") as exc_info:
            io.finalize(blocking=True)
        assert exc_info.value.error_type == "TimeoutError"
    finally:
        io.teardown()


def test_crash_in_the_middle_of_a_write(io, tmp_path):
    io.write_hook = testing.CrashWrite()
    io.save_checkpoint({"w": torch.ones(10)}, tmp_path / "a.ckpt")
    with pytest.raises(CheckpointWriteError, match="exited with code 13"):
        io.finalize(blocking=True)
    assert os.listdir(tmp_path) == []


def test_bad_input_fails_at_save_time(io, tmp_path):
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "a.ckpt", storage_options={"compress": True})
    with pytest.raises(ValueError, match="no filesystem for 'nosuchscheme://'"):
        io.save_checkpoint({"w": torch.ones(1)}, "nosuchscheme://bucket/a.ckpt")
    (tmp_path / "notes").mkdir()
    with pytest.raises(IsADirectoryError, match="not a checkpoint"):
        io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "notes")
    with pytest.raises(TypeError, match="cannot pickle"):
        io.save_checkpoint({"w": torch.ones(1), "lock": threading.Lock()}, tmp_path / "b.ckpt")
    with pytest.raises(TypeError, match=r"checkpoint path must be a str or os.PathLike .*; got dict \{'global_step': 2\}"):
        io.save_checkpoint({"w": torch.ones(1)}, {"global_step": 2})  # e.g. the arguments swapped
    assert sorted(os.listdir(tmp_path)) == ["notes"]
    assert io.session.num_pending == 0


def test_loads_a_torch_save_file(io, tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "plain.ckpt")["w"], torch.ones(2))


def test_leftovers_of_interrupted_saves_are_removed(io, tmp_path):
    import subprocess
    import sys

    crashed = subprocess.Popen([sys.executable, "-c", "pass"])
    crashed.wait()  # the process that owned the leftover is gone
    stale = commit.tmp_for(tmp_path / "a.ckpt", f"{commit.new_token(crashed.pid)}-1")
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "b.ckpt")
    io.finalize(blocking=True)
    assert sorted(os.listdir(tmp_path)) == ["b.ckpt"]


def test_context_manager_commits_on_exit_and_does_not_mask_errors(engine_worker, tmp_path, hold):
    engine, worker = engine_worker
    with AsyncCheckpointIO(engine, worker=worker) as io:
        io.write_hook = hold
        io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "a.ckpt")
        assert not (tmp_path / "a.ckpt").exists()
        hold.release()  # still in flight when the block ends
    assert commit.is_complete(tmp_path / "a.ckpt") and io.session.worker_pids() == []

    with pytest.raises(KeyError, match="user error"):
        with AsyncCheckpointIO(engine, worker=worker) as io:
            io.write_hook = testing.FailWrite()
            io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "b.ckpt")
            raise KeyError("user error")  # not masked by the failing save
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt"]


def test_warmup_with_a_state_prepares_the_buffers_of_the_first_save(engine_worker, tmp_path):
    engine, worker = engine_worker
    ckpt = _checkpoint()
    with AsyncCheckpointIO(engine, worker=worker) as io:
        io.warmup(like=ckpt)
        prepared = io.session.staging_buffers()
        if worker == "persistent":  # fork per save copies nothing on the CPU: nothing to prepare
            assert len(prepared) == 8  # every tensor of the checkpoint
        else:
            assert prepared == []  # so the reuse check below holds for persistent workers only
        io.save_checkpoint(ckpt, tmp_path / "a.ckpt")
        used = io.session.staging_buffers()
        assert len(used) == len(prepared) and all(any(u is p for p in prepared) for u in used)  # reused, not new
    assert_tree_equal(torch.load(tmp_path / "a.ckpt", weights_only=False), ckpt)


def test_a_forked_writer_never_runs_the_finalizers_of_the_trainers_garbage(tmp_path):
    """A fork-per-save writer collects garbage (each write does): never the trainer's, whose finalizers may
    wait on threads that do not exist in the child (a process group's), or on locks those held."""
    marks = tmp_path / "finalized"
    marks.mkdir()

    class Cycle:
        def __del__(self):
            (marks / str(os.getpid())).touch()

    io = AsyncCheckpointIO("nvrx", worker="fork", timeout_s=60)
    try:
        gc.disable()  # the cycle is still uncollected garbage in the trainer when the writer forks
        try:
            cycle = Cycle()
            cycle.me = cycle
            del cycle
            io.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt")
        finally:
            gc.enable()
        io.finalize(blocking=True)
    finally:
        io.teardown()
    gc.collect()
    assert sorted(p.name for p in marks.iterdir()) == [str(os.getpid())]  # finalized here, once


def test_a_forked_writer_that_hangs_before_it_starts_is_forked_again(tmp_path, monkeypatch, caplog):
    """A child forked from a process with other threads can hang inside ``fork``, before any Python runs
    (seen in CI: the writer's stack stopped at ``os.fork``). The save kills it and forks again while the
    state is still this step's; the checkpoint lands and holds the state at save time."""
    from lightning_asyncckpt.engines import base
    from lightning_asyncckpt.write import worker

    first = tmp_path / "first-child-hung"

    def hang_the_first_child():  # runs in the forked child
        if not first.exists():
            first.touch()
            time.sleep(3600)

    monkeypatch.setattr(worker, "before_start", hang_the_first_child)
    monkeypatch.setattr(base, "FORK_START_S", 1.0)
    io = AsyncCheckpointIO("nvrx", worker="fork", timeout_s=60)
    try:
        ckpt = _checkpoint()
        expected = clone_tree(ckpt)
        with caplog.at_level("WARNING", logger="lightning_asyncckpt"):
            io.save_checkpoint(ckpt, tmp_path / "a.ckpt")
        ckpt["state_dict"]["layer.weight"].add_(1.0)  # training goes on after save returns
        io.finalize(blocking=True)
        assert_tree_equal(io.load_checkpoint(tmp_path / "a.ckpt", weights_only=False), expected)
    finally:
        io.teardown()
    assert first.exists() and "did not start within 1s (attempt 1 of 3" in caplog.text
    assert live_children() == []


def test_teardown_inside_a_users_except_block_still_raises_a_failed_write(engine_worker, tmp_path):
    """A retry or fallback loop runs training inside an ``except`` block: teardown there is a normal
    teardown (not an abort), so a failed write is raised, not only logged."""
    engine, worker = engine_worker
    io = AsyncCheckpointIO(engine, worker=worker, timeout_s=60)
    try:
        raise RuntimeError("the first attempt failed; the user retries")
    except RuntimeError:
        io.write_hook = testing.FailWrite()
        io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "retry.ckpt")
        with pytest.raises(CheckpointWriteError, match="retry.ckpt") as raised:
            io.teardown()
    assert raised.value.errno == errno.ENOSPC and io.session.worker_pids() == []


def test_abort_logs_what_goes_wrong_while_stopping(engine_worker, tmp_path, monkeypatch, caplog):
    """``abort`` never raises (it runs beside the user's exception), but says what went wrong; the run still
    frees its buffers and scratch directory (the conftest guard fails a test that leaves one)."""
    engine, worker = engine_worker
    io = AsyncCheckpointIO(engine, worker=worker, timeout_s=60)
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "a.ckpt")
    from lightning_asyncckpt.engines import Engine

    real_close = Engine.close

    def failing_close(self, abort=False):
        real_close(self, abort=abort)
        raise RuntimeError("the worker could not be stopped cleanly")

    monkeypatch.setattr(Engine, "close", failing_close)
    with caplog.at_level("ERROR", logger="lightning_asyncckpt"):
        io.abort()  # does not raise
    assert "the worker could not be stopped cleanly" in caplog.text


def test_a_checkpoint_that_cannot_be_removed_is_named_in_a_warning(engine_worker, tmp_path, caplog):
    """A top-k removal that fails (here: a directory checkpoint holds a busy mount point) is not silent."""
    import subprocess

    io = AsyncCheckpointIO(engine_worker[0], worker=engine_worker[1], format="dcp")
    old = tmp_path / "epoch=0.ckpt"
    io.save_checkpoint({"w": torch.ones(3)}, old)
    io.finalize(blocking=True)
    inner = old / "pinned"
    inner.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(inner)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with caplog.at_level("WARNING", logger="lightning_asyncckpt"):
            io.remove_checkpoint(old)
        assert "could not remove" in caplog.text and str(old) in caplog.text
    finally:
        io.teardown()
        subprocess.run(["umount", "-l", str(inner)], capture_output=True)


def test_the_non_tensor_state_is_a_snapshot_too(io, tmp_path, hold):
    """An object in the checkpoint that training changes right after the save (a callback's state, a config)
    is saved as it was at save time, as the tensors are."""
    io.write_hook = hold
    ckpt = {"w": torch.ones(4), "cfg": Config("run", 1)}
    io.save_checkpoint(ckpt, tmp_path / "a.ckpt")
    ckpt["cfg"].depth = 99  # the next step changes it in place
    hold.release()
    io.finalize(blocking=True)
    assert io.load_checkpoint(tmp_path / "a.ckpt", weights_only=False)["cfg"] == Config("run", 1)
