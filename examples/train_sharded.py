"""FSDP2 (``fully_shard``) with asynchronous sharded checkpoints, on 2 CPU ranks (gloo).

Every rank snapshots its own shards and returns to training; its background worker writes them. The
checkpoint directory has the layout of Lightning's ``ModelParallelStrategy`` (one shard file per rank,
``.metadata``, ``meta.pt``), so stock Lightning resumes from it and ``torch.distributed.checkpoint``
reads it. The second ``fit`` resumes from the last checkpoint.

    python examples/train_sharded.py [--engine nvrx|mcore] [--steps 60]
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_asyncckpt import AsyncCheckpointIO, AsyncModelParallelStrategy


class Model(L.LightningModule):
    def __init__(self, width: int = 512, layers: int = 4):
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return (self.net(x) - x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", default="nvrx")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default="demo_output/sharded")
    args = p.parse_args()

    data = DataLoader(TensorDataset(torch.randn(512, 512, generator=torch.Generator().manual_seed(0))), batch_size=16)
    ckpt = ModelCheckpoint(dirpath=args.out, every_n_train_steps=20, save_top_k=2, monitor="step", mode="max",
                           save_last=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=args.steps, logger=False, enable_progress_bar=False,
        strategy=AsyncModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        plugins=[AsyncCheckpointIO(args.engine)], callbacks=[ckpt],
    )
    trainer.fit(Model(), data)
    io = trainer.strategy.checkpoint_io
    if trainer.is_global_zero:
        stalls = sorted(r.stall_s for r in io.history)
        print(f"{len(io.history)} sharded saves; median stall {stalls[len(stalls) // 2]:.4f} s per rank")
        last = os.path.join(args.out, "last.ckpt")
        print(f"{last}: {sorted(os.listdir(last))}")

    # resume from the last checkpoint (any number of ranks could; here the same two)
    resumed = L.Trainer(
        accelerator="cpu", devices=2, max_steps=args.steps + 20, logger=False, enable_progress_bar=False,
        strategy=AsyncModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        plugins=[AsyncCheckpointIO(args.engine)], enable_checkpointing=False,
    )
    resumed.fit(Model(), data, ckpt_path=os.path.join(args.out, "last.ckpt"))
    if resumed.is_global_zero:
        print(f"resumed from step {args.steps}, now at step {resumed.global_step}")


if __name__ == "__main__":
    main()
