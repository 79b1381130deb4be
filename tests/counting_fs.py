"""The shared storage's own count of the bytes it served: a read-only FUSE passthrough of a directory that
counts, per file, the bytes its reads returned. Mounted with ``direct_io``, every read of a client reaches it
(no page cache in between), so the count is what the storage served, whoever asked (every rank of every node,
Lightning's reader and ours alike).

:func:`counting_mount` (the test's side) starts the daemon (``python counting_fs.py SOURCE MOUNT COUNTS``),
waits for its ``ready`` line, and on exit unmounts it; the daemon then writes ``{file: bytes}`` to ``COUNTS``.
Needs ``fusepy`` and libfuse 2 (``apt-get install libfuse2``; ``pip install fusepy``) and root or
``/dev/fuse`` access: :func:`fuse_refused` says why not, for a clean skip.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
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


@contextlib.contextmanager
def counting_mount(source: Path, mount: Path, timeout: float = 30) -> Iterator[dict[str, int]]:
    """Mounts ``source`` read-only at ``mount`` with a byte count per file; yields a dict that is filled with
    ``{path relative to source: bytes served}`` once the block is left (the mount is gone then). Raises
    :class:`MountRefused` with the daemon's output if the mount does not come up within ``timeout``."""
    mount.mkdir(parents=True, exist_ok=True)
    counts_file = mount.parent / f"{mount.name}.counts.json"
    log = mount.parent / f"{mount.name}.log"
    with open(log, "w") as err:  # the daemon's own messages; its stdout carries only "ready"
        proc = subprocess.Popen([sys.executable, __file__, str(source), str(mount), str(counts_file)],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    counts: dict[str, int] = {}
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            proc.kill()
            proc.wait()
            raise MountRefused(f"the counting FUSE mount did not come up: {line}{log.read_text()[-2000:]}")
        yield counts
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True, timeout=timeout).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=timeout)  # still busy
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if counts_file.exists():
        counts.update(json.loads(counts_file.read_text()))


def _serve(source: str, mount: str, counts_file: str) -> None:
    from fuse import FUSE, FuseOSError, Operations

    counted: dict[str, int] = {}
    lock = threading.Lock()

    class Counting(Operations):
        """Read-only passthrough of ``source``; ``read`` counts what it returns."""

        def _real(self, path: str) -> str:
            return os.path.join(source, path.lstrip("/"))

        def init(self, path: str) -> None:
            print("ready", flush=True)

        def getattr(self, path: str, fh: int | None = None) -> dict:
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
            try:
                return os.open(self._real(path), os.O_RDONLY)
            except OSError as e:
                raise FuseOSError(e.errno) from None

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            data = os.pread(fh, size, offset)
            with lock:
                counted[path.lstrip("/")] = counted.get(path.lstrip("/"), 0) + len(data)
            return data

        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

        def statfs(self, path: str) -> dict:
            st = os.statvfs(self._real(path))
            return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                                "f_files", "f_flag", "f_frsize", "f_namemax")}

    try:
        FUSE(Counting(), mount, foreground=True, ro=True, direct_io=True)
    finally:
        with open(counts_file, "w") as f:
            json.dump(counted, f)


if __name__ == "__main__":
    _serve(*sys.argv[1:4])
