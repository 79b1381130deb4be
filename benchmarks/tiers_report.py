"""``bench_tiers.py``'s figures from the ranks' raw result (medians, ratios) and its Markdown tables."""

from __future__ import annotations

import statistics
from typing import Any

from tiers_rank import RECOVERIES, RECOVERY_PARTS, SAVE_PARTS, THREAD_PARTS, VARIANTS, GiB


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    periods = result["periods"]
    base = {p["rep"]: p["period_s"] for p in periods if p["variant"] == "baseline"}
    base_cpu = {p["rep"]: p["cpu_s"] for p in periods if p["variant"] == "baseline"}
    base_median = _median(list(base.values()))
    rows = []
    for name in [v for v in VARIANTS if any(p["variant"] == v for p in periods)]:
        mine = [p for p in periods if p["variant"] == name]
        paired = [p["period_s"] - base[p["rep"]] for p in mine if p["rep"] in base]
        median = _median([p["period_s"] for p in mine])
        row = {
            "variant": name,
            "periods": len(mine),
            "period_s": median,
            "overhead_s": _median(paired) if name != "baseline" else None,
            "overhead_all_s": paired,
            "overhead_of_medians_s": (median - base_median) if name != "baseline" and median is not None else None,
            "cpu_s": _median([p["cpu_s"] for p in mine]),
            "extra_cpu_s": _median([p["cpu_s"] - base_cpu[p["rep"]] for p in mine if p["rep"] in base_cpu])
            if name != "baseline" else None,
            "stall_s": _median([p.get("stall_s") for p in mine]),
            "background_s": _median([p.get("background_s") for p in mine]),
            "drain_s": _median([p["drain_s"] for p in mine]),
            "server_cpu_s": _median([p.get("server_cpu_s") for p in mine]),
        }
        if name.startswith("local"):
            row["save_parts"] = {k: _median([p["save_parts"].get(k, 0.0) for p in mine]) for k in SAVE_PARTS}
            row["thread_parts"] = {k: _median([p["thread_parts"].get(k, 0.0) for p in mine]) for k in THREAD_PARTS}
        rows.append(row)
    by = {r["variant"]: r for r in rows}
    rec_rows = []
    for how in [h for h in RECOVERIES if any(r["how"] == h for r in result["recoveries"])]:
        mine = [r for r in result["recoveries"] if r["how"] == how]
        row = {
            "how": how,
            "reps": len(mine),
            "seconds": _median([r["seconds"] for r in mine]),
            "min_s": min(r["seconds"] for r in mine) if mine else None,
            "max_s": max(r["seconds"] for r in mine) if mine else None,
            "exact": f"{sum(r['exact'] for r in mine)}/{len(mine)}",
            "cache": mine[0].get("cache") if mine else None,
            "cached_bytes": _median([r.get("cached_bytes") for r in mine]),
            "file_bytes": mine[0].get("file_bytes") if mine else None,
        }
        if how == "local_replicas":
            row["parts"] = {k: _median([r["parts"].get(k, 0.0) for r in mine]) for k in RECOVERY_PARTS}
            # each recovery's transfer beside the freed memory the VM handed to its host around it (if any)
            row["host"] = [(r["parts"]["transfer"], *r["host_reported_mib"]) for r in mine if "host_reported_mib" in r]
        rec_rows.append(row)
    rec = {r["how"]: r for r in rec_rows}
    ratios = {
        "overhead_local_vs_persistent": _ratio(by["local"]["overhead_s"], by["persistent"]["overhead_s"]),
        "overhead_of_medians_local_vs_persistent": _ratio(by["local"]["overhead_of_medians_s"],
                                                          by["persistent"]["overhead_of_medians_s"]),
        "stall_local_vs_persistent": _ratio(by["local"]["stall_s"], by["persistent"]["stall_s"]),
        "overhead_local_lazy_vs_persistent": _ratio(by.get("local_lazy", {}).get("overhead_s"),
                                                    by["persistent"]["overhead_s"]),
        "stall_local_lazy_vs_persistent": _ratio(by.get("local_lazy", {}).get("stall_s"), by["persistent"]["stall_s"]),
        "overhead_local_overlap_vs_persistent": _ratio(by.get("local_overlap", {}).get("overhead_s"),
                                                       by["persistent"]["overhead_s"]),
        "overhead_local_vs_persistent_s3": _ratio(by["local"]["overhead_s"],
                                                  by.get("persistent_s3", {}).get("overhead_s")),
        "overhead_local_lazy_vs_persistent_s3": _ratio(by.get("local_lazy", {}).get("overhead_s"),
                                                       by.get("persistent_s3", {}).get("overhead_s")),
        "stall_local_vs_persistent_s3": _ratio(by["local"]["stall_s"], by.get("persistent_s3", {}).get("stall_s")),
        "extra_cpu_local_vs_persistent": _ratio(by["local"]["extra_cpu_s"], by["persistent"]["extra_cpu_s"]),
        "recovery_replicas_vs_persistent_cold": _ratio(rec["local_replicas"]["seconds"], rec["persistent_cold"]["seconds"]),
        "recovery_replicas_vs_persistent_warm": _ratio(rec["local_replicas"]["seconds"], rec["persistent_warm"]["seconds"]),
        "recovery_replicas_vs_persistent_s3": _ratio(rec["local_replicas"]["seconds"],
                                                     rec.get("persistent_s3", {}).get("seconds")),
    }
    return {"baseline_period_s": base_median, "overhead": rows, "recovery": rec_rows, "ratios": ratios}


def markdown(summary: dict[str, Any], result: dict[str, Any], args: dict[str, Any]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    first, every = result["first"], args["every"]
    base_step = summary["baseline_period_s"] / every if summary["baseline_period_s"] else None
    if args.get("layout") == "sharded":
        held = (f"Sharded (FSDP2-like DTensor shards): {result['state_bytes'] / GiB:.3g} GiB in {result['tensors']}"
                " tensors on each rank, 4 times that in all; persistent: a DCP directory written by every rank")
    else:
        held = f"State {result['state_bytes'] / GiB:.3g} GiB in {result['tensors']} tensors on every rank"
    lines = [
        f"{held}; 4 ranks on 2 simulated"
        f" nodes; a save every {every} steps; baseline step {f(base_step, '.3f')} s ({result['matmuls_per_step']}"
        f" matmuls, a {args['grad_mib']:g} MiB all-reduce, add_ on the state); load average"
        f" {result['loadavg_start'][0]:.1f} at the start, {result['loadavg_end'][0]:.1f} at the end. Medians."
        + _local_dirs(result, args),
        "",
        f"| variant | periods | period: save + {every} steps + drain (s) | overhead per save (s) | of the medians (s) "
        "| stall (s) | background (s) | drain (s) | CPU, all processes (s) | extra CPU per save (s) "
        "| S3-protocol server's CPU (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["overhead"]:
        lines.append(
            f"| {r['variant']} | {r['periods']} | {f(r['period_s'], '.2f')} | {f(r['overhead_s'], '.3f')} "
            f"| {f(r['overhead_of_medians_s'], '.3f')} | {f(r['stall_s'], '.3f')} | {f(r['background_s'], '.2f')} "
            f"| {f(r['drain_s'], '.2f')} | {f(r['cpu_s'], '.2f')} | {f(r['extra_cpu_s'], '.2f')} "
            f"| {f(r.get('server_cpu_s'), '.2f')} |")
    local = next(r for r in summary["overhead"] if r["variant"] == "local")
    sp, tp = local["save_parts"], local["thread_parts"]
    lines += [
        "",
        f"Local save call (slowest rank): waiting for the previous save's thread {f(sp['wait_previous'], '.3f')} s,"
        f" copying the shares into their mapped files {f(sp['copy_share'], '.3f')} s. Its thread: replicas settled"
        f" (CRC32s gathered, repairs) {f(tp['replicate'], '.2f')} s, commits {f(tp['write'], '.2f')} s, the rest"
        f" {f(local['background_s'] - tp['replicate'] - tp['write'] if local['background_s'] is not None else None, '.2f')} s.",
        f"First (untimed) saves: local stall {f(first['local_first_stall_s'], '.3f')} s, done after"
        f" {f(first['local_first_to_done_s'], '.2f')} s; persistent stall {f(first['persistent_first_stall_s'], '.3f')} s,"
        f" committed after {f(first['persistent_first_to_done_s'], '.2f')} s.",
        "",
        "| recovery | reps | slowest rank (s) | min (s) | max (s) | exact | page cache | file cached before |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["recovery"]:
        cached = (f"{r['cached_bytes'] / 1e6:.0f} of {r['file_bytes'] / 1e6:.0f} MB"
                  if r["cached_bytes"] is not None and r["file_bytes"] else "n/a")
        lines.append(
            f"| {r['how']} | {r['reps']} | {f(r['seconds'], '.3f')} | {f(r['min_s'], '.3f')} | {f(r['max_s'], '.3f')} "
            f"| {r['exact']} | {r['cache'] or 'n/a (a tmpfs is RAM)'} | {cached} |")
    rp = next(r for r in summary["recovery"] if r["how"] == "local_replicas")["parts"]
    rest = next(r for r in summary["recovery"] if r["how"] == "local_replicas")["seconds"]
    rest = rest - sum(v for v in rp.values() if v is not None) if rest is not None else None
    ra = summary["ratios"]
    lines += [
        "",
        f"Local recovery (slowest rank): waiting for the shares sent between ranks {f(rp['transfer'], '.2f')} s,"
        " read (or mapped) from"
        f" node-local files {f(rp['read'], '.2f')} s, the full checkpoint assembled {f(rp['assemble'], '.2f')} s,"
        f" loaded into the model {f(rp.get('load'), '.2f')} s, CRC32 checks {f(rp.get('crc32'), '.2f')} s, gathers and"
        f" agreements {f(rp.get('agree'), '.2f')} s, headers unpacked {f(rp.get('unpack'), '.2f')} s, manifests listed"
        f" {f(rp.get('list'), '.2f')} s, the rest {f(rest, '.2f')} s.",
        *_host_lines(next(r for r in summary["recovery"] if r["how"] == "local_replicas").get("host")),
        "",
        "| ratio | measured | target |",
        "|---|---|---|",
        f"| overhead per save, local / persistent | {f(ra['overhead_local_vs_persistent'], '.2f')}× | ≤ 0.5× |",
        f"| the same, of the medians | {f(ra['overhead_of_medians_local_vs_persistent'], '.2f')}× | |",
        f"| stall per save, local / persistent | {f(ra['stall_local_vs_persistent'], '.2f')}× | |",
        f"| overhead per save, local with snapshot=\"lazy\" / persistent | {f(ra.get('overhead_local_lazy_vs_persistent'), '.2f')}× | |",
        f"| stall per save, local with snapshot=\"lazy\" / persistent | {f(ra.get('stall_local_lazy_vs_persistent'), '.2f')}× | |",
        f"| overhead per save, local with overlap_agreement=True / persistent | {f(ra.get('overhead_local_overlap_vs_persistent'), '.2f')}× | |",
        f"| overhead per save, local / persistent on the S3-protocol server | {f(ra.get('overhead_local_vs_persistent_s3'), '.2f')}× | |",
        f"| overhead per save, local with snapshot=\"lazy\" / persistent on the S3-protocol server | {f(ra.get('overhead_local_lazy_vs_persistent_s3'), '.2f')}× | |",
        f"| stall per save, local / persistent on the S3-protocol server | {f(ra.get('stall_local_vs_persistent_s3'), '.2f')}× | |",
        f"| extra CPU per save (all processes), local / persistent | {f(ra['extra_cpu_local_vs_persistent'], '.2f')}× | |",
        f"| recovery, replicas / persistent (page cache dropped) | {f(ra['recovery_replicas_vs_persistent_cold'], '.2f')}× | ≤ 0.5× |",
        f"| recovery, replicas / persistent (warm) | {f(ra['recovery_replicas_vs_persistent_warm'], '.2f')}× | |",
        f"| recovery, replicas / persistent on the S3-protocol server | {f(ra.get('recovery_replicas_vs_persistent_s3'), '.2f')}× | |",
    ]
    return "\n".join(lines)


def _local_dirs(result: dict[str, Any], args: dict[str, Any]) -> str:
    """Where the simulated nodes' local directories were, and their tmpfs's huge pages (runs since 2026-12-06)."""
    if "local_dir_huge" not in result:
        return ""
    huge = result["local_dir_huge"]
    where = f"a tmpfs with huge={huge}" if huge else "not a tmpfs"
    return f" The nodes' local directories: under {args.get('local_dir', '/dev/shm')}, {where}."


def _host_lines(host: list | None) -> list[str]:
    """The line on this VM's free-page reporting during the local recoveries, where the kernel reports."""
    if not host:
        return []
    reps = ", ".join(f"{t:.2f} s / {before:.0f} / {during:.0f}" for t, before, during in host)
    return ["", "Freed memory this VM handed to its host (virtio-balloon free-page reporting), per local recovery in"
            " run order: the slowest rank's transfer / MiB handed over between node 1's emptying and the timed part"
            f" / MiB during it: {reps}."]
