"""Whether the local tier's directory is on a tmpfs that gives its files huge pages, and a hint if not.

A restore after a lost node moves each share over gloo into a file of the node back empty, and reads the
shares of the others through private mappings. On a tmpfs with 4 KiB pages (the default, and ``/dev/shm``
everywhere unless configured) every 4 KiB of those files is a page fault, inside gloo's receive and inside
the checks' first read. On a tmpfs mounted ``huge=within_size`` (or ``always``) they are 2 MiB folios, one
fault per 2 MiB. Measured on this project's 2 cores (``benchmarks/results/findings-tiers.md``, "huge pages"): a sharded
recovery (0.25 GiB per rank, 4 ranks on 2 simulated nodes) took 0.280 s (``huge=always``) and 0.319 s
(``huge=within_size``) there against 0.594 s on ``/dev/shm``; gloo alone received 256 MiB into a fresh
4 KiB-page mapping in 0.107 s, into one already faulted in 0.050 s. The local save's overhead did not
change: its files are reused, their pages already there. So :func:`hint` names the mount option where the directory is a tmpfs without it.

Nothing here changes how the tier works: the hint is one log line at setup (global rank 0).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
_OCTAL = re.compile(r"\\([0-7]{3})")


def tmpfs_huge(directory: Path, mountinfo: str | None = None, shmem_enabled: str | None = None) -> str | None:
    """The ``huge=`` option of the tmpfs that holds ``directory`` (``"never"`` where it has none, or where the
    kernel denies huge pages to every tmpfs); None where ``directory`` is not on a tmpfs, or where the mount
    table cannot be read. ``mountinfo`` and ``shmem_enabled``: the files' text (read here when None)."""
    try:
        mountinfo = MOUNTINFO.read_text() if mountinfo is None else mountinfo
    except OSError:
        return None
    target = os.path.realpath(directory)
    best: tuple[int, str, str] | None = None  # (length of the mount point, fstype, super options)
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if "-" not in fields or len(fields) < 5:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 4:
            continue
        point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):  # the last of equal mount points is on top
            best = (len(point), fields[sep + 1], fields[sep + 3])
    if best is None or best[1] != "tmpfs":
        return None
    options = dict(o.partition("=")[::2] for o in best[2].split(","))
    kernel = _selected(SHMEM_ENABLED, shmem_enabled)
    if kernel == "deny":
        return "never"
    if kernel == "force":
        return "always"
    return options.get("huge") or "never"


def hint(directory: Path, mountinfo: str | None = None, shmem_enabled: str | None = None) -> str | None:
    """(global rank 0, at setup) The log line that suggests a tmpfs with huge pages, or None where
    ``directory`` is not on a tmpfs, or is on one that has them, or where the kernel denies them anyway."""
    huge = tmpfs_huge(directory, mountinfo, shmem_enabled)
    if huge != "never" or _selected(SHMEM_ENABLED, shmem_enabled) == "deny":
        return None
    return (f"lightning-asyncckpt: LocalTier(dir={str(directory)!r}) is on a tmpfs without huge pages: a recovery"
            " after a lost node moves and checks its shares about twice as fast on a tmpfs mounted with"
            " huge=within_size (4 KiB pages fault one by one). Where the job script can, give the tier a directory"
            " on one, e.g. `mount -t tmpfs -o size=<2 x replication_factor x share x ranks per node>,"
            "huge=within_size tmpfs /local_ckpt` (docs/tiers.md, \"A tmpfs with huge pages\").")


def _selected(path: Path, text: str | None) -> str | None:
    """The bracketed choice of a sysfs setting such as ``always within_size advise [never] deny force``."""
    if text is None:
        try:
            text = path.read_text()
        except OSError:
            return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None
