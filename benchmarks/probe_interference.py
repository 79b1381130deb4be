"""What does each part of a background save cost a training loop that already uses every core?

    python benchmarks/probe_interference.py                 # 1 GiB, 3 rounds, every part
    python benchmarks/probe_interference.py --gib 0.5 --rounds 5 --parts odirect memcpy
    python benchmarks/probe_interference.py --parts odirect --chunk-mib 1    # the write in 1 MiB requests
    python benchmarks/probe_interference.py --render benchmarks/results/interference-<time>.json

The trainer here is a loop of fp32 matmuls on every core (the work of ``bench_train_loop.py``'s forward
and backward). Beside it, one other process does one part of a save on ``--gib`` of data, alone:

- ``idle``: nothing (the control: a second process that only waits);
- ``memcpy``: one copy into buffers that already exist (the staging copy);
- ``crc32``: the CRC32 of the bytes (ISA-L through ``isal`` where installed, else ``zlib``), as the zip
  writer needs;
- ``odirect``: the write of the bytes with ``O_DIRECT`` from aligned memory, then ``fsync`` (the kernel's
  and the disk's part of our write, with no page-cache copy);
- ``buffered``: the same write through the page cache, then ``fsync`` (how ``torch.save`` writes);
- ``ours``: a whole save (its CPU: the worker process's) of a state of that size by this library (``AsyncCheckpointIO()``, defaults: the
  nvrx engine, the persistent worker, a ``torch.save`` file), called in the trainer's process, which
  finalizes after every iteration until the save is committed: the parts above, and everything else;
  ``ours_mcore``: the same with ``strategy="mcore"``.

The part's process prepares everything first (imports, buffers touched, the file opened), says so through
a pipe, and starts on the trainer's word, so that only the part itself overlaps the loop. The loop runs
until the part is done; its **cost** is the loop's time minus the same number of iterations at the
baseline pace measured right before, in the same process. A part's cost beside the memcpy floor (one
blocking copy of the data in the trainer's process) says what a background save can reach on this
machine: the sum of the costs of its parts is the least overhead that any writer of these bytes has here.
Writes ``benchmarks/results/interference-<time>.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from multiprocessing import get_context
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_save import memcpy_floor  # noqa: E402

GiB = 1 << 30
CHUNK = 8 << 20
PARTS = ("idle", "memcpy", "crc32", "odirect", "buffered", "ours", "ours_mcore")


def _crc32():
    try:
        from isal import isal_zlib

        return isal_zlib.crc32, "isal"
    except ImportError:
        import zlib

        return zlib.crc32, "zlib"


def part_process(part: str, nbytes: int, directory: str, conn, chunk: int = CHUNK) -> None:
    """One part of a save, on the trainer's word; answers with (seconds, CPU seconds) when done."""
    import torch

    torch.set_num_threads(1)  # a writer's own work is single-threaded
    src = mmap.mmap(-1, nbytes)  # page-aligned, as staging buffers and O_DIRECT need
    view = memoryview(src)
    for off in range(0, nbytes, mmap.PAGESIZE):
        src[off] = 1  # touched: no page faults inside the measured part
    dst = torch.zeros(nbytes, dtype=torch.uint8) if part == "memcpy" else None  # touched: it exists already
    fd = None
    path = os.path.join(directory, f"probe-{os.getpid()}.bin")
    if part in ("odirect", "buffered"):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if part == "odirect" else 0), 0o600)
    crc, _ = _crc32()
    conn.send("ready")
    conn.recv()
    t0, c0 = time.perf_counter(), time.process_time()
    if part == "memcpy":
        dst.copy_(torch.frombuffer(src, dtype=torch.uint8))
    elif part == "crc32":
        value = 0
        for off in range(0, nbytes, chunk):
            value = crc(view[off:off + chunk], value)
    elif fd is not None:
        for off in range(0, nbytes, chunk):
            os.write(fd, view[off:off + chunk])
        os.fsync(fd)
    conn.send((time.perf_counter() - t0, time.process_time() - c0))
    if fd is not None:
        os.close(fd)
        os.unlink(path)
    view.release()
    src.close()


STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times() -> dict:
    """The machine's CPU time by kind (seconds, all CPUs), from ``/proc/stat``: where the time goes that no
    process is charged for (interrupts, and ``steal``: time the hypervisor ran something else on our CPUs)."""
    with open("/proc/stat") as f:
        values = f.readline().split()[1:1 + len(STAT_FIELDS)]
    tick = os.sysconf("SC_CLK_TCK")
    return {k: int(v) / tick for k, v in zip(STAT_FIELDS, values)}


def pid_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process, from ``/proc/<pid>/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Loop:
    """The trainer: matmuls on every core, one iteration at a time. ``batch=0``: one square matmul of
    ``width`` (compute-bound, in cache); else a batch of ``batch`` rows through ``layers`` weights of
    ``width`` squared (memory-bound, as ``bench_train_loop.py``'s small-batch forward and backward are)."""

    def __init__(self, width: int, batch: int = 0, layers: int = 8) -> None:
        import torch

        self.torch = torch
        if batch:
            self.weights = [torch.randn(width, width) for _ in range(layers)]
            self.x = torch.randn(batch, width)
        else:
            self.weights, self.a, self.b = None, torch.randn(width, width), torch.randn(width, width)
            self.c = torch.empty(width, width)

    def step(self) -> None:
        if self.weights is None:
            self.torch.mm(self.a, self.b, out=self.c)
            return
        x = self.x
        for w in self.weights:
            x = self.torch.tanh(x @ w)  # tanh keeps the values bounded over many steps

    def pace(self, n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            self.step()
        return (time.perf_counter() - t) / n


def ours(loop: Loop, nbytes: int, directory: str, engine: str) -> dict:
    """The whole save, from the call to its commit, with the loop running between finalizes."""
    import torch

    from lightning_asyncckpt import AsyncCheckpointIO

    n_tensors = 8
    state = {f"w{i}": torch.ones(nbytes // n_tensors // 4) for i in range(n_tensors)}
    io = AsyncCheckpointIO(strategy=engine)
    try:
        io.warmup(like=state)  # the worker started and the buffers made: only the save itself is measured
        base = loop.pace(10)
        w0 = sum(pid_cpu_s(p) for p in io.session.worker_pids())
        path = os.path.join(directory, "probe.ckpt")
        t, n, before, c0 = time.perf_counter(), 0, cpu_times(), time.process_time()
        io.save_checkpoint(state, path)
        while True:
            io.finalize(blocking=False)
            if not io.session.num_pending:
                break
            loop.step()
            n += 1
        elapsed = time.perf_counter() - t
        after = cpu_times()
        worker_cpu = sum(pid_cpu_s(p) for p in io.session.worker_pids()) - w0
    finally:
        io.teardown()
    os.unlink(path)
    return {"part": "ours" if engine == "nvrx" else f"ours_{engine}", "cost_s": elapsed - n * base, "part_s": elapsed, "part_cpu_s": worker_cpu,
            "trainer_cpu_s": time.process_time() - c0, "iterations": n, "baseline_iter_s": base,
            "machine_s": {k: after[k] - before[k] for k in STAT_FIELDS}}


def one(loop: Loop, part: str, nbytes: int, directory: str, chunk: int) -> dict:
    if part.startswith("ours"):
        return ours(loop, nbytes, directory, "mcore" if part == "ours_mcore" else "nvrx")
    ctx = get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=part_process, args=(part, nbytes, directory, there, chunk), daemon=True)
    proc.start()
    try:
        if not here.poll(300) or here.recv() != "ready":
            raise RuntimeError(f"the {part} process did not get ready")
        base = loop.pace(10)
        here.send("go")
        t, n, before = time.perf_counter(), 0, cpu_times()
        while not here.poll():
            loop.step()
            n += 1
        elapsed = time.perf_counter() - t
        after = cpu_times()
        seconds, cpu = here.recv()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    return {"part": part, "cost_s": elapsed - n * base, "part_s": seconds, "part_cpu_s": cpu,
            "iterations": n, "baseline_iter_s": base, "machine_s": {k: after[k] - before[k] for k in STAT_FIELDS}}


def render(res: dict) -> str:
    floor = res["floor_s"]
    lines = [f"# probe_interference.py, {res['when']}", "",
             f"`{res['command']}` on {res['cpus']} CPUs; loop: {res.get('loop', 'matmul 1024^2')}; {res['gib']:g} GiB per part, {res['rounds']} rounds, "
             f"CRC32 by {res['crc32']}, {res.get('chunk_mib', 8)} MiB per write; memcpy floor {floor:.3f} s (the trainer's own blocking copy)", "",
             "| part | cost to the loop (s, median) | vs memcpy floor | part's own time (s) | part's CPU (s) | "
             "GB/s of the part | machine: system, irq + softirq, steal, idle + iowait (CPU-s) |",
             "|---|---|---|---|---|---|---|"]
    for part in res["parts"]:
        rows = [r for r in res["runs"] if r["part"] == part]
        cost = statistics.median(r["cost_s"] for r in rows)
        own = statistics.median(r["part_s"] for r in rows)
        cpu = statistics.median(r["part_cpu_s"] for r in rows)
        m = {k: statistics.median(r["machine_s"][k] for r in rows) for k in STAT_FIELDS}
        lines.append(f"| {part} | {cost:.3f} | {cost / floor:.2f}× | {own:.3f} | {cpu:.3f} | "
                     f"{res['gib'] * GiB / own / 1e9 if own > 1e-3 else float('nan'):.2f} | {m['system']:.2f}, {m['irq'] + m['softirq']:.2f}, "
                     f"{m['steal']:.2f}, {m['idle'] + m['iowait']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=1024, help="matmul size of one loop iteration")
    p.add_argument("--batch", type=int, default=0,
                   help="rows per iteration through 8 weights of --width squared (memory-bound; 0: one square matmul)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--chunk-mib", type=int, default=CHUNK >> 20, help="bytes per write (and CRC32) call, in MiB")
    p.add_argument("--dir", default=None, help="where the write parts write (default: the results folder's disk)")
    p.add_argument("--render", default=None, help="reprint a saved results JSON as its Markdown table, and rewrite it")
    args = p.parse_args()
    if args.render:
        text = render(json.loads(Path(args.render).read_text()))
        Path(args.render).with_suffix(".md").write_text(text)
        print(text)
        return
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    nbytes = int(args.gib * GiB) // (args.chunk_mib << 20) * (args.chunk_mib << 20)
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    directory = args.dir or tempfile.mkdtemp(dir=HERE)
    loop = Loop(args.width, args.batch)
    loop.pace(20)  # warm
    runs = []
    for r in range(args.rounds):
        order = args.parts[r % len(args.parts):] + args.parts[:r % len(args.parts)]  # rotated per round
        for part in order:
            runs.append(one(loop, part, nbytes, directory, args.chunk_mib << 20))
            print(json.dumps(runs[-1]), flush=True)
    if args.dir is None:
        os.rmdir(directory)
    res = {"when": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["benchmarks/probe_interference.py"] + sys.argv[1:]),
           "cpus": os.cpu_count(), "loop": f"batch {args.batch} x 8 weights of {args.width}^2" if args.batch else f"matmul {args.width}^2", "gib": nbytes / GiB, "rounds": args.rounds, "parts": args.parts,
           "crc32": _crc32()[1], "chunk_mib": args.chunk_mib,
           "floor_s": memcpy_floor([torch.ones(nbytes, dtype=torch.uint8)]), "runs": runs}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (results / f"interference-{stamp}.json").write_text(json.dumps(res, indent=1))
    text = render(res)
    (results / f"interference-{stamp}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
