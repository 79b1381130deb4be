"""The reduced form of docs/fabric.md's DDP loop: one CPU device instead of 8 GPUs (the same code as
docs/getting-started.md's Fabric quick start)."""

import lightning as L
import torch

from lightning_asyncckpt import AsyncCheckpointIO

io = AsyncCheckpointIO()
fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])   # or strategy="ddp", devices=8
fabric.launch()
model = torch.nn.Linear(32, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = fabric.setup(model, optimizer)
state = {"model": model, "optimizer": optimizer, "step": 0}

with io:  # on leaving: every save committed (or its error raised), the writers stopped
    for step in range(1, 31):
        loss = model(torch.randn(8, 32)).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0:
            state["step"] = step
            last_saved = f"checkpoints/step-{step}.ckpt"
            fabric.save(last_saved, state)  # returns once the state is copied
        for record in io.finalize():  # every rank, in the same order: commits finished saves, raises failures
            fabric.log_dict(record.metrics(), step=step)

fabric.load(last_saved, state)  # restores the model and optimizer in place
assert state["step"] == 30
