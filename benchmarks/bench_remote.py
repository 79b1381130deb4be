"""Saving to an object store: how long training stops, and how soon the checkpoint is there.

    python benchmarks/bench_remote.py                     # 256 MiB, 5 saves per variant
    python benchmarks/bench_remote.py --mib 64 --rounds 3

Starts a real S3-protocol server (moto's server mode, as the tests do) on 127.0.0.1 and saves one
Lightning-style checkpoint (``--mib`` of float32 weights in 16 tensors) to ``s3://bench/...``, through
s3fs (fsspec), in rotating order:

- ``stock``: Lightning's ``TorchCheckpointIO.save_checkpoint`` (serializes in memory, then uploads, all
  on the training thread): its stall is the whole save;
- ``ours``: ``AsyncCheckpointIO()`` (nvrx, persistent worker): the stall is the snapshot; the worker
  streams the file to the store; "to commit" runs until ``finalize(blocking=True)`` returns;
- ``upload_floor``: the bytes of the same file uploaded with ``fs.pipe`` from this process, once
  serialized: what the server and the client library take for the upload alone.

Loopback moto is a Python server, far slower than a real store; the ratios within one run are the
figures to read. Reports medians over the saves after the first.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the loopback S3 server

from s3server import S3Server  # noqa: E402


def make_checkpoint(mib: int) -> dict:
    numel = (mib << 20) // 4 // 16
    return {"state_dict": {f"layer{i}.weight": torch.randn(numel) for i in range(16)}, "global_step": 1,
            "pytorch-lightning_version": "2.6.6"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with S3Server(Path(tempfile.mkdtemp())) as server:
        os.environ.update(server.env)
        import fsspec
        from lightning.fabric.plugins import TorchCheckpointIO

        from lightning_asyncckpt import AsyncCheckpointIO

        fs = fsspec.filesystem("s3")
        fs.mkdir("bench")
        ckpt = make_checkpoint(args.mib)
        buf = io.BytesIO()
        torch.save(ckpt, buf)
        nbytes = len(buf.getvalue())
        stock, ours = TorchCheckpointIO(), AsyncCheckpointIO()
        ours.warmup(ckpt)
        rows: dict[str, dict[str, list[float]]] = {v: {"stall": [], "commit": []} for v in ("stock", "ours", "upload_floor")}
        order = list(rows)
        for r in range(args.rounds + 1):
            for v in order[r % 3:] + order[:r % 3]:
                url = f"s3://bench/{v}/r{r}.ckpt"
                t0 = time.perf_counter()
                if v == "stock":
                    stock.save_checkpoint(ckpt, url)
                    t1 = t2 = time.perf_counter()
                elif v == "ours":
                    ours.save_checkpoint(ckpt, url)
                    t1 = time.perf_counter()
                    ours.finalize(blocking=True)
                    t2 = time.perf_counter()
                else:
                    fs.pipe(url, buf.getvalue())
                    t1 = t2 = time.perf_counter()
                if r > 0:  # the first round warms up connections and imports
                    rows[v]["stall"].append(t1 - t0)
                    rows[v]["commit"].append(t2 - t0)
        ours.teardown()
        floor = statistics.median(rows["upload_floor"]["commit"])
        stock_stall = statistics.median(rows["stock"]["stall"])
        print(f"\n{nbytes / 1e6:.0f} MB checkpoint to loopback moto (s3fs), median of {args.rounds}:\n")
        print("| variant | stall (s) | stall vs stock | to commit (s) | to commit vs upload floor | MB/s to commit |")
        print("|---|---|---|---|---|---|")
        for v, m in rows.items():
            stall, commit = statistics.median(m["stall"]), statistics.median(m["commit"])
            print(f"| {v} | {stall:.3f} | {stall / stock_stall:.3f}x | {commit:.2f} | {commit / floor:.2f}x | {nbytes / 1e6 / commit:.0f} |")


if __name__ == "__main__":
    main()
