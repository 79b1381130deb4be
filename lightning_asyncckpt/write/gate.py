"""The gate of a write handed to the worker before its lazy snapshot is copied.

A single-writer lazy save is handed to the worker inside the save call, while the background copy of its
parameters and optimizer state still runs, so that the write starts the moment the copy is proven, not at
the next ``optimizer.step()``. The worker's job waits at the gate before it reads a byte of the staging
buffers. The gate holds one decision, made once: ``go`` (the copy is complete and no copied tensor changed)
or ``skip`` (it was torn, failed, timed out or was dropped: the job writes nothing). Whoever decides first
wins (an atomic ``link``): the copy thread when it finishes, or the training thread when it gives up on the
copy; the loser learns the decision that stands.

The gate is a small file in the run's private results directory (never on the checkpoint's filesystem).
Lightning-free: the worker imports it.
"""

from __future__ import annotations

import os
import threading
import time

GO, SKIP = b"go", b"skip"
POLL_S = 0.002  # how often the worker looks at the gate (one failed open, while the copy of ~0.1 s per GiB runs)


class Gate:
    """(trainer) One write's gate at ``path``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)

    def decide(self, go: bool) -> bool:
        """(the copy thread or the training thread) Makes the decision, unless one was made: returns whether
        the decision that stands is the one asked for."""
        want = GO if go else SKIP
        tmp = f"{self.path}.{want.decode()}.{os.getpid()}.{threading.get_ident()}"  # one per deciding thread
        with open(tmp, "wb") as f:
            f.write(want)
        try:
            os.link(tmp, self.path)  # atomic: exactly one decision is ever linked
            return True
        except FileExistsError:
            return self.decision() == want
        finally:
            os.unlink(tmp)

    def decision(self) -> bytes | None:
        """``GO``, ``SKIP``, or ``None`` while undecided."""
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def remove(self) -> None:
        """(trainer, once the worker has reported) The gate is no longer read."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class Skipped(Exception):
    """(worker) The gate said ``skip``: the save was dropped in the trainer, which has reported why."""


def wait(path: str, timeout_s: float) -> None:
    """(worker, before reading the staging buffers) Returns once the gate says ``go``; raises
    :class:`Skipped` for ``skip``, and :class:`TimeoutError` when no decision comes within ``timeout_s``, so
    that a worker never waits forever. A trainer that dies first ends this process sooner
    (:mod:`lightning_asyncckpt.write.parent_watch`, which every writer runs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        decision = Gate(path).decision()
        if decision == GO:
            return
        if decision == SKIP:
            raise Skipped(f"the save was dropped before its write began (gate {path})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the lazy snapshot of this save was not copied within timeout_s={timeout_s:g}s")
        time.sleep(POLL_S)
