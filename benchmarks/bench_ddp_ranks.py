"""AsyncDDPStrategy's fully parallel write on 1 rank against 2 ranks (gloo, CPU).

    python benchmarks/bench_ddp_ranks.py [--mib 512] [--saves 5] [--engine nvrx]

Each run trains a model of about ``--mib`` MiB of weights plus Adam state and saves it ``--saves`` times
(waiting for each commit). It prints, per world size, the median stall (per rank), the median time from
save to durable commit, the bytes each rank wrote, and the commit throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def run(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    from lightning_asyncckpt import AsyncCheckpointIO, AsyncDDPStrategy

    width = int((args.mib * (1 << 20) / 4 / 3 / 4) ** 0.5)  # 4 layers, weights + 2 Adam moments

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(4)])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class SaveAndWait(L.Callback):
        def __init__(self) -> None:
            self.e2e: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, *a):
            if trainer.global_step % 2 == 0 and len(self.e2e) < args.saves:
                t0 = time.perf_counter()
                trainer.save_checkpoint(os.path.join(args.out, f"s{trainer.global_step}"))
                trainer.strategy.checkpoint_io.finalize(blocking=True)
                self.e2e.append(time.perf_counter() - t0)

    io = AsyncCheckpointIO(args.engine)
    cb = SaveAndWait()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, width)), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=args.ranks, strategy=AsyncDDPStrategy(), plugins=[io],
                        callbacks=[cb], max_steps=2 * args.saves + 1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(), data)
    stalls = [r.stall_s for r in io.history]
    rank_bytes = statistics.median(r.local_nbytes for r in io.history)
    total = sum(p.numel() * p.element_size() for p in trainer.lightning_module.parameters()) * 3
    result = {"rank": trainer.global_rank, "stall_s": statistics.median(stalls[1:] or stalls),
              "e2e_s": statistics.median(cb.e2e[1:] or cb.e2e), "rank_bytes": rank_bytes, "state_bytes": total}
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--engine", default="nvrx")
    p.add_argument("--ranks", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ranks:
        run(args)
        return
    rows = []
    for ranks in (1, 2):
        with tempfile.TemporaryDirectory(prefix="bench-ddp-") as out:
            cmd = [sys.executable, __file__, "--mib", str(args.mib), "--saves", str(args.saves),
                   "--engine", args.engine, "--ranks", str(ranks), "--out", out]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                                  env=dict(os.environ, MASTER_PORT=str(29000 + ranks)))
            results = [json.loads(ln[7:]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not results:
                print(proc.stderr[-3000:], file=sys.stderr)
                continue
            r0 = min(results, key=lambda r: r["rank"])
            rows.append((ranks, r0))
    print("| ranks | stall per rank (s) | save to commit (s) | bytes per rank | commit throughput (GB/s) |")
    print("|---|---|---|---|---|")
    for ranks, r in rows:
        print(f"| {ranks} | {r['stall_s']:.3f} | {r['e2e_s']:.2f} | {r['rank_bytes'] / 1e6:.0f} MB "
              f"| {r['state_bytes'] / r['e2e_s'] / 1e9:.2f} |")


if __name__ == "__main__":
    main()
