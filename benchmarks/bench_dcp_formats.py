"""torch DCP's two serialization formats, written by DCP's own ``FileSystemWriter``: the per-item ``torch.save``
framing against the raw bytes of ``SerializationFormat.SAFETENSORS``.

    pip install safetensors                                  # DCP's raw format needs it
    python benchmarks/bench_dcp_formats.py                   # 1 GiB in 64 tensors, 3 rounds
    python benchmarks/bench_dcp_formats.py --gib 2 --threads 1 2

The performance issue asked whether the raw-bytes format is a lever for the write. The engines' writers
always pass ``TORCH_SAVE`` (``write_preloaded_data``), so this measures DCP's own writer with each format,
each save in a fresh spawned process (its CPU and peak memory are its own), alternating formats per round:

- **wall s** and **CPU s** (user + system of the process, every thread) of ``dcp.save``, and **GB per CPU s**;
- **peak extra memory**: the process's peak RSS during the save minus its RSS before (the state is built
  first), against the state's size;
- the **floor**: size over an fsync'd ``O_DIRECT`` probe of the same bytes to the same directory, measured in
  the same process right before the save.

Medians over the rounds. Nothing here is timed in tests.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

FORMATS = ("torch_save", "safetensors")


def one(fmt: str, gib: float, count: int, threads: int, directory: str) -> dict:
    import psutil
    import torch.distributed.checkpoint as dcp
    from profile_write import make_state, probe
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    nbytes = int(gib * (1 << 30))
    state = make_state(nbytes, count)["state_dict"]
    out_dir = Path(directory) / f"{fmt}-{threads}"
    floor = nbytes / probe(Path(directory), nbytes, direct=True)
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    writer = FileSystemWriter(out_dir, thread_count=threads, sync_files=True,
                              serialization_format=SerializationFormat(fmt))
    dcp.save(state, storage_writer=writer, no_dist=True)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    peak = r1.ru_maxrss * 1024  # KiB on Linux
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    shutil.rmtree(out_dir)
    return {"format": fmt, "threads": threads, "gib": gib, "tensors": count, "wall_s": wall, "cpu_s": cpu,
            "system_s": r1.ru_stime - r0.ru_stime, "gb_per_cpu_s": nbytes / 1e9 / max(cpu, 1e-9),
            "peak_extra": max(0, peak - rss0) / nbytes, "floor_s": floor, "files_bytes": size}


def _child(queue: mp.Queue, *args) -> None:
    queue.put(one(*args))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory on disk)")
    p.add_argument("--out", default=None, help="write every figure as JSON here")
    args = p.parse_args()
    try:
        import safetensors  # noqa: F401
    except ImportError:
        sys.exit("bench_dcp_formats.py: DCP's raw format needs safetensors (pip install safetensors)")
    ctx = mp.get_context("spawn")
    runs = []
    with tempfile.TemporaryDirectory(dir=args.dir or "/var/tmp") as tmp:
        for r in range(args.rounds):
            for fmt in FORMATS if r % 2 == 0 else FORMATS[::-1]:
                for threads in args.threads:
                    queue = ctx.Queue()
                    child = ctx.Process(target=_child, args=(queue, fmt, args.gib, args.tensors, threads, tmp))
                    child.start()
                    runs.append(queue.get(timeout=600))
                    child.join(60)
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))
    print(f"{args.gib:g} GiB in {args.tensors} tensors, DCP FileSystemWriter, {args.rounds} rounds, medians")
    print("| format | threads | wall (s) | floor (s) | wall / floor | CPU (s) | of it system | GB per CPU s | peak extra memory (x state) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt in FORMATS:
        for threads in args.threads:
            rs = [r for r in runs if r["format"] == fmt and r["threads"] == threads]
            med = {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "floor_s", "cpu_s", "system_s",
                                                                      "gb_per_cpu_s", "peak_extra")}
            ratio = statistics.median(r["wall_s"] / r["floor_s"] for r in rs)
            print(f"| {fmt} | {threads} | {med['wall_s']:.2f} | {med['floor_s']:.2f} | {ratio:.2f}x | {med['cpu_s']:.2f} |"
                  f" {med['system_s']:.2f} | {med['gb_per_cpu_s']:.2f} | {med['peak_extra']:.2f} |")


if __name__ == "__main__":
    main()
