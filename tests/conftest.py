import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import combo_params, hold_write, live_children, wait_no_children  # noqa: E402


@pytest.fixture(params=combo_params(single=True))
def engine_worker(request):
    return request.param


@pytest.fixture
def hold(tmp_path_factory):
    """A ``testing.HoldWrite`` for this test: set it as the write hook, then ``hold.release()`` (released at the
    end of the test in any case, so that a failing test does not leave a write held)."""
    held = hold_write(tmp_path_factory.mktemp("hold"))
    yield held
    held.release()


@pytest.fixture(autouse=True)
def no_child_processes_left():
    """Every test must leave no process behind: worker, fork, Manager or resource tracker."""
    before = {p.pid for p in live_children()}
    yield
    left = [p for p in wait_no_children() if p.pid not in before]
    for p in left:
        try:
            p.kill()
        except Exception:
            pass
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 4 MiB tmpfs, for real ENOSPC. Skips where mounting is refused."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
