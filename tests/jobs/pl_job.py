"""The README's quick start, ``load_from_checkpoint`` and a DDP run with the standalone distribution
(``pip install pytorch-lightning``: ``pytorch_lightning`` and ``lightning_fabric``, no ``lightning``).

Runs in the environment ``make test`` builds for it (``.venv-pl``); imports nothing of the test helpers,
which import ``lightning``. Writes its ``reports.RankReport`` to ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

from reports import RankReport, run_reported


def main() -> None:
    run_reported(run, ["quickstart", "ddp", "async_ddp", "fabric", "local", "fabric_local"])


def run(args: argparse.Namespace, report: RankReport) -> None:
    report["lightning_importable"] = importlib.util.find_spec("lightning") is not None
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_asyncckpt import AsyncCheckpointIO, AsyncDDPStrategy, AsyncFinalizerCallback

    if args.case == "fabric":
        return fabric_case(args, report)
    if args.case == "fabric_local":
        return fabric_local_case(args, report)

    class Model(pl.LightningModule):
        def __init__(self, width: int = 8) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(width, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.log("progress", float(self.global_step + 1), sync_dist=True)  # top-k keeps the newest
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=4)
    ckpt_dir = os.path.join(args.out, "ckpt")

    def trainer(max_steps: int, **kw) -> pl.Trainer:
        return pl.Trainer(
            max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
            accelerator="cpu", plugins=[AsyncCheckpointIO(strategy="nvrx")],
            callbacks=[AsyncFinalizerCallback(), ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=2,
                                                                   monitor="progress", mode="max", save_last=True)],
            **kw,
        )

    if args.case == "local":
        return local_case(args, report, Model, data)
    model = Model()
    kw = {"ddp": dict(devices=2, strategy="ddp"), "async_ddp": dict(devices=2, strategy=AsyncDDPStrategy())}.get(args.case, {})
    fit = trainer(6, **kw)
    report["plugin"] = type(fit.strategy.checkpoint_io).__name__
    report["finalizers"] = sum(isinstance(cb, AsyncFinalizerCallback) for cb in fit.callbacks)
    fit.fit(model, data)
    report["files"] = sorted(os.listdir(ckpt_dir)) if fit.is_global_zero else None
    if not fit.is_global_zero:
        return
    last = os.path.join(ckpt_dir, "last.ckpt")
    if args.case == "async_ddp":  # every rank wrote a share of a DCP directory
        report["last_is_dir"] = os.path.isdir(last)
        raw = AsyncCheckpointIO().load_checkpoint(last, weights_only=False)
    else:
        raw = torch.load(last, weights_only=False)
    report["last_step"] = raw["global_step"]
    if args.case == "async_ddp":  # a DCP directory: Lightning's load_from_checkpoint reads files only
        weights = raw["state_dict"]
    else:
        loaded = Model.load_from_checkpoint(last)
        weights = loaded.state_dict()
        report["hparams"] = dict(loaded.hparams)
    report["loaded_equal"] = all(torch.equal(a, b) for a, b in zip(weights.values(), model.state_dict().values(), strict=True))
    if args.case == "quickstart":
        resumed = trainer(8)
        resumed.fit(Model(), data, ckpt_path="last")
        report["resumed_step"] = resumed.global_step
        report["files_after_resume"] = sorted(os.listdir(ckpt_dir))


def local_case(args: argparse.Namespace, report: RankReport, model_class: type, data) -> None:
    """The local tier under ``pytorch_lightning``: local saves every 2 steps, persistent ones every 8; after 10
    steps a new Trainer with ``ckpt_path="last"`` resumes at local step 10, bit for bit, not at 8."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback, LocalTier

    local, ckpt_dir = os.path.join(args.out, "local"), os.path.join(args.out, "ckpt")
    os.makedirs(local)
    saved, started = {}, {}

    class Record(pl.Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            saved[trainer.global_step] = {k: v.clone() for k, v in pl_module.state_dict().items()}

        def on_train_start(self, trainer, pl_module):
            started.update(step=trainer.global_step, state={k: v.clone() for k, v in pl_module.state_dict().items()})

    def trainer(max_steps: int) -> pl.Trainer:
        io = AsyncCheckpointIO(strategy="nvrx", local=LocalTier(local, every_n_train_steps=2, replication_factor=1))
        return pl.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                          accelerator="cpu", plugins=[io],
                          callbacks=[AsyncFinalizerCallback(), Record(),
                                     ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=8, save_last=True)])

    first = trainer(10)
    report["plugin"] = type(first.strategy.checkpoint_io).__name__
    report["finalizers"] = sum(isinstance(cb, AsyncFinalizerCallback) for cb in first.callbacks)
    first.fit(model_class(), data)
    again = trainer(11)
    again.fit(model_class(), data, ckpt_path="last")
    report["resumed_step"], report["ckpt_path"] = started["step"], str(again.ckpt_path)
    report["start_equal"] = all(torch_equal(started["state"][k], v) for k, v in saved[10].items())
    report["persistent"] = sorted(os.listdir(ckpt_dir))


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)


def fabric_case(args: argparse.Namespace, report: RankReport) -> None:
    """``lightning_fabric.Fabric`` with the plugin: save, finalize, load back exactly (one process)."""
    import torch
    from lightning_fabric import Fabric

    from lightning_asyncckpt import AsyncCheckpointIO

    io = AsyncCheckpointIO(strategy="nvrx")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    report["plugin"] = type(fabric.strategy.checkpoint_io).__name__
    report["finalizers"] = 1
    model = fabric.setup_module(torch.nn.Linear(4, 2))
    path = os.path.join(args.out, "fabric.ckpt")
    with io:
        fabric.save(path, {"model": model, "step": 7})
        io.finalize(blocking=True)
    other = fabric.setup_module(torch.nn.Linear(4, 2))
    state = {"model": other, "step": -1}
    fabric.load(path, state)
    report["loaded_equal"] = state["step"] == 7 and all(
        torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values(), strict=True))


def fabric_local_case(args: argparse.Namespace, report: RankReport) -> None:
    """``FabricTiers`` on ``lightning_fabric.Fabric``: local saves every 2 steps; a second loop resumes at step
    10 with its model and optimizer state exactly."""
    import torch
    from lightning_fabric import Fabric

    from lightning_asyncckpt import AsyncCheckpointIO, FabricTiers, LocalTier

    local = os.path.join(args.out, "local")
    os.makedirs(local)

    def loop(steps: int, resume: bool) -> dict:
        io = AsyncCheckpointIO(strategy="nvrx", local=LocalTier(local, every_n_train_steps=2, replication_factor=1,
                                                                emergency_signals=()))
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, optimizer = fabric.setup(model, optimizer)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        tiers = FabricTiers(fabric)
        with io:
            try:
                if resume:
                    report["resumed"] = tiers.resume(state)
                while state["step"] < steps:
                    optimizer.zero_grad()
                    fabric.backward(model(torch.randn(4, 8)).pow(2).mean())
                    optimizer.step()
                    state["step"] += 1
                    tiers.step_end(state["step"], state)
            finally:
                tiers.close()
        return {"step": state["step"], "model": {k: v.clone() for k, v in model.state_dict().items()},
                "moments": [t.clone() for s in optimizer.state_dict()["state"].values() for t in s.values()]}

    report["plugin"], report["finalizers"] = "AsyncCheckpointIO", 1  # Fabric has no callbacks
    saved = loop(10, resume=False)
    again = loop(0, resume=True)
    report["resumed_step"] = again["step"]
    report["start_equal"] = (all(torch.equal(saved["model"][k], v) for k, v in again["model"].items())
                             and all(torch.equal(a, b) for a, b in zip(saved["moments"], again["moments"], strict=True)))


if __name__ == "__main__":
    main()
