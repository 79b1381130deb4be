"""A file's pages in the page cache, for benchmarks that time a cold and a warm read of it."""

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
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return {"cache": method, "cached_bytes": cached_bytes(path), "file_bytes": path.stat().st_size}


def warm_cache(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass
    return {"cache": "warm (read through first)", "cached_bytes": cached_bytes(path), "file_bytes": path.stat().st_size}


def cached_bytes(path: Path) -> int | None:
    """The file's bytes in the page cache (util-linux ``fincore``), or None without it."""
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError, IndexError):
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out.split()[0])
    return None
