"""The run's scratch directory (results and gate files, in ``/dev/shm``), named so that a later run can
tell whether its owner is dead, and the sweep that removes those of dead owners.

``Run.close`` removes a run's scratch directory, and a writer's parent watch removes it when the trainer
dies. A trainer killed (``SIGKILL``, the OOM killer) before any writer started, or together with its
writer, leaves the directory behind: in ``/dev/shm`` that is memory, kept until reboot. So the directory
is named ``asyncckpt-<pidns>-<pid>-<random>`` and every writing rank's ``Run.start``, right before it
makes its own, removes those whose process is gone.

The pid namespace (the inode of ``/proc/self/ns/pid``) is in the name because ``/dev/shm`` can be shared
by containers with different pid namespaces (pods on a node): there, a pid of another namespace says
nothing about liveness here, so only directories of our own namespace (and our uid) are ever removed.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from lightning_asyncckpt.storage import private_dirs

log = logging.getLogger(__name__)

PREFIX = "asyncckpt-"
_FIX = "set TMPDIR to a directory of your own (`mkdir -m 700 ~/tmp; export TMPDIR=~/tmp`)"
_NAME = re.compile(r"asyncckpt-(\d+)-(\d+)-[^-]+")  # pidns, pid, mkdtemp's random part


def pidns() -> int:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``); 0 where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def make_scratch_dir(base: str | Path | None) -> Path:
    """(writing ranks, ``Run.start``, once per run) Removes the scratch directories of dead processes in
    ``base`` (``None``: the system's temporary directory), then makes this process's own there."""
    ns = pidns()
    problem = None if base is None else private_dirs.base_problem(Path(base), "the checkpoint writer", _FIX)
    if problem is not None:  # /dev/shm where others may rename what we make: the temporary directory instead
        log.warning("lightning-asyncckpt: the scratch directory goes to %s instead: %s", tempfile.gettempdir(), problem)
        base = None
    if base is None and (problem := private_dirs.base_problem(Path(tempfile.gettempdir()), "the checkpoint writer",
                                                               _FIX)) is not None:
        raise private_dirs.UntrustedDirectoryError(f"lightning-asyncckpt: {problem}")
    sweep_dead(base, ns)
    # mkdtemp's directory is new (O_EXCL) and 0700: no one else can write into it, and in a sticky (or our own)
    # base no one else can rename it away either
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{ns}-{os.getpid()}-", dir=base))


def sweep_dead(base: str | Path | None, ns: int | None = None) -> list[Path]:
    """(called by :func:`make_scratch_dir`) Removes the scratch directories in ``base`` that belong to
    processes of our pid namespace ``ns`` and uid that no longer exist; returns them. Never raises."""
    ns = pidns() if ns is None else ns
    if ns == 0:
        return []  # namespace unknown: a pid in a name could be another container's, alive there
    root = Path(base if base is not None else tempfile.gettempdir())
    try:
        with os.scandir(root) as it:
            names = [e.name for e in it if e.name.startswith(f"{PREFIX}{ns}-")]
    except OSError:
        return []
    removed = []
    for name in names:
        path = root / name
        if _is_dead_owners(name, path, ns):
            shutil.rmtree(path, ignore_errors=True)  # a second sweeper may be removing it too
            log.debug("lightning-asyncckpt: removed %s, the scratch directory of a dead process", path)
            removed.append(path)
    return removed


def _is_dead_owners(name: str, path: Path, ns: int) -> bool:
    m = _NAME.fullmatch(name)
    if m is None or int(m.group(1)) != ns:
        return False  # not ours by name: an older format, asyncckpt-local, -spool, -load-*, ...
    try:
        st = os.lstat(path)
    except OSError:
        return False  # gone meanwhile
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False  # a file or link with such a name, or another user's: not ours to remove
    return not _alive(int(m.group(2)))


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # kill(0, ...) would mean our process group: no answer about pid 0
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # PermissionError: it exists (another user's); anything else: we cannot tell
    return True
