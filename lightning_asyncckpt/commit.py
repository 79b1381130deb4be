"""Atomic commit of a checkpoint directory.

A checkpoint at ``P`` is written into a hidden sibling ``.asyncckpt-incomplete-<token>`` on the same
filesystem and becomes ``P`` with one rename, after DCP's ``.metadata`` (its last write) is on disk.
A reader never sees a half-written directory at ``P``: either the old checkpoint or the new one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

# Leftover names never contain the target's name: ModelCheckpoint's `ckpt_path="last"` picks any entry
# whose name contains "last", and must never pick an incomplete save.
INCOMPLETE_PREFIX = ".asyncckpt-incomplete-"
METADATA_FILE = ".metadata"
# Who wrote a checkpoint (library, engine, worker, world size, step): written with rank 0's shards by its
# worker, so it is on disk before ``.metadata``. DCP and Lightning readers ignore it; ``inspect`` shows it.
INFO_FILE = ".asyncckpt.json"

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = None


def tmp_for(path: Path, token: str) -> Path:
    """The hidden sibling that a save to ``path`` writes into."""
    return path.parent / f"{INCOMPLETE_PREFIX}{token}"


def is_leftover(name: str) -> bool:
    """Whether a directory entry is the remains of an interrupted save."""
    return name.startswith(INCOMPLETE_PREFIX)


def is_committed(path: Path) -> bool:
    """A checkpoint directory is complete when DCP's metadata file is in it."""
    return path.is_dir() and (path / METADATA_FILE).is_file()


def info_bytes(info: dict) -> bytes:
    """The content of ``INFO_FILE`` for ``info``."""
    return (json.dumps(info, indent=1, sort_keys=True) + "\n").encode()


def read_info(path: Path) -> dict | None:
    """The ``INFO_FILE`` of a checkpoint directory, or None (written by another tool, or unreadable)."""
    try:
        with open(path / INFO_FILE) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux ``renameat2(RENAME_EXCHANGE)``). False where unsupported."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the filesystem or kernel cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


def remove_path(path: Path) -> None:
    """Removes a checkpoint (directory, file or link) if it exists."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def publish(tmp: Path, path: Path) -> None:
    """(coordinator) Makes the complete checkpoint in ``tmp`` visible at ``path``.

    An existing checkpoint at ``path`` (``last.ckpt``) is replaced in one step: the two are exchanged
    atomically and the old one, now at ``tmp``, is deleted.
    """
    if not (tmp / METADATA_FILE).is_file():
        raise FileNotFoundError(f"refusing to publish {tmp}: it has no {METADATA_FILE}")
    _fsync_dir(tmp)
    if os.path.lexists(path):
        if not _exchange(tmp, path):
            # Fallback without an atomic exchange: the old one is moved aside (still a leftover name)
            aside = tmp.with_name(tmp.name + "-replaced")
            os.rename(path, aside)
            os.rename(tmp, path)
            tmp = aside
        remove_path(tmp)
    else:
        os.rename(tmp, path)
    _fsync_dir(path.parent)


def cleanup_leftovers(dirpath: Path, keep_prefix: str | None = None) -> list[Path]:
    """(coordinator) Removes the remains of interrupted saves in ``dirpath``, except the current run's
    (names starting with ``keep_prefix``), which may be in flight on any rank."""
    removed: list[Path] = []
    if not dirpath.is_dir():
        return removed
    for entry in dirpath.iterdir():
        if is_leftover(entry.name) and not (keep_prefix and entry.name.startswith(keep_prefix)):
            remove_path(entry)
            removed.append(entry)
    if removed:
        log.info("lightning-asyncckpt: removed %d leftover(s) of interrupted saves in %s", len(removed), dirpath)
    return removed
