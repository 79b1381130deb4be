"""(writer processes) A writer ends itself once the trainer that started it is gone.

Only the trainer publishes what a writer writes, so a writer whose trainer was killed (``SIGKILL`` from
the OOM killer, a scheduler's kill after its grace period, a user's ``kill -9``) has nothing useful left
to do. Left alone, the persistent worker would wait on its request queue forever: a process per rank
that holds the staging memory it was sent (one copy of the state in ``/dev/shm``) and keeps the
multiprocessing resource tracker alive, on a node the next job needs. A forked writer would finish a write
that nobody publishes.

So every writer starts :func:`exit_with` first: a daemon thread that waits for the trainer's exit and then
removes the run's scratch directory (its results and gate files) and ends the process. What it was writing
stays in the hidden ``.asyncckpt-incomplete-*`` sibling that the next run's first save removes; nothing
visible changes. No Lightning import here: this runs inside the writer.
"""

from __future__ import annotations

import errno
import os
import select
import shutil
import sys
import threading
import time

POLL_S = 0.5  # where the kernel has no pidfd (before Linux 5.3): how often the parent is checked
EXIT_CODE = 3  # distinct from a crash's 1 and a signal's negative code, for whoever reaps the orphan


def exit_with(trainer_pid: int, scratch_dir: str | None = None) -> None:
    """(writer process, first thing) Starts the watch: once process ``trainer_pid`` (this process's
    parent) has exited, ``scratch_dir`` is removed and this process exits with :data:`EXIT_CODE`."""
    threading.Thread(target=_watch, args=(trainer_pid, scratch_dir), name="asyncckpt-trainer-watch",
                     daemon=True).start()


def wait_for_exit(pid: int) -> None:
    """Returns once process ``pid``, this process's parent, has exited (at once if it has already)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError as e:
        if e.errno == errno.ESRCH:
            return  # gone already
        fd = None  # no pidfd here: poll
    except AttributeError:
        fd = None
    try:
        # A pidfd opened after the trainer died could name a new process that reused its pid: that the
        # parent is still the trainer, checked after the open, rules it out.
        if fd is not None and os.getppid() == pid:
            waiter = select.poll()  # not select(): no limit on the descriptor's number
            waiter.register(fd, select.POLLIN)
            waiter.poll()  # readable once the process has exited; no wake-ups before
            return
        while os.getppid() == pid:  # an orphan is re-parented (to init or a subreaper) when its parent exits
            time.sleep(POLL_S)
    finally:
        if fd is not None:
            os.close(fd)


def _watch(trainer_pid: int, scratch_dir: str | None) -> None:
    wait_for_exit(trainer_pid)
    try:
        print(f"lightning-asyncckpt: writer {os.getpid()}: its trainer (pid {trainer_pid}) has exited;"
              " stopping (nothing it was writing is published)", file=sys.stderr, flush=True)
        if scratch_dir is not None:
            shutil.rmtree(scratch_dir, ignore_errors=True)
    finally:
        os._exit(EXIT_CODE)  # at once: the engine's loop and any write in progress stop with the process
