"""Fabric with asynchronous checkpoints, on 2 CPU ranks (DDP over gloo).

`fabric.save` returns once the state is snapshotted; `io.finalize()`, called on every rank, commits
finished saves and raises a failed write on every rank. Fabric never tears its plugins down, so the
loop runs inside `with io:`, which commits the last save (or stops the worker on an error) on exit.

    python examples/train_fabric.py [--engine nvrx|mcore] [--steps 200]
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch

from lightning_asyncckpt import AsyncCheckpointIO


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", default="nvrx")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--out", default="demo_output/fabric")
    args = p.parse_args()

    io = AsyncCheckpointIO(args.engine)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[io])
    fabric.launch()
    fabric.seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}

    with io:  # on exit: every save committed, workers stopped
        for step in range(1, args.steps + 1):
            x = torch.randn(32, 256)
            loss = (model(x).squeeze(-1) - x[:, 0]).pow(2).mean()
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            if step % args.every == 0:
                state["step"] = step
                fabric.save(os.path.join(args.out, f"step-{step}"), state)
            io.finalize()  # all ranks: one tiny all_reduce; raises CheckpointWriteError everywhere on failure

    # Resume: `fabric.load` waits for pending saves of this rank first, then restores in place.
    state["step"] = -1
    fabric.load(os.path.join(args.out, f"step-{args.steps}"), state)
    fabric.print(f"restored step {state['step']}; checkpoints: {sorted(os.listdir(args.out))}")


if __name__ == "__main__":
    main()
