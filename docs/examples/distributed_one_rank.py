"""The reduced form of docs/distributed.md's two examples: one CPU rank (gloo) instead of 8 GPUs, a few steps
of a tiny model. The strategies and their saves (every rank's share of a DDP state; FSDP2 shards as a DCP
directory) run as they do on many ranks; examples/train_sharded.py resumes one on 2 ranks."""

import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_asyncckpt import AsyncCheckpointIO, AsyncDDPStrategy, AsyncModelParallelStrategy


class MyModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 1))

    def configure_model(self):  # only AsyncModelParallelStrategy calls it with a device mesh
        if getattr(self, "_device_mesh", None) is None:
            return
        from torch.distributed.fsdp import fully_shard

        for layer in self.net:
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(128, 32), torch.randn(128, 1))
        return torch.utils.data.DataLoader(data, batch_size=16)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


# AsyncDDPStrategy: every rank writes a share (here the one rank writes it all)
trainer = L.Trainer(accelerator="cpu", devices=1, strategy=AsyncDDPStrategy(), plugins=[AsyncCheckpointIO("nvrx")],
                    max_steps=4, logger=False, enable_progress_bar=False,
                    callbacks=[ModelCheckpoint(dirpath="ddp", every_n_train_steps=2, save_last=True)])
trainer.fit(MyModel())
assert os.path.isfile(os.path.join("ddp", "last.ckpt", ".metadata"))  # a DCP directory, committed

# AsyncModelParallelStrategy: FSDP2 shards, saved in the background as the stock strategy's DCP directory
trainer = L.Trainer(
    accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False,
    strategy=AsyncModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
    callbacks=[ModelCheckpoint(dirpath="sharded", every_n_train_steps=2, save_top_k=2, monitor="step", mode="max")],
)
trainer.fit(MyModel())
assert sorted(os.listdir("sharded")) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
assert {".metadata", "meta.pt"} <= set(os.listdir(os.path.join("sharded", "epoch=0-step=4.ckpt")))
