"""``LightningCLI``: the plugin and the callback configured from YAML (``class_path`` / ``init_args``), as a
user of Lightning's CLI would, and a real fit that writes its checkpoints through the plugin."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset

from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback


class CliModel(LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=4)


CONFIG = """
trainer:
  max_steps: 4
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  accelerator: cpu
  plugins:
    - class_path: lightning_asyncckpt.AsyncCheckpointIO
      init_args:
        strategy: nvrx
        max_pending: 1
        timeout_s: 600
  callbacks:
    - class_path: lightning_asyncckpt.AsyncFinalizerCallback
      init_args:
        log_metrics: false
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {dirpath}
        every_n_train_steps: 2
        save_top_k: -1
"""


def test_plugin_and_callback_from_a_yaml_config(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(dirpath=tmp_path / "ckpt"))
    cli = LightningCLI(CliModel, args=["fit", "--config", str(config)], save_config_callback=None)
    io = cli.trainer.strategy.checkpoint_io
    assert isinstance(io, AsyncCheckpointIO) and (io.engine, io.settings.max_pending, io.settings.timeout_s) == ("nvrx", 1, 600.0)
    mine = [cb for cb in cli.trainer.callbacks if isinstance(cb, AsyncFinalizerCallback) and cb.log_metrics is False]
    assert len(mine) == 1
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert torch.load(tmp_path / "ckpt" / "epoch=0-step=4.ckpt", weights_only=False)["global_step"] == 4
    assert [r.step for r in io.history] == [2, 4]
