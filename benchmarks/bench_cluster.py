"""Resume at scale on an emulated cluster: time and bytes read from shared storage, ours against stock's.

    python benchmarks/bench_cluster.py                                  # 2 nodes x 2 ranks, 0.25 GiB
    python benchmarks/bench_cluster.py --links 200:200,1000:200 --size 0.25 --reps 3
    python benchmarks/bench_cluster.py --render benchmarks/results/cluster-<time>.json

Each ``--links`` entry ``NIC:STORAGE`` (Mbit/s) makes an emulated cluster (``tests/netcluster.py``): every node
in its own network namespace behind a ``tc`` rate limit of ``NIC`` both ways, the shared storage (moto's
S3-protocol server, mounted on every node with s3fs at one path) behind its own link of ``STORAGE`` Mbit/s
that all nodes share. Each node runs ``--ranks-per-node`` ranks in one gloo group over those links.

Rank 0 writes a Lightning-like ``torch.save`` checkpoint of ``--size`` GiB to the shared storage (untimed).
Then, ``--reps`` times in a rotated order, every rank resumes from it as Lightning's resume does, through a
``DDPStrategy``'s ``load_checkpoint``:

- ``stock``: with ``TorchCheckpointIO`` (each rank reads the whole file);
- ``ours``: with ``AsyncCheckpointIO`` (each rank reads about ``1/W`` of it and receives the rest from the
  other ranks over the process group).

Before each resume the page cache is dropped (``/proc/sys/vm/drop_caches``: the kernel's, which the FUSE
mounts use too). A resume's time is the slowest rank's, from a common barrier until its checkpoint is loaded;
its bytes are what the storage sent meanwhile, read from the storage link's counters (the storage's own view,
protocol headers included). Every resumed checkpoint is compared with the saved tensors, bit for bit.

The projection to larger clusters (the formula is printed with the table): with ``S`` the checkpoint's
bytes, ``W = N x R`` ranks on ``N`` nodes, ``B_s`` the storage's bandwidth (shared by all nodes) and ``B_n``
a node's:

- stock reads ``k x S`` from the storage (``k`` measured here: ``W`` if every rank reads it, ``N`` if a
  node's ranks share its page cache): ``T_stock = k x S / B_s + c_stock``, ``c_stock`` (its load) measured here
  as the rest;
- ours reads ``S`` once and moves ``(W - 1) / W x S`` into every rank; gloo's ring all-gather passes it
  along a ring of the ranks, so each node's link carries ``(W - 1) / W x S`` in, whatever ``R``:
  ``T_ours = S / B_s + (W - 1) / W x S / B_n + c``, where ``c`` (the load from memory with its CRC32 checks,
  and the exchange's per-message costs: ``W - 1`` messages per round, ``S / (W x chunk)`` rounds) is measured
  here as the rest, and kept constant in the projection.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the emulated cluster
from netcluster import NetCluster, storage_bytes_sent  # noqa: E402

GiB = 1 << 30
_PORT = 29541


def _state(size_bytes: int, layers: int = 16) -> dict[str, Any]:
    """A Lightning-like checkpoint whose tensors hold known values (a generator's, seeded)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    per = max(1, size_bytes // (3 * layers) // 4)
    weights = {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(layers)}
    moments = {i: {"exp_avg": torch.randn(per, generator=g), "exp_avg_sq": torch.randn(per, generator=g)}
               for i in range(layers)}
    return {"state_dict": weights, "optimizer_states": [{"state": moments, "param_groups": [{"lr": 1e-3}]}],
            "global_step": 100, "epoch": 0}


def _same(a: dict, b: dict) -> bool:
    import torch

    if a["state_dict"].keys() != b["state_dict"].keys():
        return False
    pairs = list(zip(a["state_dict"].values(), b["state_dict"].values()))
    for i, m in a["optimizer_states"][0]["state"].items():
        pairs += [(m[k], b["optimizer_states"][0]["state"][i][k]) for k in ("exp_avg", "exp_avg_sq")]
    return all(torch.equal(x, y) for x, y in pairs) and a["global_step"] == b["global_step"]


def rank_main(rank: int, world: int, args: argparse.Namespace, shared: Path, out: Path) -> None:
    """(every rank) Joins the group, resumes ``--reps`` times per variant, and rank 0 writes the results."""
    import datetime

    import torch
    import torch.distributed as dist
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_asyncckpt import AsyncCheckpointIO

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{_PORT}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    switch = os.environ["BENCH_SWITCH_NS"]
    path = shared / "last.ckpt"
    expected = _state(int(args.size * GiB))
    if rank == 0:
        before = storage_bytes_sent(switch)
        torch.save(expected, path)
        os.sync()
        file_bytes = path.stat().st_size
        write = {"file_bytes": file_bytes, "storage_sent_during_write": storage_bytes_sent(switch) - before}
    dist.barrier()
    ours = AsyncCheckpointIO()
    variants = {"stock": DDPStrategy(checkpoint_io=TorchCheckpointIO()), "ours": DDPStrategy(checkpoint_io=ours)}
    results: list[dict[str, Any]] = []
    names = list(variants)
    for rep in range(args.reps):
        for name in names[rep % 2:] + names[: rep % 2]:
            if rank == 0:
                subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False)
                before = storage_bytes_sent(switch)
            dist.barrier()
            t0 = time.perf_counter()
            loaded = variants[name].load_checkpoint(path)
            seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            exact = torch.tensor([int(_same(loaded, expected))])
            del loaded
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            dist.all_reduce(exact, op=dist.ReduceOp.MIN)
            if rank == 0:
                results.append({"variant": name, "rep": rep, "seconds": seconds.item(), "exact": bool(exact.item()),
                                "storage_sent": storage_bytes_sent(switch) - before})
                print(f"rep {rep} {name:>5}: {seconds.item():.2f} s, {results[-1]['storage_sent'] / (1 << 20):.1f} MiB"
                      f" from storage, exact {bool(exact.item())}", flush=True)
    ours.teardown()
    dist.barrier()
    if rank == 0:
        out.write_text(json.dumps({**write, "resumes": results, "world": world}))
    dist.destroy_process_group()


def node_main(node: int, tmp: Path) -> None:
    """(each node's process, in its namespace) Runs the node's ranks; exits with the first failure."""
    import torch.multiprocessing as mp

    args = pickle.loads((tmp / "args.pkl").read_bytes())
    world = args.nodes * args.ranks_per_node
    ctx = mp.get_context("spawn")
    ranks = [ctx.Process(target=rank_main, args=(node * args.ranks_per_node + i, world, args, tmp / "shared",
                                                  tmp / "result.json")) for i in range(args.ranks_per_node)]
    for r in ranks:
        r.start()
    for r in ranks:
        r.join()
    sys.exit(max(abs(r.exitcode or 0) for r in ranks))


def run_links(args: argparse.Namespace, nic: float, storage: float) -> dict[str, Any]:
    """One emulated cluster at these link rates; rank 0's results."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    (tmp / "shared").mkdir()
    (tmp / "args.pkl").write_bytes(pickle.dumps(args))
    with NetCluster(args.nodes, nic_mbit=nic, storage_mbit=storage) as cluster:
        codes = cluster.run_on_every_node(tmp / "shared", [sys.executable, __file__, "--node", str(tmp)], tmp,
                                          args.timeout, env={"BENCH_SWITCH_NS": cluster.switch_ns,
                                                             "PYTHONWARNINGS": "ignore::FutureWarning"})
    out = tmp / "result.json"
    if any(c != 0 for c in codes) or not out.is_file():
        logs = "\n".join((tmp / f"node{k}.log").read_text()[-3000:] for k in range(args.nodes))
        raise SystemExit(f"bench_cluster: the nodes exited with {codes}\n{logs}")
    result = json.loads(out.read_text())
    result.update(nic_mbit=nic, storage_mbit=storage)
    return result


def summarize(run: dict[str, Any], ranks_per_node: int) -> dict[str, Any]:
    """Medians per variant, the ratios, and the projection's constants."""
    by = {v: [r for r in run["resumes"] if r["variant"] == v] for v in ("stock", "ours")}
    med = {v: {"seconds": statistics.median(r["seconds"] for r in rs),
               "storage_sent": statistics.median(r["storage_sent"] for r in rs),
               "exact": all(r["exact"] for r in rs), "reps": len(rs)} for v, rs in by.items()}
    size = run["file_bytes"]
    b_s, b_n = run["storage_mbit"] * 1e6 / 8, run["nic_mbit"] * 1e6 / 8
    k = med["stock"]["storage_sent"] / size
    world = run["world"]
    c = med["ours"]["seconds"] - size / b_s - (world - 1) / world * size / b_n
    c_stock = med["stock"]["seconds"] - k * size / b_s
    return {"file_bytes": size, "nic_mbit": run["nic_mbit"], "storage_mbit": run["storage_mbit"], "median": med,
            "rest_stock_s": c_stock,
            "time_ours_over_stock": med["ours"]["seconds"] / med["stock"]["seconds"],
            "bytes_ours_over_file": med["ours"]["storage_sent"] / size, "bytes_stock_over_file": k,
            "rest_c_s": c, "world": run["world"]}


def project(s: dict[str, Any], nodes: int, ranks_per_node: int, measured_nodes: int) -> tuple[float, float]:
    """(stock, ours) seconds at ``nodes`` nodes by the formula of the module's docstring, with ``k`` scaled as
    measured (per rank or per node) and ``c`` as measured."""
    size = s["file_bytes"]
    b_s, b_n = s["storage_mbit"] * 1e6 / 8, s["nic_mbit"] * 1e6 / 8
    per = s["bytes_stock_over_file"] / measured_nodes  # reads per node as measured (R if per rank, 1 if shared)
    stock = per * nodes * size / b_s + max(s["rest_stock_s"], 0.0)
    world = nodes * ranks_per_node
    ours = size / b_s + (world - 1) / world * size / b_n + max(s["rest_c_s"], 0.0)
    return stock, ours


def markdown(summaries: list[dict[str, Any]], args: dict[str, Any]) -> str:
    lines = [f"{args['nodes']} nodes x {args['ranks_per_node']} ranks, a {summaries[0]['file_bytes'] / GiB:.3g} GiB"
             " torch.save checkpoint, resumed through DDPStrategy.load_checkpoint; medians of"
             f" {args['reps']} resumes each, the page cache dropped before each.", "",
             "| NIC : storage (Mbit/s) | stock (s) | ours (s) | ours / stock | read from storage, stock (x file)"
             " | ours (x file) | exact (stock, ours) |", "|---|---|---|---|---|---|---|"]
    for s in summaries:
        m = s["median"]
        lines.append(f"| {s['nic_mbit']:g} : {s['storage_mbit']:g} | {m['stock']['seconds']:.2f} | "
                     f"{m['ours']['seconds']:.2f} | {s['time_ours_over_stock']:.2f}x | {s['bytes_stock_over_file']:.2f}x"
                     f" | {s['bytes_ours_over_file']:.3f}x | {m['stock']['exact']}, {m['ours']['exact']} |")
    lines += ["", "Projection: T_stock = k x S / B_s + c_stock (k: the reads measured per node, times N); T_ours = S / B_s +"
              " (W - 1) / W x S / B_n + c (c measured above, kept constant; the exchange's messages per rank stay"
              " about S / chunk, and the chunk shrinks from 4 MiB to 64 KiB past 16 ranks).", "",
              "| NIC : storage (Mbit/s) | c_stock, c (s) | nodes | stock (s) | ours (s) | ours / stock |", "|---|---|---|---|---|---|"]
    for s in summaries:
        for n in (args["nodes"], 64, 1024):
            st, ou = project(s, n, args["ranks_per_node"], args["nodes"])
            lines.append(f"| {s['nic_mbit']:g} : {s['storage_mbit']:g} | {s['rest_stock_s']:.2f}, {s['rest_c_s']:.2f} | {n} | {st:.1f} | "
                         f"{ou:.1f} | {ou / st:.3f}x |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--node":
        node_main(int(os.environ["NODE_INDEX"]), Path(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=0.25, help="checkpoint size in GiB")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--links", default="200:200,1000:200", help="NIC:STORAGE Mbit/s pairs, comma-separated")
    p.add_argument("--reps", type=int, default=3, help="resumes per variant and link setting, rotated")
    p.add_argument("--timeout", type=float, default=900.0, help="hard deadline per link setting, in seconds")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--render", default=None, help="print the tables of a saved cluster-*.json instead of running")
    p.add_argument("--rewrite", action="store_true", help="with --render: store the summaries again in the file")
    args = p.parse_args()
    if args.render:  # the summaries again from the measured runs (the model's constants by this file's formula)
        saved = json.loads(Path(args.render).read_text())
        saved["summaries"] = [summarize(r, saved["args"]["ranks_per_node"]) for r in saved["runs"]]
        print(markdown(saved["summaries"], saved["args"]))
        if args.rewrite:
            Path(args.render).write_text(json.dumps(saved, indent=1))
        return
    t0 = time.monotonic()
    runs = []
    for pair in args.links.split(","):
        nic, storage = (float(x) for x in pair.split(":"))
        print(f"== NIC {nic:g} Mbit/s, storage {storage:g} Mbit/s", flush=True)
        runs.append(run_links(args, nic, storage))
    summaries = [summarize(r, args.ranks_per_node) for r in runs]
    table = markdown(summaries, vars(args))
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    wall = time.monotonic() - t0
    load = os.getloadavg()
    (out / f"cluster-{stamp}.json").write_text(json.dumps(
        {"args": vars(args), "cpus": os.cpu_count(), "wall_s": wall, "loadavg_end": load, "runs": runs,
         "summaries": summaries}, indent=1))
    md = out / f"cluster-{stamp}.md"
    md.write_text(
        f"# bench_cluster.py, {time.strftime('%Y-%m-%d %H:%M')}\n\n`{' '.join(sys.argv)}` on {os.cpu_count()} CPUs,"
        f" {wall:.0f} s, load average {load[0]:.1f} at the end\n\n" + table + "\n")
    from plots import write_plots

    write_plots(out / f"cluster-{stamp}.json")


if __name__ == "__main__":
    main()
