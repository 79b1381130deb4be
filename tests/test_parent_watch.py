"""A writer ends itself, and removes the run's scratch directory, once its trainer has been killed.

Real processes: a stand-in trainer starts a writer that calls ``parent_watch.exit_with``; the test kills the
trainer with SIGKILL (it can clean up nothing) and waits, bounded, for the writer to go.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the processes import this checkout's package (first on their path), whatever the environment installed
CHECKOUT_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}

# argv: ready file, scratch dir, "poll" to take the path of kernels without pidfd
WRITER = """
import os, sys, time
from lightning_asyncckpt.write import parent_watch
if sys.argv[3] == "poll":
    del os.pidfd_open
parent_watch.exit_with(os.getppid(), sys.argv[2])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)  # a worker waiting on its queue; the test ends it by killing its trainer, or at cleanup
sys.exit(0)
"""

TRAINER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # exited; its new parent reaps it
    except psutil.NoSuchProcess:
        return True


def _wait(what: str, cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g}s"
        time.sleep(0.05)


@pytest.mark.parametrize("watch", ["pidfd", "poll"])
def test_a_writer_whose_trainer_is_killed_exits_and_removes_the_scratch_dir(tmp_path, watch):
    scratch = tmp_path / "asyncckpt-scratch"
    scratch.mkdir()
    (scratch / "3.result").write_bytes(b"x")
    ready = tmp_path / "ready"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, WRITER, str(ready), str(scratch), watch],
                               start_new_session=True, env=CHECKOUT_ENV)
    writer = None
    try:
        _wait("the writer started", ready.exists, 60)
        writer = int(ready.read_text())
        assert not _gone(writer) and scratch.exists()  # the watch does not fire while the trainer lives
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(10)
        _wait("the orphaned writer exited", lambda: _gone(writer), 30)
        assert not scratch.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(trainer.pid, signal.SIGKILL)
        if writer is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(writer, signal.SIGKILL)
        trainer.wait(10)


def test_the_watch_returns_at_once_for_a_process_already_gone():
    from lightning_asyncckpt.write import parent_watch

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    waiting = threading.Thread(target=parent_watch.wait_for_exit, args=(proc.pid,), daemon=True)
    waiting.start()
    waiting.join(30)  # not our parent, and gone: nothing to wait for
    assert not waiting.is_alive()
