"""What the local tier's step agreement costs: one gloo all-reduce (MAX) of 5 int64, as
``TierRun.boundary`` runs it on the tier's own group.

    python benchmarks/probe_agreement.py                       # world sizes 2, 4, 8, 16, 32; then the step probe
    python benchmarks/probe_agreement.py --worlds 2 4 --steps 30

1. *By world size*: every process on the machine's cores, a barrier, then the all-reduce timed; the median
   of ``--reps`` per world size (rank 0's).
2. *After a step*: 4 processes, 2 pinned to each of the first two cores (two simulated nodes, as
   ``bench_tiers.py --pin-nodes``), each step about ``--matmuls`` 256x256 matmuls and a 4 MiB gradient
   all-reduce (which puts the ranks in step), then the agreement timed; the median over ``--steps`` steps
   (the first 10 dropped), per rank.

Timings only; no assertion. Needs at least 2 cores for part 2.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _by_world(rank: int, world: int, port: int, reps: int, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t = torch.zeros(5, dtype=torch.int64)
    for _ in range(20):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        q.put(statistics.median(times))
    dist.destroy_process_group()


def _after_step(rank: int, port: int, steps: int, matmuls: int, q) -> None:
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {rank // 2})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    tier_group = dist.new_group(backend="gloo")  # the tier's own group, as TierRun makes it
    t, grad = torch.zeros(5, dtype=torch.int64), torch.ones(1 << 20)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    times = []
    for _ in range(steps):
        for _ in range(matmuls):
            torch.mm(a, b)
        dist.all_reduce(grad)
        t0 = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=tier_group)
        times.append(time.perf_counter() - t0)
    q.put((rank, statistics.median(times[10:]), max(times[10:])))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="*", default=[2, 4, 8, 16, 32])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--matmuls", type=int, default=60)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    print(f"# probe_agreement.py on {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print("\n| processes | all-reduce of 5 int64, median (ms) |\n|---|---|")
    for world in args.worlds:
        q = ctx.SimpleQueue()
        mp.spawn(_by_world, args=(world, _port(), args.reps, q), nprocs=world)
        print(f"| {world} | {q.get() * 1e3:.3f} |", flush=True)
    if len(os.sched_getaffinity(0)) >= 2:
        q = ctx.SimpleQueue()
        mp.spawn(_after_step, args=(_port(), args.steps, args.matmuls, q), nprocs=4)
        rows = sorted(q.get() for _ in range(4))
        print("\n| rank (after a 4 MiB gradient all-reduce, 2 ranks per core) | median (ms) | max (ms) |")
        print("|---|---|---|")
        for rank, med, top in rows:
            print(f"| {rank} | {med * 1e3:.3f} | {top * 1e3:.3f} |")


if __name__ == "__main__":
    main()
