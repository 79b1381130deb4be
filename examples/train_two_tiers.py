"""Two tiers on one machine: frequent local checkpoints in memory, rare persistent ones on disk, a preemption,
and the resume from the newest complete tier.

    python examples/train_two_tiers.py [--local-dir /dev/shm] [--local-every 5] [--every 20] [--preempt-at 33]

1. Trains with ``AsyncCheckpointIO(local=LocalTier(...))``: a local save every ``--local-every`` steps into
   ``--local-dir`` (``/dev/shm``: RAM), and a persistent one every ``--every`` steps (``ModelCheckpoint``).
2. At step ``--preempt-at`` the job sends itself SIGTERM, as a scheduler does before it preempts a job. The
   handler only sets a flag; at that step's boundary the tier saves the step locally, drains the persistent
   saves and stops training.
3. A new Trainer resumes with ``ckpt_path="last"``: from the local step, newer than the persistent one.
4. Lists what this node holds (``lightning-asyncckpt local``), then removes it (``--remove --yes``): files
   in ``/dev/shm`` are memory, and they outlive the job on purpose, for the next launch.

``replication_factor`` keeps its default: on one machine that is 1 (no other node could hold a replica),
and the same script on several nodes gets 2: each share then has a copy on another node, and a node that
comes back empty is refilled from it (docs/tiers.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_asyncckpt import AsyncCheckpointIO, LocalTier
from lightning_asyncckpt.tools import cli


class MLP(L.LightningModule):
    def __init__(self, width: int = 256):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class PreemptAt(L.Callback):
    """Sends this process SIGTERM after ``step``, once, as a scheduler's preemption notice would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def data(width: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, width, generator=g)
    return DataLoader(TensorDataset(x, x[:, :4].sum(-1)), batch_size=32)


def fit(args: argparse.Namespace, local_dir: str, max_steps: int, callbacks: list, ckpt_path: str | None) -> L.Trainer:
    io = AsyncCheckpointIO(local=LocalTier(local_dir, every_n_train_steps=args.local_every))
    persistent = ModelCheckpoint(dirpath=os.path.join(args.out, "checkpoints"), every_n_train_steps=args.every,
                                 save_top_k=-1, save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=args.out, plugins=[io],
                        callbacks=[persistent, *callbacks])
    trainer.fit(MLP(args.width), data(args.width), ckpt_path=ckpt_path)
    return trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                   help="node-local storage; the tier writes under <dir>/asyncckpt-local/<session>/")
    p.add_argument("--local-every", type=int, default=5)
    p.add_argument("--every", type=int, default=20, help="a persistent save every N steps")
    p.add_argument("--preempt-at", type=int, default=33)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--out", default="two_tiers_output")
    args = p.parse_args()

    shutil.rmtree(args.out, ignore_errors=True)
    # this run's own directory under --local-dir, so that the example removes nothing else
    local_dir = tempfile.mkdtemp(prefix="two-tiers-", dir=args.local_dir)
    try:
        L.seed_everything(0)
        first = fit(args, local_dir, args.max_steps, [PreemptAt(args.preempt_at)], ckpt_path=None)
        print(f"\npreempted: training stopped at step {first.global_step}; persistent checkpoints:"
              f" {sorted(os.listdir(os.path.join(args.out, 'checkpoints')))}")
        again = fit(args, local_dir, first.global_step + args.local_every, [], ckpt_path="last")
        print(f"resumed from {os.path.basename(str(again.ckpt_path))}, now at step {again.global_step}\n")
        print(f"$ lightning-asyncckpt local {local_dir} --verify", flush=True)
        cli.main(["local", local_dir, "--verify"])
        print(f"$ lightning-asyncckpt local {local_dir} --remove --yes", flush=True)
        cli.main(["local", local_dir, "--remove", "--yes"])
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
