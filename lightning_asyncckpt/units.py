"""How sizes and durations are written for people: one unit system (SI, 1 kB = 1000 B, as in GB/s)
for the log lines, the metrics' summaries and the command line."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``512 B``, ``75.7 MB``, ``1.1 GB``: decimal units, matching the GB/s of write rates."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def seconds(s: float) -> str:
    """``0.21 s`` below ten seconds, ``12.3 s`` above."""
    return f"{s:.1f} s" if s >= 10 else f"{s:.2f} s"
