"""The reduced form of docs/tiers.md's examples: one node, one CPU rank, a few steps, instead of 8 nodes of 8
GPUs and an object store. Local saves every 2 steps (into /dev/shm where there is one), persistent ones every 4
on disk; then the testing helpers corrupt the newest local share, and the resume falls back to the persistent
tier, as the failure model says."""

import os
import shutil
import tempfile

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_asyncckpt import AsyncCheckpointIO, LocalTier
from lightning_asyncckpt.testing import local_tier


class MyModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(256, 32), torch.randn(256, 1))
        return torch.utils.data.DataLoader(data, batch_size=16)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


# a directory of our own (0700), as `mkdir -m 700 -p /dev/shm/ckpt` in a job script makes
node_dir = tempfile.mkdtemp(prefix="ckpt-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def fit(max_steps, ckpt_path=None):
    io = AsyncCheckpointIO(local=LocalTier(dir=node_dir, every_n_train_steps=2))
    ckpt = ModelCheckpoint(dirpath="persistent", every_n_train_steps=4, save_top_k=-1, save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, plugins=[io], callbacks=[ckpt],
                        logger=False, enable_progress_bar=False)
    trainer.fit(MyModel(), ckpt_path=ckpt_path)
    return trainer


try:
    fit(max_steps=6)  # local steps 2, 4, 6; persistent step 4
    newest = local_tier.held(node_dir)[0]
    assert (newest.step, newest.owner, newest.holder) == (6, 0, 0), newest
    local_tier.corrupt_share(node_dir, owner=0)  # one byte flipped in the only copy of step 6
    resumed = fit(max_steps=8, ckpt_path="last")  # step 6 fails its CRC32 check: the persistent tier, step 4
    assert os.path.basename(str(resumed.ckpt_path)) == "last.ckpt", resumed.ckpt_path
    assert resumed.global_step == 8
finally:
    shutil.rmtree(node_dir, ignore_errors=True)
