"""Setup run before the blocks marked `setup=docs/examples/setup_model.py`: a tiny LightningModule `MyModel`,
an instance `model`, and its data, so that a page's example shows only what it is about."""

import lightning as L
import torch


class MyModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(256, 32), torch.randn(256, 1))
        return torch.utils.data.DataLoader(data, batch_size=32)

    def val_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 1))
        return torch.utils.data.DataLoader(data, batch_size=32)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


model = MyModel()
