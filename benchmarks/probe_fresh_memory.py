"""How long gloo takes to receive into fresh memory, against memory already touched.

    python benchmarks/probe_fresh_memory.py --dir /mnt/hp --reps 10

A recovery after a lost node receives each share into a new file on the node that came back empty. This probe
isolates that step. Two senders on one core each send ``--mib`` MiB to two receivers on the other core, as in
``bench_tiers.py --pin-nodes``. The senders read from a privately mapped file, as the replicas are sent. The
receivers receive into one of three places, a mode per run of ``--reps`` transfers:

- ``file``: a new file under ``--dir``, reserved with ``posix_fallocate`` and mapped shared (what a restore
  receives into), removed after each transfer;
- ``anon``: fresh anonymous memory (``torch.empty``);
- ``reuse``: the same anonymous memory every time, touched once before the first transfer.

It prints the slowest rank's seconds per transfer, in order. Nothing here is the library's code.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("file", "anon", "reuse")


def _sender_tensor(directory: Path, rank: int, nbytes: int) -> torch.Tensor:
    path = directory / f"src{rank}"
    with open(path, "wb") as f:
        f.truncate(nbytes)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), nbytes) as m:
        m.write(os.urandom(1 << 20) * (nbytes >> 20))
    with open(path, "rb") as f:
        return torch.frombuffer(mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY), dtype=torch.uint8)


def _receiver_tensor(mode: str, path: Path, nbytes: int, kept: torch.Tensor | None) -> torch.Tensor:
    if mode == "file":
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return torch.frombuffer(mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED), dtype=torch.uint8)
        finally:
            os.close(fd)
    if mode == "reuse" and kept is not None:
        return kept
    return torch.ones(nbytes, dtype=torch.uint8) if mode == "reuse" else torch.empty(nbytes, dtype=torch.uint8)


def _rank(rank: int, port: int, args: argparse.Namespace, results: mp.Queue) -> None:
    os.sched_setaffinity(0, {rank // 2 % os.cpu_count()})  # a simulated node per core
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    nbytes = args.mib << 20
    node_dir = Path(args.dir) / f"probe-fresh-{args.parent}" / f"node{rank // 2}"
    node_dir.mkdir(parents=True, exist_ok=True)
    src = _sender_tensor(node_dir, rank, nbytes) if rank < 2 else None
    for mode in args.modes:
        kept, times = None, []
        for rep in range(args.reps):
            path = node_dir / f"dst{rank}-{rep}"
            dst = _receiver_tensor(mode, path, nbytes, kept) if rank >= 2 else None
            kept = dst if mode == "reuse" else None
            dist.barrier()
            t0 = time.perf_counter()
            work = dist.isend(src, dst=rank + 2) if rank < 2 else dist.irecv(dst, src=rank - 2)
            work.wait()
            rows: list = [None] * 4
            dist.all_gather_object(rows, time.perf_counter() - t0)
            times.append(max(rows))
            del dst
            if rank >= 2 and mode == "file":
                path.unlink()
        if rank == 0:
            results.put((mode, times))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/dev/shm", help="where the files go (a tmpfs, as the local tier's)")
    p.add_argument("--mib", type=int, default=256, help="MiB per transfer (a share)")
    p.add_argument("--reps", type=int, default=10, help="transfers per mode")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = p.parse_args()
    args.parent = os.getpid()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = 20000 + os.getpid() % 20000
    procs = [ctx.Process(target=_rank, args=(r, port, args, results)) for r in range(4)]
    try:
        for proc in procs:
            proc.start()
        for _ in args.modes:
            mode, times = results.get(timeout=600)
            print(f"{mode:6s} " + " ".join(f"{t:.3f}" for t in times)
                  + f"   median {sorted(times)[len(times) // 2]:.3f} s", flush=True)
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(Path(args.dir) / f"probe-fresh-{args.parent}", ignore_errors=True)


if __name__ == "__main__":
    main()
