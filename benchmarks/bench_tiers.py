"""The local tier against the persistent one, in one run: training overhead per save and recovery time.

    python benchmarks/bench_tiers.py                      # 0.25 GiB of state, 4 ranks on 2 simulated nodes
    python benchmarks/bench_tiers.py --size 0.5 --reps 12 --recoveries 7
    python benchmarks/bench_tiers.py --render benchmarks/results/tiers-<time>.json

Four ranks (``torch.multiprocessing``, spawn; gloo on 127.0.0.1) simulate two nodes: ranks 0 and 1 are
node 0, ranks 2 and 3 node 1 (``open_tier(config, node_rank=rank // 2, local_world_size=2)``), so the local tier's
cliques are {0, 2} and {1, 3} and every share has its replica on the other node. Each node has its own
local directory (``/dev/shm/bench-tiers-<pid>/node<k>``); the persistent tier (``AsyncCheckpointIO("nvrx")``
on rank 0) writes a ``torch.save`` file under a temporary directory on the normal disk (``--dir``).
Everything is removed at the end; the run has a hard deadline (``--timeout``), after which the parent
kills every rank.

Every rank holds the same Lightning-like checkpoint (``state_dict``, ``optimizer_states`` with two
moments per layer, ``global_step``: ``--size`` GiB of float32 in ``3 x --layers`` tensors). A *training
step* is a matmul loop (``--compute-ms``, calibrated at start with every rank computing), a ``--grad-mib``
all-reduce (a DDP gradient bucket's stand-in, which keeps the ranks in step as DDP does), then
``add_(1)`` on every state tensor (an optimizer step writes all of it).

**Overhead.** A *period* is one save and the ``--every`` training steps after it, timed on rank 0 from a
barrier to a barrier, in the variants below, interleaved in the same processes, their order rotated per
repetition (``--reps``):

- ``baseline``: ``--every`` steps, no save;
- ``local``: ``TierRun.save`` on every rank, the steps with ``TierRun.boundary()`` after each, then
  ``TierRun.finish()`` (the wait for the save's thread, if it is still running, counts);
- ``local_lazy``: the same with ``snapshot="lazy"``'s rule (every state tensor left to the background copy;
  each step waits for it, ``TierRun.wait_copy()``, before its ``add_``, as the Trainer does before the
  optimizer step);
- ``local_overlap``: ``local`` with ``LocalTier(overlap_agreement=True)``: each boundary's all-reduce is
  posted and read at the next boundary (``finish()`` reads the last one);
- ``persistent``: rank 0 ``save_checkpoint`` (the previous file removed as ``ModelCheckpoint(save_top_k=1)``
  does), the steps with ``finalize()`` on every rank after each, then ``finalize(blocking=True)``;
- ``persistent_s3`` (unless ``--no-s3``; replicated layout): the same into ``s3://`` on the S3-protocol
  server below, the persistent tier of the README's example. That server (moto) runs on the same cores as
  the ranks, which a cluster's object store does not: it runs at CPU priority ``--s3-nice`` (19: it takes
  the cores only when the ranks leave them idle), and its CPU seconds are reported apart. Even so it slows
  the ranks here as no remote store would, and the rank's own upload (HTTP, s3fs) is real client work.

**Overhead per save** = the period - the same repetition's baseline period (median over repetitions; also
the median period minus the median baseline period). **Stall**: the save call (local: the slowest rank's
``last_stall_s``; persistent: rank 0's call). **Background**: the local writer thread's time (CRC32s, the
clique's exchange, commits; the slowest rank), and the persistent save's from the call to its commit
(``SaveRecord.write_s``). **Drain**: the wait at the period's end (near 0: the save finished within
``--every`` steps). **CPU**: user + system seconds of every rank's process (its threads: the local
writer) and its children (the persistent worker) over the period, summed over the ranks; the extra CPU
per save is the period's minus the same repetition's baseline's. Parts of the save call, its thread and
the recovery are timed by wrapping the tier's functions (``packing.copy_into``, ``ShareWriter.wait``,
``local_replicas.settle``, ``replication.replicate``, ``LocalStore.commit``, ``exchange.Posted.wait``,
``store.map_share``, ``shares.assemble``, and the load below) in this process; nothing else changes. One untimed save of each
tier, drained, comes first (the worker start, the staging buffers, the files, the space check).

**Recovery.** After one more save of each tier, of the same step, is complete (and committed), node 1
*comes back empty*: rank 2 deletes everything in node 1's local directory, then every rank times
``TierRun.latest(None)`` + ``take`` (node 1 refilled from node 0, CRC checks, the full checkpoint
assembled on every rank) against every rank's ``AsyncCheckpointIO.load_checkpoint`` of the persistent
file, once with the page cache dropped first (``sync; echo 3 > /proc/sys/vm/drop_caches``, or, where that
is refused, ``posix_fadvise(DONTNEED)`` on the file; the bytes still cached, read by ``fincore``, are
reported), once warm (read through first), and (unless ``--no-s3``) once from the same file on an
S3-protocol server (moto's server mode in its own process on 127.0.0.1, as the tests start it; every rank
reads ``s3://`` through s3fs). Either way the timed recovery ends once the restored checkpoint is loaded
into the rank's model: every tensor copied into a tensor of its own, allocated and touched before the
timing (what ``load_state_dict`` does), since the local tier hands out views of its files and the
persistent load tensors in memory of their own. A recovery's time is the slowest rank's, from a common
barrier. Every restored checkpoint is compared, tensor by tensor, with the live state.
Repeated ``--recoveries`` times, in a rotated order; figures are medians. Results:
``benchmarks/results/tiers-<time>.{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the loopback S3 server
from plots import write_plots  # noqa: E402
from s3server import S3Server  # noqa: E402
from tiers_rank import PER_NODE, S3_PATH, WORLD, rank_main  # noqa: E402
from tiers_report import markdown, summarize  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _renice(pid: int, nice: int) -> None:
    """Every thread of ``pid`` to CPU priority ``nice`` (threads it starts later inherit it from theirs)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, int(task.name), nice)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.multiprocessing as mp

    base = Path(args.local_dir) / f"bench-tiers-{os.getpid()}"
    tmp = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=args.dir))
    procs: list = []
    stack = contextlib.ExitStack()  # the S3-protocol server, stopped at the end whatever happens
    try:
        for node in range(WORLD // PER_NODE):
            (base / f"node{node}").mkdir(parents=True)
        (tmp / "ckpt").mkdir()
        out = tmp / "result.json"
        if args.s3:  # moto in its own process on loopback; the ranks (spawned) inherit the endpoint
            server = stack.enter_context(S3Server(tmp))
            os.environ.update(server.env, AWS_ENDPOINT_URL=server.direct_endpoint, BENCH_S3_PID=str(server.server_pid))
            _renice(server.server_pid, args.s3_nice)
            import fsspec

            fsspec.filesystem("s3").mkdir(S3_PATH.removeprefix("s3://").split("/")[0])
        ctx = mp.get_context("spawn")
        port = _free_port()
        os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # torch.cuda's pynvml notice, per rank
        procs = [ctx.Process(target=rank_main, args=(r, port, args, base, tmp / "ckpt", out)) for r in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):  # a rank failed: the others, within a grace
                grace = min(deadline, time.monotonic() + 15)
                while any(p.is_alive() for p in procs) and time.monotonic() < grace:
                    time.sleep(0.2)
                break
            time.sleep(0.2)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=30)
        codes = [p.exitcode for p in procs]
        if any(c != 0 for c in codes) or not out.is_file():
            raise SystemExit(f"bench_tiers: the ranks exited with {codes} (deadline --timeout {args.timeout:g} s)")
        return json.loads(out.read_text())
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        stack.close()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=0.25,
                   help="state in GiB (replicated: every rank holds all of it; sharded: a quarter each)")
    p.add_argument("--layout", choices=["replicated", "sharded"], default="replicated",
                   help="replicated: a DDP state, persistent as one torch.save file from rank 0; sharded: FSDP2-like"
                        " DTensor shards, persistent as a DCP directory from every rank (no S3 recovery)")
    p.add_argument("--layers", type=int, default=16, help="layers; 3 tensors each (weight, two moments)")
    p.add_argument("--every", type=int, default=8, help="training steps after each save (a period)")
    p.add_argument("--reps", type=int, default=10, help="periods of every variant, in a rotated order")
    p.add_argument("--recoveries", type=int, default=7, help="repetitions of every recovery, in a rotated order")
    p.add_argument("--compute-ms", type=float, default=60.0, help="matmul time per step, calibrated at start")
    p.add_argument("--grad-mib", type=float, default=4.0, help="the all-reduce per step, in MiB")
    p.add_argument("--timeout", type=float, default=420.0, help="hard deadline of the whole run, in seconds")
    p.add_argument("--dir", default=None, help="where the persistent tier writes (default: the system's temp dir)")
    p.add_argument("--local-dir", default="/dev/shm",
                   help="where the simulated nodes' local directories go (a tmpfs; e.g. one mounted huge=within_size)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--no-s3", dest="s3", action="store_false",
                   help="skip the recovery from the same file on an S3-protocol server (moto, loopback)")
    p.add_argument("--pin-nodes", action="store_true",
                   help="give each simulated node its own share of the cores (node k: the k-th half), as real nodes"
                        " have their own CPUs; the persistent writer, a child of rank 0, runs on node 0's")
    p.add_argument("--s3-nice", type=int, default=19,
                   help="CPU priority of the S3-protocol server (a cluster's store does not run on its nodes' cores)")
    p.add_argument("--cluster", action="store_true",
                   help="run the ranks on an emulated cluster (tiers_cluster.py: a network namespace per node behind"
                        " --nic-mbit, the persistent tier on shared storage behind --storage-mbit); needs root")
    p.add_argument("--nic-mbit", type=float, default=200, help="--cluster: each node's link, Mbit/s both ways")
    p.add_argument("--storage-mbit", type=float, default=200,
                   help="--cluster: the shared storage's link, Mbit/s both ways, shared by the nodes")
    p.add_argument("--render", default=None, help="print the tables of a saved tiers-*.json instead of running")
    args = p.parse_args()

    if args.layout == "sharded" or args.cluster:
        args.s3 = False  # the S3 recovery reads one torch.save file; on --cluster the persistent tier is on S3
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        print(markdown(summarize(saved["result"]), saved["result"], saved["args"]))
        return
    t0 = time.monotonic()
    if args.cluster:
        import tiers_cluster

        result = tiers_cluster.run(args)
    else:
        result = run(args)
    from lightning_asyncckpt.tiers.huge_pages import tmpfs_huge

    result["local_dir_huge"] = tmpfs_huge(Path(args.local_dir))  # None: not a tmpfs
    summary = summarize(result)
    table = markdown(summary, result, vars(args))
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    wall = time.monotonic() - t0
    (out / f"tiers-{stamp}.json").write_text(json.dumps(
        {"args": vars(args), "cpus": os.cpu_count(), "wall_s": wall, "summary": summary, "result": result}, indent=1))
    (out / f"tiers-{stamp}.md").write_text(
        f"# bench_tiers.py, {time.strftime('%Y-%m-%d %H:%M')}\n\n`{' '.join(sys.argv)}` on {os.cpu_count()} CPUs,"
        f" {wall:.0f} s\n\n" + table + "\n")
    write_plots(out / f"tiers-{stamp}.json")


if __name__ == "__main__":
    main()
