"""The per-save coordination cost of collective saves, with and without the plan cache (gloo, CPU, loopback).

    python benchmarks/bench_coordination.py [--ranks 2 4 8] [--items 512] [--saves 12] [--layout sharded]
    python benchmarks/bench_coordination.py --coordinator 2 64 1024   # the coordinator's planning alone

Each world size runs in its own spawned process group. Every rank holds ``--items`` small tensors (a
``DTensor`` sharded over all ranks each, as FSDP2's state is, for ``--layout sharded``; plain replicated
tensors for ``--layout replicated``), so that writing is negligible and coordination is what is measured.
Two ``AsyncCheckpointIO`` (``worker="fork"``) save alternately, one with the plan cache and one without
(``LIGHTNING_ASYNCCKPT_PLAN_CACHE=0`` when its run starts); per save and rank it times:

- **plan**: ``dcp_plan.plan_save`` (local plan, digest and all-reduce, or DCP's gather / global plan /
  scatter), after a barrier that the benchmark adds right before it (so that it does not time the other
  ranks' snapshots: 8 ranks on 2 cores arrive far apart);
- **save call**: the whole blocking ``save_checkpoint_*`` call (snapshot, agreement, plan, hand-over);
- **commit**: after every rank's write is done (``wait_for_local_writes`` and a barrier),
  ``finalize(blocking=True)``: the progress all-reduce, the gather of write results, ``.metadata`` written
  and published by rank 0, the gather of the outcome.

A save's time is the slowest rank's; the figures are medians over the saves after the first of each
mode. ``--coordinator`` times, in this one process, what only the coordinator does on a full planning
round (DCP's ``create_global_plan`` over synthetic per-rank plans of ``--items`` items) and the pickled
sizes of what is gathered and scattered: the terms that grow with the number of ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def rank_main(rank: int, world: int, args: argparse.Namespace, out: str, port: int) -> None:
    import logging

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from lightning_asyncckpt import AsyncCheckpointIO
    from lightning_asyncckpt.pipeline import dcp_plan, plan_cache

    timings: dict[str, list[float]] = {}
    plain_plan_save = dcp_plan.plan_save

    def timed_plan_save(*a, **kw):  # the scheduler calls it through the module: time it there
        # aligned first, so that the time is the planning's own, not the other ranks' snapshot still running
        # (on 2 cores, 8 ranks arrive far apart); this barrier is part of "save call" in both modes
        dist.barrier()
        t0 = time.perf_counter()
        try:
            return plain_plan_save(*a, **kw)
        finally:
            timings.setdefault("plan", []).append(time.perf_counter() - t0)

    dcp_plan.plan_save = timed_plan_save
    reused: list[str] = []  # the plan cache's decisions, from its log

    class Decisions(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reused.append(record.getMessage())

    logger = logging.getLogger(plan_cache.__name__)
    logger.addHandler(Decisions(logging.DEBUG))
    logger.setLevel(logging.DEBUG)
    state = make_state(args, world)
    ios = {}
    for mode in ("cached", "uncached"):
        ios[mode] = AsyncCheckpointIO("nvrx", worker="fork")
    rows: list[dict] = []
    for i in range(args.saves):
        for mode in ("cached", "uncached") if i % 2 == 0 else ("uncached", "cached"):
            os.environ[plan_cache.ENV_VAR] = "1" if mode == "cached" else "0"  # read when the io's run starts
            io, path = ios[mode], os.path.join(out, f"{mode}-{i}")
            timings.clear()
            reused.clear()
            dist.barrier()
            t0 = time.perf_counter()
            if args.layout == "sharded":
                io.save_checkpoint_sharded(state, path, {"step": i})
            else:
                io.save_checkpoint_distributed(state, path)
            t1 = time.perf_counter()
            io.session.wait_for_local_writes()
            dist.barrier()
            t2 = time.perf_counter()
            io.finalize(blocking=True)
            t3 = time.perf_counter()
            rows.append({"mode": mode, "save": i, "plan_s": sum(timings.get("plan", [0.0])),
                         "call_s": t1 - t0, "commit_s": t3 - t2, "reused": any("reused" in m for m in reused)})
    for io in ios.values():
        io.teardown()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        metadata_bytes = os.path.getsize(os.path.join(out, f"cached-{args.saves - 1}", ".metadata"))
        with open(os.path.join(out, "rows.json"), "w") as f:
            json.dump({"ranks": gathered, "metadata_bytes": metadata_bytes}, f)
    dist.destroy_process_group()


def make_state(args: argparse.Namespace, world: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(64, 4, generator=g) for i in range(args.items)}
    if args.layout == "replicated":
        return {"state_dict": tensors, "step": 0}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in tensors.items()}}


def run_world(args: argparse.Namespace, world: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench-coord-") as out:
        port = _free_port()
        mp.start_processes(rank_main, args=(world, args, out, port), nprocs=world, start_method="spawn")
        with open(os.path.join(out, "rows.json")) as f:
            data = json.load(f)
    per_save: dict[tuple, dict] = {}
    for rows in data["ranks"]:
        for r in rows:
            key = (r["mode"], r["save"])
            agg = per_save.setdefault(key, {"plan_s": 0.0, "call_s": 0.0, "commit_s": 0.0})
            for k in agg:
                agg[k] = max(agg[k], r[k])  # a save takes as long as its slowest rank
    summary = {"ranks": world, "metadata_bytes": data["metadata_bytes"],
               "reused": {m: sum(r["reused"] for r in data["ranks"][0] if r["mode"] == m) for m in ("cached", "uncached")}}
    for mode in ("cached", "uncached"):
        saves = [v for (m, i), v in sorted(per_save.items()) if m == mode and i > 0]
        for k in ("plan_s", "call_s", "commit_s"):
            summary[f"{mode}_{k}"] = statistics.median(s[k] for s in saves)
        summary[f"{mode}_total_s"] = statistics.median(s["call_s"] + s["commit_s"] for s in saves)
    return summary


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def coordinator_costs(args: argparse.Namespace, worlds: list[int]) -> list[dict]:
    """(one process) What grows with the ranks on a full planning round, measured at ``worlds`` ranks with
    synthetic plans like those of a sharded save (each rank: a chunk of every one of ``--items`` tensors)."""
    import dataclasses

    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    from lightning_asyncckpt.pipeline import plan_cache

    out = []
    for world in worlds:
        rows = 64 * world  # each rank's shard: 64 rows of 4 floats
        props = TensorProperties(dtype=torch.float32)
        plans = []
        for r in range(world):
            items = [WriteItem(
                index=MetadataIndex(f"model.layer{i}.weight", torch.Size([64 * r, 0])), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size([64 * r, 0]), torch.Size([64, 4])),
                                            properties=props, size=torch.Size([rows, 4])),
            ) for i in range(args.items)]
            plans.append(SavePlan(items))
        t0 = time.perf_counter()
        plan_cache.structure_digest(plans[0], world_size=world, rank=0, flatten=True, writer="w")
        digest_s = time.perf_counter() - t0  # what a cached save adds on each rank, besides one all-reduce
        planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        t0 = time.perf_counter()
        central, metadata = planner.create_global_plan(plans)
        central = [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(central)]
        plan_s = time.perf_counter() - t0
        # the commit: every rank's write results (all-gathered), merged into .metadata by the coordinator
        results = [[WriteResult(index=it.index, size_in_bytes=1024,
                                storage_data=_StorageInfo(relative_path=f"__{r}_0.distcp", offset=k * 1024, length=1024))
                    for k, it in enumerate(p.items)] for r, p in enumerate(central)]
        t0 = time.perf_counter()
        metadata.storage_data = {wr.index: wr.storage_data for per_rank in results for wr in per_rank}
        metadata_bytes = len(pickle.dumps(metadata))
        finish_s = time.perf_counter() - t0
        out.append({
            "ranks": world, "items_per_rank": args.items, "global_plan_s": plan_s, "digest_s": digest_s,
            "local_plan_bytes": len(pickle.dumps(plans[0])), "central_plan_bytes": len(pickle.dumps(central[0])),
            "write_results_bytes": len(pickle.dumps(results[0])), "metadata_bytes": metadata_bytes,
            "metadata_finish_s": finish_s,
        })
        print(json.dumps(out[-1]), flush=True)
    return out


def render(summaries: list[dict], coord: list[dict]) -> str:
    lines = []
    if summaries:
        lines += [
            "| ranks | plan, cached (ms) | plan, uncached (ms) | save call, cached (ms) | save call, uncached (ms) "
            "| commit, cached (ms) | commit, uncached (ms) | save call + commit, cached (ms) | save call + commit, uncached (ms) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for s in summaries:
            ms = {k: v * 1e3 for k, v in s.items() if k.endswith("_s")}
            lines.append(
                f"| {s['ranks']} | {ms['cached_plan_s']:.1f} | {ms['uncached_plan_s']:.1f} | {ms['cached_call_s']:.1f} "
                f"| {ms['uncached_call_s']:.1f} | {ms['cached_commit_s']:.1f} | {ms['uncached_commit_s']:.1f} "
                f"| {ms['cached_total_s']:.1f} | {ms['uncached_total_s']:.1f} |")
    if coord:
        lines += ["", "| ranks | items per rank | one rank's digest (ms) | coordinator's global plan (ms) | one local plan (bytes) "
                  "| one central plan (bytes) | one rank's write results (bytes) | .metadata (bytes) "
                  "| coordinator's .metadata merge + pickle (ms) |", "|---|---|---|---|---|---|---|---|---|"]
        for c in coord:
            lines.append(f"| {c['ranks']} | {c['items_per_rank']} | {c['digest_s'] * 1e3:.2f} | {c['global_plan_s'] * 1e3:.1f} "
                         f"| {c['local_plan_bytes']} | {c['central_plan_bytes']} | {c['write_results_bytes']} "
                         f"| {c['metadata_bytes']} | {c['metadata_finish_s'] * 1e3:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="*", default=[2, 4, 8])
    p.add_argument("--items", type=int, default=512)
    p.add_argument("--saves", type=int, default=12)
    p.add_argument("--layout", choices=["sharded", "replicated"], default="sharded")
    p.add_argument("--coordinator", type=int, nargs="*", default=[], help="world sizes for the coordinator alone")
    p.add_argument("--tag", default=time.strftime("%Y%m%d-%H%M%S"))
    args = p.parse_args()
    summaries = []
    for world in args.ranks:
        summaries.append(run_world(args, world))
        print(json.dumps(summaries[-1]), flush=True)
    coord = coordinator_costs(args, args.coordinator) if args.coordinator else []
    os.makedirs(RESULTS, exist_ok=True)
    base = os.path.join(RESULTS, f"coordination-{args.tag}")
    with open(base + ".json", "w") as f:
        json.dump({"args": vars(args), "worlds": summaries, "coordinator": coord, "python": sys.version}, f, indent=1)
    table = render(summaries, coord)
    with open(base + ".md", "w") as f:
        f.write(f"`{' '.join(sys.argv)}`\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
