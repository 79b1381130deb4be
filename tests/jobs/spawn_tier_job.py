"""The local tier under ``strategy="ddp_spawn"`` (2 CPU ranks): Lightning pickles the trainer, its plugin and
callbacks into processes it spawns, where nothing of this package's ``__init__`` runs again. A first fit saves
locally every 2 steps (to step 4) and persistently at step 3; a second fit with ``ckpt_path="last"`` must
resume from local step 4, the newer. Each rank of each fit writes a ``reports.RankReport`` to
``<out>/start-<fit>-rank<r>.json``. Imports
nothing of the test helpers (they import ``lightning``)."""

from __future__ import annotations

import os
import sys

try:  # either distribution: this runs in .venv and in .venv-pl (pytorch_lightning alone)
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
except ImportError:
    import pytorch_lightning as L
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.demos.boring_classes import BoringModel

from lightning_asyncckpt import AsyncCheckpointIO, LocalTier
from reports import RankReport, report_path


class Start(L.Callback):
    def __init__(self, out: str, fit: int) -> None:
        self.out, self.fit = out, fit

    def on_train_start(self, trainer, pl_module) -> None:
        rank = trainer.global_rank
        seen = {"step": trainer.global_step, "ckpt_path": str(trainer.ckpt_path)}
        RankReport(rank=rank, seen=seen).write(report_path(self.out, rank, f"start-{self.fit}-rank"))


def fit(out: str, n: int, max_steps: int, ckpt_path: str | None = None) -> None:
    io = AsyncCheckpointIO(local=LocalTier(os.path.join(out, "local"), every_n_train_steps=2, replication_factor=1,
                                           timeout_s=60))
    ck = ModelCheckpoint(dirpath=os.path.join(out, "c"), every_n_train_steps=3, save_last=True)
    t = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", plugins=[io], callbacks=[Start(out, n), ck],
                  max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=out)
    t.fit(BoringModel(), ckpt_path=ckpt_path)


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(os.path.join(out, "local"), exist_ok=True)
    fit(out, 1, 4)  # local steps 2 and 4, persistent (and last.ckpt) at 3
    fit(out, 2, 5, ckpt_path="last")
