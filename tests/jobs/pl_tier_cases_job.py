"""The local tier under the standalone ``pytorch_lightning`` distribution, used in one line: ``plugins=
[AsyncCheckpointIO(local=LocalTier(...))]`` and no finalizer passed (the entry point adds it). Lost after
step 11 (mid-epoch), the next Trainer resumes with ``ckpt_path="last"`` from local step 10; compared with an
uninterrupted run and with stock's resume from ``ModelCheckpoint(every_n_train_steps=2)``'s file.

Runs in ``.venv-pl`` (``tests/test_tiers_trainer_cases.py``); imports nothing of the test helpers, which import
``lightning``. Writes its ``reports.RankReport`` to ``<out>/rank0.json``.
"""

from __future__ import annotations

import importlib.util
import os

from reports import RankReport, run_reported


def main() -> None:
    run_reported(lambda args, report: run(args.out, report))


def run(out: str, report: RankReport) -> None:
    report["lightning_importable"] = importlib.util.find_spec("lightning") is not None
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback, LocalTier

    batches = 8

    class Model(pl.LightningModule):
        """Input by batch index (Lightning restarts a non-resumable loader at the epoch's start on a mid-epoch
        resume and carries the batch index on): stock's mid-epoch resume is exact with it."""

        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
            self.table = torch.randn(batches, 4, 8, generator=torch.Generator().manual_seed(1))

        def training_step(self, batch, batch_idx):
            return self.net(self.table[batch_idx]).pow(2).mean()

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Stop(pl.Callback):
        def on_train_batch_start(self, trainer, *a):
            if trainer.global_step == 11:
                raise RuntimeError("lost after step 11")

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.saves, self.start = [], None

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            self.saves.append(trainer.global_step)

        def on_train_start(self, trainer, pl_module):
            self.start = state(trainer)

    def state(trainer) -> dict:
        loop = trainer.fit_loop.epoch_loop
        return {"model": {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()},
                "optimizer": [t.clone() for s in trainer.optimizers[0].state_dict()["state"].values() for t in s.values()],
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "progress": (trainer.global_step, trainer.current_epoch, loop.batch_progress.state_dict(),
                             loop._batches_that_stepped)}

    def equal(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and list(a) == list(b) and all(equal(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
        return a == b

    def fit(name: str, local: bool, stop: bool = False, ckpt_path=None):
        root = os.path.join(out, name)
        os.makedirs(os.path.join(root, "local"), exist_ok=True)
        plugins = [AsyncCheckpointIO(local=LocalTier(os.path.join(root, "local"), every_n_train_steps=2,
                                                     replication_factor=1))] if local else []
        record = Record()
        callbacks = [record, *([Stop()] if stop else [])]
        if not local:  # stock: its ModelCheckpoint saves where the local tier would
            callbacks.append(ModelCheckpoint(dirpath=os.path.join(root, "c"), every_n_train_steps=2, save_top_k=-1,
                                             save_last=True))
        trainer = pl.Trainer(max_steps=20, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             accelerator="cpu", devices=1, plugins=plugins, callbacks=callbacks,
                             enable_checkpointing=not local, default_root_dir=root, num_sanity_val_steps=0)
        data = DataLoader(TensorDataset(torch.randn(4 * batches, 8)), batch_size=4)
        pl.seed_everything(0)
        try:
            trainer.fit(Model(), data, ckpt_path=ckpt_path)
        except RuntimeError as e:
            if not (stop and "lost after step 11" in str(e)):
                raise
        return trainer, record

    reference, _ = fit("u", local=False)
    first, first_record = fit("ours", local=True, stop=True)
    report["plugin"] = type(first.strategy.checkpoint_io).__name__
    report["finalizers"] = sum(isinstance(cb, AsyncFinalizerCallback) for cb in first.callbacks)
    report["local_saves"] = first_record.saves
    again, record = fit("ours", local=True, ckpt_path="last")
    report["resumed_step"], report["ckpt_path"] = record.start["progress"][0], str(again.ckpt_path)
    fit("stock", local=False, stop=True)
    stock, stock_record = fit("stock", local=False, ckpt_path="last")
    report["start_equal_stock"] = equal(record.start, stock_record.start)
    report["final_equal"] = equal(state(again), state(reference))
    report["stock_final_equal"] = equal(state(stock), state(reference))


if __name__ == "__main__":
    main()
