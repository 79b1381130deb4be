"""One job at a time in a session directory: an exclusive lock held for the run's life.

Two jobs started with the same ``dir`` and ``session`` on one node would write, reuse and remove each other's
files (one job's start removes the other's spare files; its sweeps remove the other's steps) and crash each
other mid-run. So at setup, before the tier writes anything of its own, the lowest global rank on each node
takes ``<root>/lock`` (0600, never through a symlink) with ``flock(LOCK_EX | LOCK_NB)`` and keeps it open
until the run's tier is closed; the file then names its host and pid. The node's other ranks take nothing,
so the ranks of one job never conflict with each other. A second job's rank finds the lock held and every
rank of that job refuses at setup (``checks.agree``), naming the first job's host and pid.

The kernel releases a ``flock`` when its process ends, however it ends: a job requeued after a crash (or a
SIGKILL) takes the lock over, whatever its pids. A process forked from the holder (a fork-per-save writer, a
``DataLoader`` worker) closes its copy of the descriptor at once (``os.register_at_fork``), and an ``exec``
closes it (``O_CLOEXEC``): a child that outlives the job never keeps the session locked. A file system without ``flock`` (not a node-local one) gets
a warning and no check.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from lightning_asyncckpt.tiers import checks, trusted_dirs

log = logging.getLogger(__name__)

LOCK = "lock"
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
_READ_TRIES = 40  # a holder writes its name right after it takes the lock: a few ms; at most 2 s here
_HELD_FDS: set[int] = set()  # this process's lock descriptors, closed in a forked child


def _close_in_child() -> None:
    # the child's copies only: the lock (on the open file description) stays the parent's
    for fd in list(_HELD_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_FDS.clear()


os.register_at_fork(after_in_child=_close_in_child)


class JobLock:
    """(one rank: the lowest global rank of its node) The session's lock, held from :meth:`take` to :meth:`release`."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / LOCK
        self._fd: int | None = None

    def take(self, what: str) -> str | None:
        """Takes the lock; returns None, or why not (``what``: the ``LocalTier(...)`` the message names)."""
        try:
            # asyncckpt-local/ and the session 0700 whatever the umask, never through a link (trusted_dirs)
            trusted_dirs.make(self.path.parent, self.path.parent.parent.parent)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            return f"{what}: cannot open the session's lock file {self.path}: {e}"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in _HELD:
                log.warning("lightning-asyncckpt: %s: cannot lock %s (%s): a second job in the same directory and"
                            " session would not be detected", what, self.path, e)
                return None
            return (f"{what}: another job uses this directory and session on this node: {self._holder()} holds"
                    f" {self.path}. Two jobs in one session overwrite and remove each other's local checkpoints."
                    " Fix: give this job its own `session=` (or `dir=`), or wait for that job to end.")
        self._fd = fd
        _HELD_FDS.add(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode(), 0)
        return None

    def _holder(self) -> str:
        """The host and pid the lock file names (its holder writes them right after taking it)."""
        for _ in range(_READ_TRIES):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    raw = json.loads(os.read(fd, 4096))
                finally:
                    os.close(fd)
                return f"the job of host {raw['host']!r}, pid {int(raw['pid'])},"
            time.sleep(0.05)  # bounded: the holder has the lock and is writing its name
        return "a job that has not written its host and pid (yet)"

    def release(self) -> None:
        """Lets the lock go (also when the process ends). The file stays: removing it would let a third job
        lock a new file while a second still holds the old one."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            if fd in _HELD_FDS:  # else a forked child's, closed at the fork: its number may be another file's now
                _HELD_FDS.discard(fd)
                # unlock the open file itself first: a child forked a moment ago shares it until its at-fork
                # hook closes its copy, and a plain close would leave the lock held by that copy meanwhile
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)


def exclusive(root: Path, leader: bool, what: str, gather: checks.Gather) -> JobLock:
    """(every rank, together, at setup) The session's lock, taken by each node's ``leader`` (its lowest global
    rank); raises ``TierConfigError`` on every rank where any rank could not take it (none then holds it)."""
    lock = JobLock(root)
    try:
        checks.agree(lock.take(what) if leader else None, gather)
    except BaseException:
        lock.release()
        raise
    return lock
