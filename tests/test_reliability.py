"""Real faults, not injected ones: a killed trainer, a deleted directory, a read-only filesystem; and a soak run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from helpers import combo_params, latest_raise_step
from lightning_asyncckpt.storage import commit
from processes import job_command, launch, rank_reports, run_ranks
from reports import read_report


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _launch(tmp_path, case, engine, worker, timeout, env=None):
    out = tmp_path / "out"
    cmd = [*job_command("crash_job"), "--case", case, "--engine", engine, "--worker", worker, "--out", out]
    return launch(cmd, out, timeout, cwd=tmp_path, env=env, log_name=f"{case}.log")


@pytest.mark.parametrize(("engine", "worker"), combo_params(fast={("nvrx", "persistent")}, combos=[("nvrx", "persistent"), ("mcore", "fork")]))
def test_trainer_killed_mid_write_resumes_from_newest_committed(tmp_path, engine, worker):
    # the 5th and 6th saves (step 12: top-k and last) take a minute: the kill lands in the middle of them
    out = tmp_path / "out"
    with _launch(tmp_path, "train", engine, worker, 120, env={"LIGHTNING_ASYNCCKPT_FAULTS": "slow:save=5+6,delay=60"}) as job:
        while not (out / "ready").exists():
            assert job.running, job.log_text()[-3000:]
            assert time.monotonic() < job.deadline, "the job never reached step 13"
            time.sleep(0.1)
        ready = read_report(out / "ready")
        assert ready["pending"] == 2  # both step-12 writes are in flight
        os.kill(job.proc.pid, signal.SIGKILL)  # the trainer only: an orphaned writer must not commit anything
        job.proc.wait()
        deadline = time.monotonic() + 30  # ...and must not outlive it, holding the staging memory
        while not all(_gone(pid) for pid in ready["workers"]):
            assert time.monotonic() < deadline, f"writers {ready['workers']} outlived their killed trainer"
            time.sleep(0.05)
        entries = sorted(os.listdir(out / "c"))
        assert [e for e in entries if not e.startswith(".")] == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    with _launch(tmp_path, "resume", engine, worker, 180) as job:
        assert job.wait() == 0, job.log_text()[-3000:]
    (resumed,) = rank_reports(out, 1, lambda: job.log_text()[-3000:])
    assert resumed["start"] == 8  # `last` is the newest committed checkpoint, never the interrupted one
    assert resumed["files"] == ["epoch=0-step=12.ckpt", "epoch=0-step=16.ckpt", "last.ckpt"]  # leftovers gone


class _AtStep:
    """Runs ``fn(trainer)`` once, at the end of training step ``step``."""

    def __new__(cls, step, fn):
        import lightning as L

        class Cb(L.Callback):
            def on_train_batch_end(self, trainer, *a):
                if trainer.global_step == step:
                    fn(trainer)

        return Cb()


def _fit_expecting_failure(tmp_path, dirpath, engine, worker, at_step, fn, hold=None, format="auto"):
    """Saves every 4 steps; at the end of step ``at_step``, once the first save is committed, ``fn`` makes the
    disk fail. With ``hold``, the step-8 write is held until then: the fault lands while it is in flight."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from helpers import SlowSteps, TinyModel, loader, trainer
    from lightning_asyncckpt import AsyncCheckpointIO, CheckpointWriteError

    io = AsyncCheckpointIO(engine, worker=worker, format=format)
    ck = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, save_top_k=-1)

    def settle_then(t):
        deadline = time.monotonic() + 60
        while not io.history and time.monotonic() < deadline:  # the first save is committed
            io.finalize()
            time.sleep(0.01)
        fn(t)
        if hold is not None:
            hold.release()

    callbacks = [SlowSteps(), _AtStep(at_step, settle_then), ck]
    if hold is not None:
        callbacks.append(_AtStep(7, lambda t: setattr(io, "write_hook", hold)))  # from the step-8 save on
    t = trainer(tmp_path, [io], callbacks, max_steps=60)
    with pytest.raises(CheckpointWriteError) as info:
        t.fit(TinyModel(width=128), loader(width=128, n=512))
    # the step-8 save fails: raised within steps of it, never at the end of fit
    assert max(8, at_step) <= t.global_step <= latest_raise_step(8) and io.session.worker_pids() == [], t.global_step
    return info.value


@pytest.mark.parametrize(("engine", "worker"), [("nvrx", "persistent"), ("mcore", "fork")], ids=["nvrx-persistent", "mcore-fork"])
def test_checkpoint_directory_deleted_during_the_run(tmp_path, engine, worker, hold):
    """A DCP directory save in flight fails when its directory goes away. (A file save makes the directory
    again, as stock ``TorchCheckpointIO`` does at every save.)"""
    import shutil

    dirpath = tmp_path / "ckpts"
    err = _fit_expecting_failure(tmp_path, dirpath, engine, worker, 9, lambda t: shutil.rmtree(dirpath), hold, "dcp")
    # the save in flight when the directory went away fails, named, with the real cause
    assert err.path.endswith("step=8.ckpt") and err.errno == 2, str(err)
    assert "FileNotFoundError" in str(err)
    # nothing at the failed path and nothing partial; saves scheduled after it (the directory is made
    # again) may still land on the way out, complete
    names = sorted(p.name for p in dirpath.iterdir()) if dirpath.exists() else []
    assert "epoch=0-step=8.ckpt" not in names and not any(commit.is_leftover(n) for n in names), names
    assert all(commit.is_complete(dirpath / n) for n in names), names


@pytest.mark.parametrize(("engine", "worker"), [("nvrx", "fork"), ("mcore", "persistent")], ids=["nvrx-fork", "mcore-persistent"])
def test_read_only_remount(tmp_path, small_tmpfs, engine, worker):
    def remount_ro(t):
        r = subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], capture_output=True)
        assert r.returncode == 0, r.stderr

    try:
        err = _fit_expecting_failure(tmp_path, small_tmpfs / "ckpts", engine, worker, 5, remount_ro)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], capture_output=True)
    assert err.errno == 30 and "EROFS" in str(err), str(err)  # Read-only file system
    assert sorted(os.listdir(small_tmpfs / "ckpts")) == ["epoch=0-step=4.ckpt"]  # the committed one is intact


@pytest.mark.slow
def test_soak_hundred_saves_nothing_grows(tmp_path):
    """100 saves (and 100 of `last`) on 2 ranks with save_top_k=2 (AsyncDDPStrategy, persistent worker)."""
    r0, r1 = run_ranks("ddp_job", tmp_path, "soak", "nvrx", "persistent", timeout=200)
    for r in (r0, r1):
        assert r["saves"] == 200
        assert r["files"] == ["epoch=0-step=100.ckpt", "epoch=0-step=99.ckpt", "last.ckpt"]  # exactly these
        early, late = r["resources"]["10"], r["resources"]["100"]
        assert late["fds"] == early["fds"], (early, late)  # open file descriptors
        assert late["children"] == early["children"], (early, late)  # worker processes
        assert late["shm_maps"] == early["shm_maps"], (early, late)  # shared-memory segments: buffers are reused
        # resident memory of the rank and its worker: +3 MiB of warm-up by save 100, flat after (measured
        # over 900 saves); the worker itself grew ~57 kB per save until it collected its cycles
        assert late["rss"] - early["rss"] < 16 << 20, (early, late)
        assert late["worker_rss"] - early["worker_rss"] < 2 << 20, (early, late)
        assert r["children_after_fit"] == []


_UNSENDABLE = """
import json, sys, torch
from lightning_asyncckpt import AsyncCheckpointIO, CheckpointWriteError
io = AsyncCheckpointIO("nvrx", worker="persistent", timeout_s=600)
io.save_checkpoint({"w": torch.randn(64, 64)}, sys.argv[1])
try:
    io.finalize(blocking=True)
    out = None
except CheckpointWriteError as e:
    out = {"error_type": e.error_type, "message": str(e)}
io.teardown()
print("RESULT " + json.dumps(out))
"""


def test_a_save_that_cannot_reach_the_persistent_worker_fails_at_once(tmp_path):
    """A node-local TMPDIR with a long path (seen with the simulated nodes' directories): handing the
    shared-memory snapshot to the worker fails in the queue's feeder thread (``AF_UNIX path too long``:
    its file descriptors travel through a socket under TMPDIR). The save fails at once, saying why and
    what to do; it used to be dropped silently, the save waiting for its worker until ``timeout_s``."""
    long_tmp = tmp_path / ("t" * 100)
    long_tmp.mkdir()
    out = tmp_path / "out"
    with launch([sys.executable, "-c", _UNSENDABLE, str(tmp_path / "c.ckpt")], out, timeout=120,
                env={"TMPDIR": str(long_tmp)}) as job:
        assert job.wait() == 0, job.log_text()[-3000:]
    line = next(x for x in job.log_text().splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result is not None and result["error_type"] == "WorkerDied", result
    assert "could not be sent to the checkpoint worker" in result["message"], result
    assert "AF_UNIX path too long" in result["message"] and "TMPDIR" in result["message"], result
    assert not (tmp_path / "c.ckpt").exists()
