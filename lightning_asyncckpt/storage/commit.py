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
import enum
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from lightning_asyncckpt.storage.regular_files import CorruptCheckpointError, open_regular

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
    return owner_of(name)[0] is Owner.DEAD


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
    """Removes a checkpoint (directory, file or link) if it exists; raises ``OSError`` if it cannot. A link
    is removed as a link, and ``shutil.rmtree`` (which works through directory descriptors here, and
    refuses a directory swapped for a link meanwhile) never follows one below: nothing outside ``path``
    is removed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


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


def publish_file(tmp: Path, path: Path) -> None:
    """(trainer) Makes the complete file ``tmp`` visible at ``path``: one ``os.replace`` (atomic on every
    POSIX filesystem; an existing ``path``, e.g. ``last.ckpt``, is replaced in the same step), then an
    fsync of the directory so that the rename itself is durable."""
    tmp, path = Path(tmp), Path(path)
    if not tmp.is_file():
        raise FileNotFoundError(f"refusing to publish {tmp}: it is not a written checkpoint file")
    if path.is_dir() and not path.is_symlink():
        replace_dir_with_file(tmp, path)  # a checkpoint directory of 0.1 (format="dcp") at that path
        return
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _replaced_target(entry: Path) -> Path | None:
    """Where the aside ``entry`` belongs: the name its suffix spells in hex, in the same directory. None for
    a name that is no plain entry name (``..``, ``a/b``, a leftover's), which is never put back anywhere."""
    try:
        name = bytes.fromhex(entry.name.rsplit("-", 1)[1]).decode()
    except (IndexError, ValueError):
        return None
    if name in ("", ".", "..") or "/" in name or "\0" in name or is_leftover(name):
        return None
    return entry.parent / name


class Owner(enum.Enum):
    """Whether the process that owns a leftover is gone, as far as this host can tell."""

    DEAD = "dead"  # it ran on this host and its pid no longer exists
    ALIVE = "alive"  # it ran on this host and its pid exists: a save in flight
    UNKNOWN = "unknown"  # another host's (a shared filesystem), or a name without an owner


def owner_of(name: str) -> tuple[Owner, int | None]:
    """The state of the owner of the leftover ``name``, and its pid where the name gives one."""
    token = name[len(INCOMPLETE_PREFIX):] if name.startswith(INCOMPLETE_PREFIX) else name[len(REPLACED_PREFIX):]
    parts = token.split("-", 1)[0].split(".")
    if len(parts) >= 3:  # <host>.<pid>.<random>
        host, pid = parts[0], parts[1]
        if host != _host_id():
            return Owner.UNKNOWN, int(pid) if pid.isdigit() else None
    else:  # 0.1's tokens: <pid><6 hex>, written on this host
        pid = parts[0][:-6]
    if not pid.isdigit():
        return Owner.UNKNOWN, None
    return (Owner.ALIVE if _pid_alive(int(pid)) else Owner.DEAD), int(pid)


@dataclass
class Sweep:
    """What a sweep of a checkpoint directory's leftovers does (or did), in order: the checkpoints that an
    interrupted replace moved aside go back to their paths, then the leftovers of gone processes are removed.

    Attributes:
        restore: ``(aside, path)``: a checkpoint moved aside, and the empty path it goes back to.
        remove: leftovers of processes that are gone.
        keep: ``(leftover, why)``: leftovers that stay (a live process's save in flight, another host's).
    """

    restore: list[tuple[Path, Path]] = field(default_factory=list)
    remove: list[Path] = field(default_factory=list)
    keep: list[tuple[Path, str]] = field(default_factory=list)


def plan_sweep(dirpath: Path, keep_prefix: str | None = None, any_host: bool = False) -> Sweep:
    """(coordinator at its first save into ``dirpath``; the ``clean`` command) What :func:`sweep` would do:
    only entries named as leftovers, whose owner is provably gone (:func:`owner_of`; with ``any_host``,
    also those whose owner this host cannot check). The current run's (names starting with
    ``keep_prefix``) are kept. Raises ``OSError`` if ``dirpath`` cannot be listed."""
    plan = Sweep()
    back: set[str] = set()
    for entry in sorted(dirpath.iterdir()):
        if not is_leftover(entry.name):
            continue
        if keep_prefix and entry.name.startswith(keep_prefix):
            plan.keep.append((entry, "this run's save in flight"))
            continue
        owner, pid = owner_of(entry.name)
        if owner is Owner.ALIVE:
            plan.keep.append((entry, f"its process (pid {pid}) is alive: a save in flight"))
            continue
        if owner is Owner.UNKNOWN and not any_host:
            plan.keep.append((entry, "written on another host (or by an unknown process), which this host cannot"
                                     " tell is gone"))
            continue
        target = _replaced_target(entry) if entry.name.startswith(REPLACED_PREFIX) else None
        if target is not None and target.name not in back and not os.path.lexists(target):
            back.add(target.name)
            plan.restore.append((entry, target))
        else:
            plan.remove.append(entry)
    return plan


def sweep(dirpath: Path, plan: Sweep | None = None) -> tuple[list[Path], list[Path]]:
    """Carries out ``plan`` (default: :func:`plan_sweep` of ``dirpath``): puts back first, then removes.
    Returns ``(restored paths, removed leftovers)``; what could not be done is logged and left on disk.
    Nothing is followed through a link: a leftover that is a link is removed as a link."""
    if plan is None:
        plan = plan_sweep(dirpath)
    restored, removed = [], []
    for aside, target in plan.restore:
        try:
            os.rename(aside, target)  # fails rather than replace if something appeared at target meanwhile
        except OSError as e:
            log.warning("lightning-asyncckpt: could not put back %s at %s (%s); it is left on disk", aside, target, e)
            continue
        restored.append(target)
        log.warning("lightning-asyncckpt: restored %s, which an interrupted save had moved aside", target)
    if restored:
        fsync_dir(dirpath)
    removed = [p for p in plan.remove if try_remove(p, "the leftover")]
    return restored, removed


def restore_replaced(dirpath: Path) -> list[Path]:
    """(coordinator) Undoes a fallback publish that died between its two renames: the checkpoint moved
    aside goes back to its path when nothing is there. Returns the restored paths."""
    if not dirpath.is_dir():
        return []
    plan = plan_sweep(dirpath)
    return sweep(dirpath, Sweep(restore=plan.restore))[0]


def cleanup_leftovers(dirpath: Path, keep_prefix: str | None = None) -> list[Path]:
    """(coordinator, at the first save into ``dirpath``) Puts back a checkpoint that an interrupted
    publish moved aside, then removes the remains of interrupted saves whose process is provably gone
    (:func:`owner_is_dead`). The current run's (names starting with ``keep_prefix``) may be in flight on
    any rank, and other live jobs' too: both are kept. Returns the removed leftovers."""
    if not dirpath.is_dir():
        return []
    try:
        removed = sweep(dirpath, plan_sweep(dirpath, keep_prefix))[1]
    except OSError as e:
        log.warning("lightning-asyncckpt: could not sweep %s for leftovers of interrupted saves (%s)", dirpath, e)
        return []
    if removed:
        log.info("lightning-asyncckpt: removed %d leftover(s) of interrupted saves in %s", len(removed), dirpath)
    return removed
