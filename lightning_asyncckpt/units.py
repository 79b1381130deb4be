"""How sizes and durations are written for people: one unit system, binary (1 KiB = 1024 B, as state sizes
and tmpfs limits are given), for the log lines, the metrics' summaries and the command line."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``512 B``, ``72.1 MiB``, ``1.1 GiB``: binary units, as a checkpoint's state is sized."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def rate(bytes_per_second: float) -> str:
    """``1.25 GiB/s`` from 1 GiB/s up, ``48.1 MiB/s`` below: the same units as :func:`human_bytes`."""
    gib = bytes_per_second / 2**30
    return f"{gib:.2f} GiB/s" if gib >= 1 else f"{human_bytes(bytes_per_second)}/s"


def seconds(s: float) -> str:
    """``0.21 s`` below ten seconds, ``12.3 s`` above."""
    return f"{s:.1f} s" if s >= 10 else f"{s:.2f} s"
