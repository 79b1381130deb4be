"""``bench_save.py``'s figures from the variants' raw runs (medians over the saves after the first, ratios
to the synchronous DCP save and to the memcpy floor) and its Markdown table."""

from __future__ import annotations

import statistics
from typing import Any

from save_variant import VARIANTS


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for size in sorted({r["size_gib"] for r in runs}):
        at_size = [r for r in runs if r["size_gib"] == size]
        dcp_sync = _median([s["stall_s"] for r in at_size if r["variant"] == "dcp_sync" for s in r["saves"][1:]])
        for name in VARIANTS:
            mine = [r for r in at_size if r["variant"] == name]
            if not mine:
                continue
            steady = [s for r in mine for s in r["saves"][1:]]
            floor = _median([r["memcpy_floor_s"] for r in mine])
            stall = _median([s["stall_s"] for s in steady])
            torn = [s["torn"] for r in mine for s in r["saves"] if s["torn"] is not None]
            rows.append({
                "size_gib": size,
                "variant": name,
                "stall_s": stall,
                "first_stall_s": _median([r["saves"][0]["stall_s"] for r in mine]),
                "stall_vs_dcp_sync": stall / dcp_sync if dcp_sync else None,
                "stall_vs_memcpy_floor": stall / floor if floor else None,
                "slowdown": _median([s["slowdown"] for s in steady]),
                "e2e_s": _median([s["e2e_s"] for s in steady]),
                "overhead_s": _median([s["stall_s"] + (s["slowdown"] - 1) * s["steps_during_write"] * r["base_step_s"]
                                       if s["slowdown"] else s["stall_s"] for r in mine for s in r["saves"][1:]]),
                "write_gbps": _median([s["write_gbps"] for s in steady]),
                "probe_gbps": _median([r["probe_gbps"] for r in mine]),
                # everything checkpointing added to the host after the first save: buffers, workers (their
                # whole memory), /dev/shm, over the process before any checkpointing machinery existed
                "extra_mem_x_state": max(s["extra_mem_incl_worker_bytes"] for r in mine for s in r["saves"][1:])
                / mine[0]["state_bytes"],
                "extra_mem_during_x_state": max(s["extra_mem_bytes"] for r in mine for s in r["saves"][1:])
                / mine[0]["state_bytes"],
                "torn": sum(torn) if torn else None,
                "checked": len(torn),
                "memcpy_floor_s": floor,
            })
    return rows


def markdown(rows: list[dict]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    lines = [
        "| size | variant | stall (s) | first (s) | vs sync DCP | vs memcpy floor | step slowdown | stall + slowdown (s) "
        "| to commit (s) | write GB/s (probe) | extra host mem (× state) | of it during saves | torn |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size_gib']:g} GiB | {r['variant']} | {f(r['stall_s'], '.4f')} | {f(r['first_stall_s'], '.4f')} "
            f"| {f(r['stall_vs_dcp_sync'], '.3f')}× | {f(r['stall_vs_memcpy_floor'], '.2f')}× | {f(r['slowdown'], '.2f')}× "
            f"| {f(r['overhead_s'], '.3f')} | {f(r['e2e_s'], '.2f')} | {f(r['write_gbps'], '.2f')} ({f(r['probe_gbps'], '.2f')}) "
            f"| {f(r['extra_mem_x_state'], '.2f')} | {f(r['extra_mem_during_x_state'], '.2f')} "
            f"| {r['torn'] if r['torn'] is not None else 'n/a'}/{r['checked']} |"
        )
    return "\n".join(lines)
