"""What one gather of the local tier costs: ``torch.distributed.all_gather_object`` (two collectives) against
``lightning_asyncckpt.collectives.gather_objects`` (one, where every object fits its slot), on
a gloo group of ``--world`` processes on this machine's cores.

    python benchmarks/probe_gather.py                  # 4 ranks, 200 gathers of each kind and size
    python benchmarks/probe_gather.py --world 8 --reps 100

The two kinds alternate in rounds of 20 (so that both see the same machine), each gather after a barrier;
rank 0's medians. "small" is a restore's typical row (a few manifests' worth of a rank's holdings);
"large" does not fit the slot, so both kinds run two collectives. Timings only; no assertion.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_asyncckpt.collectives import SLOT, gather_objects

OBJECTS = {
    "small": [{"step": 10, "owner": o, "nbytes": 1 << 26, "crc32": 0x1234ABCD, "topology": (4, 2, 2)} for o in range(2)],
    "large": b"x" * (4 * SLOT),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stock(obj, world):
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _rank(rank: int, world: int, port: int, reps: int, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    kinds = {"all_gather_object": lambda obj: _stock(obj, world), "all_gather_objects": gather_objects}
    times: dict[tuple[str, str], list[float]] = {}
    for _round in range(max(reps // 20, 1)):
        for size, obj in OBJECTS.items():
            for kind, fn in kinds.items():
                for _ in range(20):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn(obj)
                    times.setdefault((size, kind), []).append(time.perf_counter() - t0)
    if rank == 0:
        q.put({k: statistics.median(v) for k, v in times.items()})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args.reps, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    try:
        med = q.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    print(f"\n{args.world} gloo ranks, {args.reps} gathers of each, rank 0's medians (ms):\n")
    print("| object | all_gather_object | all_gather_objects | ratio |\n|---|---|---|---|")
    for size in OBJECTS:
        a, b = med[(size, "all_gather_object")], med[(size, "all_gather_objects")]
        print(f"| {size} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
