"""Time from save to durable commit against the disk's fsync'd probe, and the worker's CPU per byte.

    python benchmarks/profile_write.py                               # 2 GiB, nvrx, format="auto", 4 saves
    python benchmarks/profile_write.py --engine mcore --format dcp --load   # 2 threads of matmuls beside it
    python benchmarks/profile_write.py --gib 0.5 --saves 2 --pause    # prints the worker PID, waits for Enter
                                                                      # (attach py-spy / perf to it)

Drives ``AsyncCheckpointIO`` without a Trainer, as ``AsyncFinalizerCallback`` does: ``save_checkpoint``,
then a non-blocking ``finalize`` every ``--poll-ms`` (a training batch) until the save is committed.
Before each save, an fsync'd probe writes the same number of bytes to the same directory (the floor:
size / probe bandwidth; ``--direct-probe``: the probe bypasses the page cache with ``O_DIRECT``, the
stricter floor). Per save it reports:

- **commit s**: from the save call's return to the commit seen by ``finalize`` (durable, published);
- **vs floor**: commit s / (state bytes / probe bandwidth); the target is at most 2;
- **worker CPU s**: user + system seconds of the trainer's child processes (the worker tree), all
  threads, from the save's return to the commit, its **system** part (the kernel's: page-cache copies and
  writeback land here), and **GB / CPU s** (robust to a noisy machine);
- **trainer CPU s** spent in the same interval by this process beyond the load threads' own
  (the save call is not counted: it returns first).

``--load`` runs 2 threads of 512x512 matmuls (1 torch thread each) in this process for the whole run,
as a training loop on a 2-core machine would. Medians over the saves.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from lightning_asyncckpt import AsyncCheckpointIO


def make_state(nbytes: int, count: int) -> dict:
    per = nbytes // count // 4
    sd = {f"layer{i}.weight": torch.randint(0, 1 << 20, (per,), dtype=torch.int32).view(torch.float32) for i in range(count)}
    return {"state_dict": sd, "epoch": 1, "global_step": 10, "hyper_parameters": {"lr": 0.1}}


def probe(directory: Path, nbytes: int, direct: bool = False) -> float:
    """Bytes per second of an fsync'd sequential write of ``nbytes`` in 8 MiB blocks (``direct``: with
    ``O_DIRECT``, from an aligned buffer, bypassing the page cache)."""
    import mmap

    block = mmap.mmap(-1, 8 << 20)
    block.write(b"\1" * len(block))
    path = directory / "probe.bin"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    path.unlink()
    return written / elapsed


def tree_cpu() -> tuple[float, float]:
    """(user + system, system) CPU seconds of this process's children, all threads."""
    total = system = 0.0
    for c in psutil.Process().children(recursive=True):
        try:
            t = c.cpu_times()
            total, system = total + t.user + t.system, system + t.system
        except psutil.NoSuchProcess:
            pass
    return total, system


class Load:
    """2 threads of matmuls (torch releases the GIL): a training loop's CPU use on a 2-core machine."""

    def __init__(self, threads: int = 2):
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        self.cpu_s = 0.0

    def _run(self) -> None:
        a = torch.randn(512, 512)
        while not self.stop.is_set():
            a = torch.tanh(a @ a)

    def __enter__(self) -> Load:
        torch.set_num_threads(1)
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def run(args: argparse.Namespace) -> list[dict]:
    workdir = Path(tempfile.mkdtemp(prefix="profile-write-", dir=args.dir or os.getcwd()))
    state = make_state(int(args.gib * (1 << 30)), args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in state["state_dict"].values())
    io = AsyncCheckpointIO(args.engine, worker=args.worker, format=args.format, max_pending=1,
                           thread_count=args.thread_count, timeout_s=600, worker_nice=args.worker_nice)
    rows = []
    try:
        io.warmup(like=state)
        print(f"worker pids {io.session.worker_pids()}, state {nbytes / 1e9:.2f} GB in {args.tensors} tensors, "
              f"{args.engine} format={args.format} load={args.load} worker_nice={args.worker_nice}", flush=True)
        if args.pause:
            input("attach now, then press Enter: ")
        with (Load() if args.load else _Null()):
            for n in range(args.saves):
                bw = probe(workdir, nbytes, direct=args.direct_probe)
                path = workdir / f"ckpt-{n}.ckpt"
                t_save = time.perf_counter()
                io.save_checkpoint(state, path)
                t0 = time.perf_counter()
                (cpu0, sys0), me0 = tree_cpu(), time.process_time()
                t_done = None
                while io.session.num_pending:
                    time.sleep(args.poll_ms / 1000)
                    io.finalize()
                    if io.session.num_pending == 0:
                        t_done = time.perf_counter()
                t_done = t_done or time.perf_counter()
                cpu, sys_s = (now - before for now, before in zip(tree_cpu(), (cpu0, sys0)))
                rec = io.history[-1]
                floor = nbytes / bw
                row = {"probe_gbps": bw / 1e9, "floor_s": floor, "stall_s": t0 - t_save, "commit_s": t_done - t0,
                       "ratio": (t_done - t0) / floor, "worker_cpu_s": cpu, "worker_sys_s": sys_s, "gb_per_cpu_s": nbytes / 1e9 / max(cpu, 1e-9),
                       "worker_s": rec.worker_s, "trainer_cpu_s": time.process_time() - me0, "file_nbytes": rec.nbytes}
                rows.append(row)
                print(f"  save {n}: probe {row['probe_gbps']:.2f} GB/s floor {floor:.2f}s commit {row['commit_s']:.2f}s "
                      f"({row['ratio']:.2f}x floor) worker {rec.worker_s:.2f}s cpu {cpu:.2f}s (system {sys_s:.2f}s) "
                      f"({row['gb_per_cpu_s']:.2f} GB/cpu-s) stall {row['stall_s']:.2f}s", flush=True)
                if n:  # keep one checkpoint for a load check; the disk is shared
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
        if args.check:
            loaded = torch.load(workdir / "ckpt-0.ckpt", weights_only=True) if args.format == "auto" else None
            if loaded is not None:
                assert all(torch.equal(loaded["state_dict"][k], v) for k, v in state["state_dict"].items())
                print("  torch.load(weights_only=True) of save 0: equal")
    finally:
        io.teardown()
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--engine", default="nvrx", choices=("nvrx", "mcore"))
    ap.add_argument("--worker", default="persistent", choices=("persistent", "fork"))
    ap.add_argument("--format", default="auto", choices=("auto", "dcp"))
    ap.add_argument("--thread-count", type=int, default=1)
    ap.add_argument("--worker-nice", type=int, default=0, help="AsyncCheckpointIO(worker_nice=...), 0 by default")
    ap.add_argument("--poll-ms", type=float, default=50.0, help="interval of the non-blocking finalize (a batch)")
    ap.add_argument("--load", action="store_true", help="2 threads of matmuls in this process")
    ap.add_argument("--pause", action="store_true", help="wait for Enter after the worker starts")
    ap.add_argument("--direct-probe", action="store_true", help="the probe writes with O_DIRECT (no page cache)")
    ap.add_argument("--check", action="store_true", help="torch.load the first checkpoint and compare")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    rows = run(args)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"| {args.engine} | {args.format} | {'load' if args.load else 'idle'} | {med['probe_gbps']:.2f} | "
          f"{med['floor_s']:.2f} | {med['commit_s']:.2f} | {med['ratio']:.2f} | {med['worker_cpu_s']:.2f} | "
          f"{med['worker_sys_s']:.2f} | {med['gb_per_cpu_s']:.2f} | {med['trainer_cpu_s']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
