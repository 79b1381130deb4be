"""A file's (or a directory's files') pages in the page cache, for benchmarks that time a cold and a warm
read of it; and how much freed memory a VM has handed back to its host (:func:`host_reported_kib`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Any


def drop_cache(path: Path) -> dict[str, Any]:
    """Drops the page cache (the whole machine's; needs root), else the file's own pages (fadvise)."""
    os.sync()
    method = "drop_caches"
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        method = f"posix_fadvise DONTNEED (drop_caches refused: {e.strerror})"
        for file in _files(path):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return {"cache": method, "cached_bytes": cached_bytes(path), "file_bytes": _size(path)}


def warm_cache(path: Path) -> dict[str, Any]:
    for file in _files(path):
        with open(file, "rb") as f:
            while f.read(16 << 20):
                pass
    return {"cache": "warm (read through first)", "cached_bytes": cached_bytes(path), "file_bytes": _size(path)}


def cached_bytes(path: Path) -> int | None:
    """The bytes of ``path`` (a file, or every file under a directory) in the page cache (util-linux
    ``fincore``), or None without it."""
    total = 0
    for file in _files(path):
        with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError, IndexError):
            out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(file)],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
            total += int(out.split()[0])
            continue
        return None
    return total


REPORTED_KIB = Path("/sys/module/page_reporting/parameters/reported_kib")


def host_reported_kib() -> int | None:
    """KiB of freed memory this machine has handed back to its VM's host so far (virtio-balloon free-page
    reporting; touching that memory again costs a fault on the host per page), or None where the kernel
    does not report any."""
    try:
        return int(REPORTED_KIB.read_text())
    except (OSError, ValueError):
        return None


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in _files(path))
