"""Atomic commit of a checkpoint directory, and the leftovers of interrupted saves.

A checkpoint at ``P`` is written into a hidden sibling ``.asyncckpt-incomplete-<token>`` on the same
filesystem and becomes ``P`` with one rename, after DCP's ``.metadata`` (its last write) is on disk.
A reader never sees a half-written directory at ``P``: either the old checkpoint or the new one.

A token names the process that owns the save (``<host>.<pid>.<random>``), so that a leftover is removed
only once it is provably dead: this run's own, or one whose process on this host is gone. A second job
saving into the same directory keeps its saves in flight.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import logging
import os
import shutil
import socket
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

# Leftover names never contain the target's name: ModelCheckpoint's `ckpt_path="last"` picks any entry
# whose name contains "last", and must never pick an incomplete save.
INCOMPLETE_PREFIX = ".asyncckpt-incomplete-"
# Where the fallback publish (no atomic exchange) moves the checkpoint it replaces for a moment. The name
# carries the target's name in hex (never "last": ckpt_path="last" must not pick it), so that a crash
# between the two renames is undone by putting it back.
REPLACED_PREFIX = ".asyncckpt-replaced-"
METADATA_FILE = ".metadata"
# Who wrote a checkpoint (library, engine, worker, world size, step): written with rank 0's shards by its
# worker, so it is on disk before ``.metadata``. DCP and Lightning readers ignore it; ``inspect`` shows it.
INFO_FILE = ".asyncckpt.json"
# The replicated DCP layouts' skeleton (the checkpoint dict with tensor placeholders: exact container types,
# int keys, hyper-parameter objects), beside the DCP items, outside what plain DCP reads
SKELETON_FILE = ".asyncckpt-skeleton.pt"

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = None


def _host_id() -> str:
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return hashlib.sha1(f"{socket.gethostname()}/{boot}".encode()).hexdigest()[:8]


def new_token(pid: int | None = None) -> str:
    """A new run's token: this host, the owning process (this one by default), and a random part
    (``<host>.<pid>.<random>``)."""
    return f"{_host_id()}.{os.getpid() if pid is None else pid}.{uuid.uuid4().hex[:6]}"


def tmp_for(path: Path, token: str) -> Path:
    """The hidden sibling that a save to ``path`` writes into."""
    return path.parent / f"{INCOMPLETE_PREFIX}{token}"


def is_leftover(name: str) -> bool:
    """Whether a directory entry is the remains of an interrupted save."""
    return name.startswith((INCOMPLETE_PREFIX, REPLACED_PREFIX))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_is_dead(name: str) -> bool:
    """Whether the process that owned the leftover ``name`` is provably gone: it ran on this host and its
    pid no longer exists. Leftovers of other hosts (a shared filesystem) are never provably dead."""
    token = name[len(INCOMPLETE_PREFIX):] if name.startswith(INCOMPLETE_PREFIX) else name[len(REPLACED_PREFIX):]
    parts = token.split("-", 1)[0].split(".")
    if len(parts) >= 3:  # <host>.<pid>.<random>
        host, pid = parts[0], parts[1]
        if host != _host_id():
            return False
    else:  # 0.1's tokens: <pid><6 hex>, written on this host
        pid = parts[0][:-6]
    return pid.isdigit() and not _pid_alive(int(pid))


def saves_in_flight(dirpath: Path) -> bool:
    """Whether ``dirpath`` holds the hidden file of a save that some live process is still writing (any
    host's: one on another host is never provably dead). Another rank's load waits on it."""
    try:
        entries = list(dirpath.iterdir())
    except OSError:
        return False
    return any(e.name.startswith(INCOMPLETE_PREFIX) and not owner_is_dead(e.name) for e in entries)


def is_committed(path: Path) -> bool:
    """A checkpoint directory is complete when DCP's metadata file is in it."""
    return path.is_dir() and (path / METADATA_FILE).is_file()


def is_complete(path: Path) -> bool:
    """A checkpoint of either format is complete: a file (it appears only whole, by one rename), or a
    directory holding DCP's metadata."""
    return (path.is_file() and not is_leftover(path.name)) or is_committed(path)


def info_bytes(info: dict) -> bytes:
    """The content of ``INFO_FILE`` for ``info``."""
    return (json.dumps(info, indent=1, sort_keys=True) + "\n").encode()


def read_info(path: Path) -> dict | None:
    """The ``INFO_FILE`` of a checkpoint directory, or None (written by another tool, or unreadable; a FIFO or a
    symlink there is not read: it could block or lead outside)."""
    from lightning_asyncckpt.format.integrity import CorruptCheckpointError, open_regular

    try:
        with open_regular(path / INFO_FILE, follow=False) as f:
            info = json.loads(f.read(1 << 20))
    except (OSError, ValueError, CorruptCheckpointError):
        return None
    return info if isinstance(info, dict) else None


def fsync_dir(path: Path) -> None:
    """Makes renames inside ``path`` durable."""
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
    """Removes a checkpoint (directory, file or link) if it exists; raises ``OSError`` if it cannot."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path)


def try_remove(path: Path, what: str) -> bool:
    """Removes ``path``; on failure logs a warning that names it and says what is left behind."""
    try:
        remove_path(path)
    except OSError as e:
        log.warning("lightning-asyncckpt: could not remove %s %s (%s); it is left on disk", what, path, e)
        return False
    return True


def publish(tmp: Path, path: Path) -> None:
    """(coordinator) Makes the complete checkpoint in ``tmp`` visible at ``path``.

    An existing checkpoint at ``path`` (``last.ckpt``) is replaced in one step: the two are exchanged
    atomically and the old one, now at ``tmp``, is deleted.
    """
    if not (tmp / METADATA_FILE).is_file():
        raise FileNotFoundError(f"refusing to publish {tmp}: it has no {METADATA_FILE}")
    fsync_dir(tmp)
    if os.path.lexists(path):
        if not _exchange(tmp, path):
            tmp = _replace_via_aside(tmp, path)  # no atomic exchange here (NFS, Lustre, FUSE)
        fsync_dir(path.parent)
        try_remove(tmp, "the replaced checkpoint")
    else:
        os.rename(tmp, path)
    fsync_dir(path.parent)


def _replace_via_aside(tmp: Path, path: Path) -> Path:
    """Replaces ``path`` by ``tmp`` in two renames; returns where the old one went. The old one is moved
    aside under a name that says where it belongs, so that a crash between the renames puts it back
    (``restore_replaced``) instead of losing both."""
    aside = path.parent / f"{REPLACED_PREFIX}{tmp.name[len(INCOMPLETE_PREFIX):]}-{path.name.encode().hex()}"
    os.rename(path, aside)
    fsync_dir(path.parent)
    os.rename(tmp, path)
    return aside


def replace_dir_with_file(tmp: Path, path: Path) -> None:
    """(coordinator) A checkpoint file replaces the checkpoint directory at ``path`` (a file cannot be
    renamed over a directory): the directory goes aside, the file in, then the directory is removed."""
    aside = _replace_via_aside(tmp, path)
    fsync_dir(path.parent)
    try_remove(aside, "the replaced checkpoint")


def _replaced_target(entry: Path) -> Path | None:
    try:
        return entry.parent / bytes.fromhex(entry.name.rsplit("-", 1)[1]).decode()
    except (IndexError, ValueError):
        return None


def restore_replaced(dirpath: Path) -> list[Path]:
    """(coordinator) Undoes a fallback publish that died between its two renames: the checkpoint moved
    aside goes back to its path when nothing is there. Returns the restored paths."""
    restored = []
    for entry in dirpath.iterdir() if dirpath.is_dir() else ():
        if not entry.name.startswith(REPLACED_PREFIX) or not owner_is_dead(entry.name):
            continue
        target = _replaced_target(entry)
        if target is not None and not os.path.lexists(target):
            os.rename(entry, target)
            restored.append(target)
            log.warning("lightning-asyncckpt: restored %s, which an interrupted save had moved aside", target)
    return restored


def cleanup_leftovers(dirpath: Path, keep_prefix: str | None = None) -> list[Path]:
    """(coordinator, at the first save into ``dirpath``) Puts back a checkpoint that an interrupted
    publish moved aside, then removes the remains of interrupted saves whose process is provably gone
    (:func:`owner_is_dead`). The current run's (names starting with ``keep_prefix``) may be in flight on
    any rank, and other live jobs' too: both are kept."""
    removed: list[Path] = []
    if not dirpath.is_dir():
        return removed
    restore_replaced(dirpath)
    for entry in dirpath.iterdir():
        if not is_leftover(entry.name) or (keep_prefix and entry.name.startswith(keep_prefix)):
            continue
        if owner_is_dead(entry.name) and try_remove(entry, "the leftover"):
            removed.append(entry)
    if removed:
        log.info("lightning-asyncckpt: removed %d leftover(s) of interrupted saves in %s", len(removed), dirpath)
    return removed
