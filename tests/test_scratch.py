"""A run's scratch directory left by a killed trainer is removed by the next run's ``make_scratch_dir``;
nothing else is.

Real processes and directories: stand-in trainers (children of the test) make their scratch dirs with
``make_scratch_dir`` under ``tmp_path`` (never the real /dev/shm) and print the path; one is killed with
SIGKILL (it cleans up nothing), the other is kept alive, blocked on its stdin, until the check is done.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_asyncckpt.pipeline import scratch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the stand-ins import this checkout's package (first on their path), whatever the environment installed
CHECKOUT_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
TIMEOUT_S = 60

# argv: base dir. Prints its scratch dir, then holds until its stdin closes (or it is killed).
TRAINER = """
import sys
from lightning_asyncckpt.pipeline import scratch
print(scratch.make_scratch_dir(sys.argv[1]), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def ns():
    ns = scratch.pidns()
    if ns == 0:
        pytest.skip("no /proc/self/ns/pid here: the sweep is off")
    return ns


@contextlib.contextmanager
def trainers(base: Path, n: int):
    """``n`` live stand-in trainers with their scratch dirs; each is killed and reaped at the end."""
    procs = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", TRAINER, str(base)], env=CHECKOUT_ENV,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        yield [(p, _read_path(p)) for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.communicate(timeout=TIMEOUT_S)


def _read_path(p: subprocess.Popen) -> Path:
    ready, _, _ = select.select([p.stdout], [], [], TIMEOUT_S)  # bounded: a hung child fails the test
    assert ready, f"trainer {p.pid} printed its scratch dir within {TIMEOUT_S}s"
    path = Path(p.stdout.readline().strip())
    assert path.is_dir(), path
    return path


def _kill(p: subprocess.Popen) -> None:
    p.kill()  # SIGKILL
    p.wait(timeout=TIMEOUT_S)  # reaped: its pid is free (a reuse within this test is not expected)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        p.wait(timeout=TIMEOUT_S)
    finally:
        p.kill()
    return p.pid


def test_the_scratch_dir_of_a_killed_trainer_is_removed_and_nothing_else(tmp_path, ns):
    with trainers(tmp_path, 2) as [(dead, dead_dir), (live, live_dir)]:
        assert dead_dir.name.startswith(f"asyncckpt-{ns}-{dead.pid}-")
        (dead_dir / "3.result").write_bytes(b"x")
        _kill(dead)
        kept = [tmp_path / "asyncckpt-abcd1234",  # the older format: no owner to tell
                tmp_path / f"asyncckpt-{ns + 1}-{dead.pid}-abcd1234",  # another pid namespace's
                tmp_path / "asyncckpt-local"]  # the local tier's: must survive across runs
        for d in kept:
            d.mkdir()
        (tmp_path / f"asyncckpt-{ns}-{dead.pid}-afile").write_text("x")
        kept.append(tmp_path / f"asyncckpt-{ns}-{dead.pid}-afile")

        mine = scratch.make_scratch_dir(tmp_path)

        assert not dead_dir.exists()
        assert live.poll() is None and live_dir.is_dir()  # its trainer is still running
        assert mine.is_dir() and mine.name.startswith(f"asyncckpt-{ns}-{os.getpid()}-")
        assert all(p.exists() for p in kept), [p for p in kept if not p.exists()]
        assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in [live_dir, mine, *kept])


def test_a_sweep_removes_only_dead_processes_dirs_of_our_uid(tmp_path, ns):
    dead = _dead_pid()
    gone = tmp_path / f"asyncckpt-{ns}-{dead}-abcd1234"
    gone.mkdir()
    (tmp_path / f"asyncckpt-{ns}-{dead}-afile").write_text("x")
    os.symlink(tmp_path / "target", tmp_path / f"asyncckpt-{ns}-{dead}-alink")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "keep").write_text("x")
    if os.geteuid() == 0:  # only root can make a directory another user's
        other = tmp_path / f"asyncckpt-{ns}-{dead}-otheruid"
        other.mkdir()
        os.chown(other, 12345, -1)
    assert scratch.sweep_dead(tmp_path) == [gone]
    assert (tmp_path / "target" / "keep").exists()
    assert scratch.sweep_dead(tmp_path) == []


def test_a_sweep_never_raises_and_is_off_without_a_known_pid_namespace(tmp_path, ns):
    dead = _dead_pid()
    odd = [f"asyncckpt-{ns}-{10**30}-abcd1234",  # no such pid can exist: os.kill overflows
           f"asyncckpt-{ns}-x{dead}-abcd1234", f"asyncckpt-{ns}-{dead}-", f"asyncckpt-{ns}-{dead}-a-b",
           f"asyncckpt-{ns}-0-abcd1234", "asyncckpt-spool", "asyncckpt-load-abcd1234"]
    for name in odd:
        (tmp_path / name).mkdir()
    unknown = tmp_path / f"asyncckpt-0-{dead}-abcd1234"
    unknown.mkdir()
    assert scratch.sweep_dead(tmp_path / "missing") == []
    assert scratch.sweep_dead(tmp_path) == []
    assert scratch.sweep_dead(tmp_path, 0) == []  # pidns unreadable: a pid could be another container's
    assert sorted(os.listdir(tmp_path)) == sorted([*odd, unknown.name])
