"""What does checking a checkpoint's CRC32 on load cost? Load time with and without ``verify_on_load``.

    python benchmarks/bench_verify_load.py                 # 0.75 GiB, 7 rounds, a file and a DCP directory
    python benchmarks/bench_verify_load.py --gib 1 --rounds 9
    python benchmarks/bench_verify_load.py --readers-only --gib 0.5 --rounds 5   # DCP's readers alone

Writes a Lightning-style checkpoint (weights and two Adam moments, float32) with ``AsyncCheckpointIO``: once as
the single ``torch.save`` file (``format="auto"``) and once as a DCP directory (``format="dcp"``). Then loads each
through the plugin's load path (``AsyncCheckpointIO.load_checkpoint``: ``integration/loading.py``) with
``verify_on_load=True`` and ``False``, alternating, after one load of each to warm the page cache (the
checkpoint fits in memory: this is the cost of the check, not of the disk). A file is checked in a thread beside
the load (``integrity.while_loading``); a DCP directory item by item as ``format/dcp_reader.py``'s ``CheckedReader``
reads it (no second read). Also times the check alone (``format/integrity.py``: for DCP, the whole directory, as
``verify`` checks it). Then DCP's readers alone, on a directory of stock ``dcp.save``: ``dcp.load`` into preallocated
tensors with stock ``FileSystemReader``, ``CheckedReader(verify=False)`` and ``CheckedReader(verify=True)``
(``--readers-only``: just these). Reports medians of wall and CPU time (this process's: steadier on a shared machine); writes ``benchmarks/results/verify-load-<time>.{md,json}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lightning_asyncckpt import AsyncCheckpointIO
from lightning_asyncckpt.format import integrity
from lightning_asyncckpt.format.metadata import read_metadata
from lightning_asyncckpt.write import zip_crc

RESULTS = Path(__file__).resolve().parent / "results"


def checkpoint(gib: float) -> dict:
    """Weights and two Adam moments in 16 MiB tensors (float32), plus the usual plain values."""
    numel = 4 << 20
    n = max(1, round(gib * (1 << 30) / (3 * numel * 4)))
    g = torch.Generator().manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)}
    state = {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(numel, generator=g),
                 "exp_avg_sq": torch.rand(numel, generator=g)} for i in range(n)}
    return {"epoch": 1, "global_step": 10, "pytorch-lightning_version": "2.6.6", "state_dict": weights,
            "optimizer_states": [{"state": state, "param_groups": [{"params": list(range(n)), "lr": 1e-3}]}],
            "loops": {}, "callbacks": {}, "lr_schedulers": []}


def save(ckpt: dict, path: Path, fmt: str) -> None:
    io = AsyncCheckpointIO(worker="fork", format=fmt)
    try:
        io.save_checkpoint(ckpt, path)
        io.finalize(blocking=True)
    finally:
        io.teardown()


def tree_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.iterdir())


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``fn()``: on a shared machine the CPU time is the steadier."""
    gc.collect()
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    elapsed = time.perf_counter() - t, time.process_time() - c
    del out
    return elapsed


def reader_rows(root: Path, gib: float, rounds: int) -> list[dict]:
    """``dcp.load`` of one stock DCP directory (the checkpoint's tensors, flat) into preallocated tensors, with
    stock's ``FileSystemReader`` and ours unchecked and checked, in rotating order: medians of wall and CPU."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from lightning_asyncckpt.format.dcp_reader import CheckedReader

    ckpt = checkpoint(gib)
    flat = {**{f"w.{k}": v for k, v in ckpt["state_dict"].items()},
            **{f"o.{p}.{k}": v for p, s in ckpt["optimizer_states"][0]["state"].items() for k, v in s.items()}}
    path = root / "stock-dcp"
    dcp.save(flat, checkpoint_id=path)
    target = {k: torch.empty_like(v) for k, v in flat.items()}
    del ckpt, flat
    meta = read_metadata(path)
    readers = {"stock FileSystemReader": lambda: FileSystemReader(str(path)),
               "ours, unchecked": lambda: CheckedReader(path, meta, verify=False),
               "ours, checked": lambda: CheckedReader(path, meta, verify=True)}
    names = list(readers)
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for n in names:  # warms the page cache and every lazy import
        timed(lambda n=n: dcp.load(target, storage_reader=readers[n]()))
    for r in range(rounds):
        for n in names[r % 3:] + names[:r % 3]:
            times[n].append(timed(lambda n=n: dcp.load(target, storage_reader=readers[n]())))
    unchecked = statistics.median(c for _, c in times["ours, unchecked"])
    return [{"reader": n, "bytes": tree_bytes(path), "median_s": statistics.median(w for w, _ in times[n]),
             "median_cpu_s": statistics.median(c for _, c in times[n]),
             "cpu_vs_unchecked_pct": 100 * (statistics.median(c for _, c in times[n]) - unchecked) / unchecked,
             "runs": times[n]} for n in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=0.75)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--readers-only", action="store_true", help="only DCP's readers, on a stock DCP directory")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-verify-", dir=args.dir))
    try:
        readers = reader_rows(root, args.gib, args.rounds)
        paths = {} if args.readers_only else {"file": root / "a.ckpt", "dcp": root / "b.ckpt"}
        ckpt = checkpoint(args.gib) if paths else {}
        for kind, fmt in (("file", "auto"), ("dcp", "dcp")):
            if kind in paths:
                save(ckpt, paths[kind], fmt)
        del ckpt
        loaders = {v: AsyncCheckpointIO(worker="fork", verify_on_load=v) for v in (True, False)}
        checks = {"file": lambda: integrity.check_file(paths["file"]),
                  "dcp": lambda: integrity.check_directory(paths["dcp"], read_metadata(paths["dcp"]))}
        rows = []
        for kind, path in paths.items():
            for v in (True, False):  # warms the page cache and every lazy import
                timed(lambda v=v, path=path: loaders[v].load_checkpoint(path))
            times: dict[str, list[tuple[float, float]]] = {"verify": [], "no_verify": [], "check_alone": []}
            for r in range(args.rounds):
                order = (True, False) if r % 2 == 0 else (False, True)
                for v in order:
                    times["verify" if v else "no_verify"].append(timed(lambda v=v, path=path: loaders[v].load_checkpoint(path)))
                times["check_alone"].append(timed(checks[kind]))
            med = {k: statistics.median(w for w, _ in x) for k, x in times.items()}
            cpu = {k: statistics.median(c for _, c in x) for k, x in times.items()}
            rows.append({"kind": kind, "bytes": tree_bytes(path), **{f"median_{k}_s": m for k, m in med.items()},
                         **{f"median_{k}_cpu_s": m for k, m in cpu.items()},
                         "overhead_pct": 100 * (med["verify"] - med["no_verify"]) / med["no_verify"],
                         "cpu_overhead_pct": 100 * (cpu["verify"] - cpu["no_verify"]) / cpu["no_verify"],
                         "check_pct_of_load": 100 * med["check_alone"] / med["no_verify"],
                         "check_gb_per_s": tree_bytes(path) / med["check_alone"] / 1e9, "runs": times})
        report = {"gib": args.gib, "rounds": args.rounds, "crc32": zip_crc.IMPLEMENTATION, "torch": torch.__version__,
                  "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_avg": os.getloadavg(),
                  "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows, "readers": readers}
        lines = [f"# Load with and without verify_on_load ({args.gib} GiB, {args.rounds} rounds, medians, warm page cache)",
                 "", f"CRC32: {report['crc32']}; torch {report['torch']}; {report['machine']}; load average at the end "
                 f"{', '.join(f'{x:.2f}' for x in report['load_avg'])}", "",
                 "| checkpoint | bytes | load, verify (s) | load, no verify (s) | overhead | CPU s, verify | "
                 "CPU s, no verify | CPU overhead | check alone (s) | check / load | check GB/s |",
                 "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in rows:
            lines.append(f"| {row['kind']} | {row['bytes']} | {row['median_verify_s']:.3f} | "
                         f"{row['median_no_verify_s']:.3f} | {row['overhead_pct']:+.1f}% | {row['median_verify_cpu_s']:.3f} | "
                         f"{row['median_no_verify_cpu_s']:.3f} | {row['cpu_overhead_pct']:+.1f}% | "
                         f"{row['median_check_alone_s']:.3f} | {row['check_pct_of_load']:.1f}% | {row['check_gb_per_s']:.1f} |")
        lines += ["", "DCP's readers alone (`dcp.load` of a stock DCP directory into preallocated tensors):", "",
                  "| reader | bytes | load (s) | CPU s | CPU vs ours unchecked |", "|---|---|---|---|---|"]
        lines += [f"| {r['reader']} | {r['bytes']} | {r['median_s']:.3f} | {r['median_cpu_s']:.3f} | "
                  f"{r['cpu_vs_unchecked_pct']:+.1f}% |" for r in readers]
        text = "\n".join(lines) + "\n"
        print(text)
        RESULTS.mkdir(exist_ok=True)
        stem = RESULTS / f"verify-load-{time.strftime('%Y%m%d-%H%M%S')}"
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        stem.with_suffix(".md").write_text(text)
        print(f"wrote {stem}.md and .json")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
