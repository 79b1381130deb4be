"""The shared storage's own count of the bytes it served: a read-only FUSE passthrough of a directory that
counts, per file, the bytes its reads returned. Mounted with ``direct_io``, every read of a client reaches it
(no page cache in between), so the count is what the storage served, whoever asked (every rank of every node,
Lightning's reader and ours alike).

:func:`counting_mount` (the test's side) starts the daemon (``python counting_fs.py SOURCE MOUNT``), waits for
its ``ready`` line, and yields a :class:`Counts`; :meth:`Counts.read` asks the daemon itself, through the
mount's control file ``/.counts`` (not in the source, not counted), for ``{file: bytes}`` so far: the answer
is the daemon's, synchronous, while the mount is up. Leaving the block unmounts it.
Needs ``fusepy`` and libfuse 2 (``apt-get install libfuse2``; ``pip install fusepy``) and root or
``/dev/fuse`` access: :func:`fuse_refused` and :class:`MountRefused` say why not, for a clean skip.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path


class MountRefused(RuntimeError):
    """The daemon could not mount (no permission for FUSE here, or libfuse refused): a reason to skip."""


def fuse_refused() -> str | None:
    """Why a counting FUSE mount cannot be made here (None if it can, as far as can be told without one)."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    try:
        import fuse  # noqa: F401 - fusepy, loads libfuse
    except (ImportError, OSError) as e:
        return f"the counting FUSE mount needs fusepy and libfuse2 (pip install fusepy; apt-get install libfuse2): {e}"
    return None


CONTROL = ".counts"  # the control file at the mount's root: the counts so far, as JSON


class Counts:
    """The counts of one counting mount."""

    def __init__(self, mount: Path) -> None:
        self.mount = mount

    def read(self) -> dict[str, int]:
        """``{path relative to the source: bytes served}`` so far, from the daemon."""
        return json.loads((self.mount / CONTROL).read_text())


@contextlib.contextmanager
def counting_mount(source: Path, mount: Path, timeout: float = 30) -> Iterator[Counts]:
    """Mounts ``source`` read-only at ``mount``, counting the bytes served per file; yields its
    :class:`Counts`. Raises :class:`MountRefused` with the daemon's output if the mount does not come up within
    ``timeout``. Leaving the block unmounts it (lazily, if a process still holds it) and stops the daemon."""
    mount.mkdir(parents=True, exist_ok=True)
    log = mount.parent / f"{mount.name}.log"
    with open(log, "w") as err:  # the daemon's own messages; its stdout carries only "ready"
        proc = subprocess.Popen([sys.executable, __file__, str(source), str(mount)], stdout=subprocess.PIPE,
                                stderr=err, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            raise MountRefused(f"the counting FUSE mount did not come up: {line}{log.read_text()[-2000:]}")
        yield Counts(mount)
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True, timeout=timeout).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=timeout)  # still busy
        # a node's namespace, being torn down, may still hold a copy of the mount: the daemon is done all the same
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _serve(source: str, mount: str) -> None:
    from fuse import FUSE, FuseOSError, Operations

    counted: dict[str, int] = {}
    snapshots: dict[int, bytes] = {}  # open handles of the control file: the counts as they were at open
    lock = threading.Lock()
    control = "/" + CONTROL

    class Counting(Operations):
        """Read-only passthrough of ``source``; ``read`` counts what it returns."""

        def _real(self, path: str) -> str:
            return os.path.join(source, path.lstrip("/"))

        def init(self, path: str) -> None:
            print("ready", flush=True)

        def getattr(self, path: str, fh: int | None = None) -> dict:
            if path == control:  # direct_io reads it to its end, whatever the size says
                return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": 1 << 20}
            try:
                st = os.lstat(self._real(path))
            except OSError as e:
                raise FuseOSError(e.errno) from None
            return {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime",
                                                "st_mtime", "st_ctime")}

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._real(path))]

        def readlink(self, path: str) -> str:
            return os.readlink(self._real(path))

        def open(self, path: str, flags: int) -> int:
            if flags & (os.O_WRONLY | os.O_RDWR):
                raise FuseOSError(errno.EROFS)
            if path == control:
                fd = os.open(os.devnull, os.O_RDONLY)  # a handle number of its own
                with lock:
                    snapshots[fd] = json.dumps(counted).encode()
                return fd
            try:
                return os.open(self._real(path), os.O_RDONLY)
            except OSError as e:
                raise FuseOSError(e.errno) from None

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            if fh in snapshots:
                return snapshots[fh][offset:offset + size]
            data = os.pread(fh, size, offset)
            with lock:
                counted[path.lstrip("/")] = counted.get(path.lstrip("/"), 0) + len(data)
            return data

        def release(self, path: str, fh: int) -> int:
            snapshots.pop(fh, None)
            os.close(fh)
            return 0

        def statfs(self, path: str) -> dict:
            st = os.statvfs(self._real(path))
            return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                                "f_files", "f_flag", "f_frsize", "f_namemax")}

    FUSE(Counting(), mount, foreground=True, ro=True, direct_io=True)


if __name__ == "__main__":
    _serve(*sys.argv[1:3])
