"""``bench_tiers.py --cluster``: the same run on an emulated cluster (``tests/netcluster.py``) instead of loopback.

Two nodes, each in its own network namespace behind a rate-limited link (``--nic-mbit``, both ways), run two
ranks each (``torch.multiprocessing``, spawn; gloo over the nodes' links, the rendezvous on node 0's address).
The persistent tier writes to, and reloads from, the shared storage: moto's S3-protocol server in its own
namespace behind its own link (``--storage-mbit``, shared by every node), mounted on every node with s3fs at
the same path. Each node's local tier is its own ``/dev/shm``. The storage's link counters give the bytes the
storage received and sent over the whole run.

    python benchmarks/bench_tiers.py --cluster --nic-mbit 200 --storage-mbit 200 --size 0.0625 --reps 5

Node ``k`` runs this file as ``tiers_cluster.py --node <run directory>`` with ``NODE_INDEX=k``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the emulated cluster
from tiers_rank import PER_NODE, WORLD, rank_main  # noqa: E402

from netcluster import NetCluster  # noqa: E402

_PORT = 29533
_LOCAL = Path("/dev/shm/bench-tiers-cluster")  # each node's own /dev/shm


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark's ranks on an emulated cluster and returns rank 0's result, with the storage's bytes."""
    import json

    tmp = Path(tempfile.mkdtemp(prefix="bench-tiers-cluster-", dir=args.dir))
    (tmp / "shared").mkdir()
    (tmp / "args.pkl").write_bytes(pickle.dumps(args))
    nodes = WORLD // PER_NODE
    with NetCluster(nodes, nic_mbit=args.nic_mbit, storage_mbit=args.storage_mbit) as cluster:
        codes = cluster.run_on_every_node(tmp / "shared", [sys.executable, __file__, "--node", str(tmp)], tmp,
                                          args.timeout, env={"PYTHONWARNINGS": "ignore::FutureWarning"})
        sent, received = cluster.storage_bytes_sent(), cluster.storage_bytes_received()
    out = tmp / "result.json"
    if any(c != 0 for c in codes) or not out.is_file():
        logs = "\n".join((tmp / f"node{k}.log").read_text()[-3000:] for k in range(nodes))
        raise SystemExit(f"bench_tiers --cluster: the nodes exited with {codes}\n{logs}")
    result = json.loads(out.read_text())
    result["cluster"] = {"nodes": nodes, "ranks_per_node": PER_NODE, "nic_mbit": args.nic_mbit,
                         "storage_mbit": args.storage_mbit, "storage_bytes_sent": sent,
                         "storage_bytes_received": received}
    return result


def node_main(node: int, tmp: Path) -> None:
    """(each node's process, in its namespace) Runs the node's ranks; exits with the first failure."""
    import torch.multiprocessing as mp

    args = pickle.loads((tmp / "args.pkl").read_bytes())
    (_LOCAL / f"node{node}").mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    ranks = [ctx.Process(target=rank_main, args=(node * PER_NODE + i, _PORT, args, _LOCAL, tmp / "shared" / "ckpt",
                                                  tmp / "result.json")) for i in range(PER_NODE)]
    if node == 0:
        (tmp / "shared" / "ckpt").mkdir(exist_ok=True)
    for r in ranks:
        r.start()
    for r in ranks:
        r.join()
    sys.exit(max(abs(r.exitcode or 0) for r in ranks))


if __name__ == "__main__":
    node_main(int(os.environ["NODE_INDEX"]), Path(sys.argv[2]))
