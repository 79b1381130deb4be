"""The reduced form of docs/object-stores.md's example: the bucket is on an S3-protocol server on loopback
(moto's, in this process) instead of AWS; the credentials and endpoint come from the environment, as fsspec reads
them for stock Lightning too. Everything else is the page's code, with a tiny model and a few steps."""

import logging
import os
import socket

import boto3
from moto.server import ThreadedMotoServer

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's request log
server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
server.start()
os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="testing",
                  AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
boto3.client("s3").create_bucket(Bucket="bucket")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_asyncckpt import AsyncCheckpointIO  # noqa: E402


class MyModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(256, 32), torch.randn(256, 1))
        return torch.utils.data.DataLoader(data, batch_size=32)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make_trainer(max_steps):
    return L.Trainer(max_steps=max_steps, plugins=[AsyncCheckpointIO()], logger=False, enable_progress_bar=False,
                     callbacks=[ModelCheckpoint(dirpath="s3://bucket/run1", every_n_train_steps=2, save_last=True,
                                                save_top_k=2, monitor="step", mode="max")])


try:
    make_trainer(4).fit(MyModel())
    resumed = make_trainer(6)
    resumed.fit(MyModel(), ckpt_path="last")  # resumes from s3://bucket/run1/last.ckpt
    assert str(resumed.ckpt_path) == "s3://bucket/run1/last.ckpt", resumed.ckpt_path
    model = MyModel.load_from_checkpoint("s3://bucket/run1/last.ckpt")
    keys = sorted(o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="bucket")["Contents"])
    assert keys == ["run1/epoch=0-step=4.ckpt", "run1/epoch=0-step=6.ckpt", "run1/last.ckpt"], keys
finally:
    server.stop()
