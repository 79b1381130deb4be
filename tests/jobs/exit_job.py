"""A one-process Fabric script that saves and leaves without any teardown, for tests/test_exit.py.

``--how end``: the script just ends after ``fabric.save``; ``--how raise``: it dies of an uncaught
exception. Before leaving it writes its ``reports.RankReport`` to ``<out>/report.json``: what it saved and its
writers' PIDs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning as L
import torch

from lightning_asyncckpt import AsyncCheckpointIO, testing
from lightning_asyncckpt.storage import commit
from reports import RankReport


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--how", choices=["end", "raise"], required=True)
    p.add_argument("--engine", default="nvrx")
    p.add_argument("--worker", default="persistent")
    p.add_argument("--delay", type=float, default=1.0)
    p.add_argument("--drain", type=float, default=300.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    io = AsyncCheckpointIO(args.engine, worker=args.worker, drain_timeout_s=args.drain)
    io.write_hook = testing.DelayWrite(args.delay)  # still writing when the script leaves
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
    fabric.launch()
    model = torch.nn.Linear(32, 32)
    path = os.path.join(args.out, "ckpt")
    fabric.save(path, {"model": model, "step": 3})
    expected = {k: v.tolist() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)  # after save returned: must not reach the checkpoint
    seen = {"expected": expected, "pids": io.session.worker_pids(), "committed_at_return": commit.is_complete(Path(path))}
    RankReport(rank=0, seen=seen).write(os.path.join(args.out, "report.json"))
    if args.how == "raise":
        raise RuntimeError("uncaught error after fabric.save")


if __name__ == "__main__":
    main()
