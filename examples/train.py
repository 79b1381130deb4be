"""The `make demo` job: a small model trains on CPU with asynchronous checkpoints.

Every save hands the state to a background worker and returns; the table at the end shows how long
each save stalled training, next to one synchronous `torch.save` of the same state for reference.

    python examples/train.py [--engine nvrx|mcore|auto] [--worker persistent|fork] [--max-steps 300]
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback
from lightning_asyncckpt.tools import cli
from lightning_asyncckpt.units import human_bytes


class MLP(L.LightningModule):
    def __init__(self, width: int = 1024, depth: int = 6, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def data(width: int, n: int = 2048) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=g)
    y = x[:, :8].sum(-1)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=g)


def sync_save_seconds(trainer: L.Trainer, path: str) -> float:
    """What Lightning's default, a synchronous torch.save (TorchCheckpointIO), stalls for the same state."""
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    t0 = time.perf_counter()
    TorchCheckpointIO().save_checkpoint(checkpoint, path)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="nvrx", choices=["nvrx", "mcore", "auto"])
    p.add_argument("--worker", default="persistent", choices=["persistent", "fork"])
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--every", type=int, default=25, help="save every N training steps")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--out", default="demo_output")
    args = p.parse_args()

    shutil.rmtree(args.out, ignore_errors=True)
    L.seed_everything(0)
    plugin = AsyncCheckpointIO(args.engine, worker=args.worker)
    ckpt = ModelCheckpoint(
        dirpath=os.path.join(args.out, "checkpoints"), monitor="step", mode="max", save_top_k=2,
        every_n_train_steps=args.every, save_last=True,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=args.max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=args.out,
        plugins=[plugin], callbacks=[AsyncFinalizerCallback(), ckpt],
    )
    model = MLP(width=args.width)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"engine={plugin.engine} worker={plugin.settings.worker} params={n_params / 1e6:.1f}M "
          f"(checkpoint ~{human_bytes(3 * 4 * n_params)} with AdamW state; sizes in binary units, 1 MiB = 2**20 bytes)")
    t0 = time.perf_counter()
    trainer.fit(model, data(args.width))
    elapsed = time.perf_counter() - t0

    print(f"\nfit took {elapsed:.1f}s for {trainer.global_step} steps; {len(plugin.history)} checkpoints committed")
    print(f"{'checkpoint':<28} {'stall (s)':>10} {'write (s)':>10} {'MiB':>8}")
    for r in plugin.history:
        print(f"{os.path.basename(r.path):<28} {r.stall_s:>10.4f} {r.write_s:>10.3f} {r.nbytes / 2**20:>8.1f}")
    stalls = sorted(r.stall_s for r in plugin.history[1:]) or [0.0]
    sync = sync_save_seconds(trainer, os.path.join(args.out, "sync_reference.ckpt"))
    print(f"median stall after the first save: {stalls[len(stalls) // 2]:.4f}s; "
          f"a synchronous torch.save of the same state (Lightning's default) stalls {sync:.4f}s")
    print("\ncheckpoints on disk:")
    for name in sorted(os.listdir(ckpt.dirpath)):
        print("  ", name)
    last = os.path.join(ckpt.dirpath, "last.ckpt")
    print(f"\n$ lightning-asyncckpt verify {last}", flush=True)
    cli.main(["verify", last])  # reads every shard back and checks it against the metadata and its CRC32


if __name__ == "__main__":
    main()
