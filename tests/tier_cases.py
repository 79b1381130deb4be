"""Helpers of the local tier's audit against stock Lightning (``test_tiers_trainer_cases.py``,
``test_tiers_checkpoint_callbacks.py``): a model that reads its input by batch index, a resumable loader,
callbacks that stop, record and count, and ``fit`` run three ways (stock, with the local tier, uninterrupted)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from helpers import TinyModel, assert_tree_equal, clone_tree, loader, trainer
from lightning_asyncckpt import AsyncCheckpointIO, LocalTier

BATCHES = 8  # per epoch


class IndexedModel(TinyModel):
    """``TinyModel`` (Adam) whose training input is row ``batch_idx`` of a fixed table; ``scheduler``: a StepLR
    stepped every optimizer step (``interval="step"``). Logs ``newest`` (the global step) for top-k."""

    def __init__(self, scheduler: bool = False) -> None:
        super().__init__(width=8, layers=2, lr=1e-2)
        self.scheduler = scheduler
        self.table = torch.randn(BATCHES, 4, 8, generator=torch.Generator().manual_seed(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("newest", float(self.global_step))
        return self.net(self.table[batch_idx]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        opt = super().configure_optimizers()
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ResumableLoader(DataLoader):
    """A loader Lightning treats as resumable (``state_dict``/``load_state_dict``): its state is the batches
    fetched so far; the state it is given back is kept in ``loaded`` (the data stays chosen by index)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.fetched, self.loaded = 0, None

    def __iter__(self):
        for batch in super().__iter__():
            self.fetched += 1
            yield batch

    def state_dict(self) -> dict:
        return {"fetched": self.fetched}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = dict(state)


def indexed_data(resumable: bool = False) -> DataLoader:
    plain = loader(width=8, n=4 * BATCHES, batch_size=4)
    return ResumableLoader(plain.dataset, batch_size=4) if resumable else plain


class Stop(L.Callback):
    """Raises at the start of the batch after global step ``step`` (its saves made): the process is lost there."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *a):
        if trainer.global_step == self.step:
            raise RuntimeError(f"lost after step {self.step}")


class Record(L.Callback):
    """``saves``: ``(global_step, batches of the epoch)`` of every checkpoint built (a local save's too);
    ``start``: where training started, and the state it started with; ``checkpoint_state``: ModelCheckpoint's then."""

    def __init__(self) -> None:
        self.saves: list[tuple[int, int]] = []
        self.start: dict | None = None
        self.checkpoint_state: dict | None = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.saves.append((trainer.global_step, trainer.fit_loop.epoch_loop.batch_progress.current.ready))

    def on_train_start(self, trainer, pl_module):
        self.start = state(trainer)
        self.checkpoint_state = checkpoint_state(trainer.checkpoint_callback)


class Counter(L.Callback):
    """A stateful callback of the user's: counts the training batches it has seen."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *a):
        self.batches += 1

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches = state["batches"]


def checkpoint_state(ck: ModelCheckpoint | None) -> dict | None:
    """``ModelCheckpoint``'s state that decides which files it keeps, with file names in place of paths."""
    if ck is None:
        return None
    name = lambda p: os.path.basename(p) if p else p  # noqa: E731
    return {"best_k_models": {name(k): float(v) for k, v in ck.best_k_models.items()},
            "best_model_path": name(ck.best_model_path), "kth_best_model_path": name(ck.kth_best_model_path),
            "last_model_path": name(ck.last_model_path)}


def state(t: L.Trainer) -> dict:
    """What an uninterrupted run and a resumed one must agree on, bit for bit."""
    loop = t.fit_loop.epoch_loop
    return clone_tree({
        "model": t.lightning_module.state_dict(),
        "optimizer": t.optimizers[0].state_dict(),
        "lr": [g["lr"] for g in t.optimizers[0].param_groups],
        "schedulers": [c.scheduler.state_dict() for c in t.lr_scheduler_configs],
        "global_step": t.global_step, "epoch": t.current_epoch,
        "batch_progress": loop.batch_progress.state_dict(), "batches_that_stepped": loop._batches_that_stepped,
        "optimizer_progress": loop.automatic_optimization.optim_progress.state_dict(),
    })


class Run:
    def __init__(self, t: L.Trainer, record: Record, checkpoint: ModelCheckpoint | None, data: DataLoader) -> None:
        self.trainer, self.record, self.checkpoint, self.data = t, record, checkpoint, data
        self.final = state(t) if t.global_step else None


def fit(root: Path, *, local: bool, max_steps: int, ckpt_path: Any = None, stop: int | None = None,
         local_every: int = 2, checkpoint: dict | None = None, scheduler: bool = False, resumable: bool = False,
         callbacks: tuple = (), **trainer_kw: Any) -> Run:
    """One ``fit`` in ``root``: ``local``, with the local tier (``root/local``, one copy) every ``local_every``
    steps; ``checkpoint``: a ``ModelCheckpoint(dirpath=root/"c", **checkpoint)`` (None: no persistent saves);
    ``stop``: lost once global step ``stop`` is done, before the next batch (the error is caught here)."""
    root.mkdir(parents=True, exist_ok=True)
    plugins = []
    if local:
        (root / "local").mkdir(exist_ok=True)
        plugins.append(AsyncCheckpointIO("nvrx", local=LocalTier(root / "local", every_n_train_steps=local_every,
                                                                 replication_factor=1)))
    record = Record()
    ck = ModelCheckpoint(dirpath=root / "c", **checkpoint) if checkpoint is not None else None
    cbs = [*callbacks, record, *([Stop(stop)] if stop is not None else []), *([ck] if ck else [])]
    t = trainer(root, plugins, cbs, max_steps=max_steps, enable_checkpointing=ck is not None, **trainer_kw)
    data = indexed_data(resumable)
    L.seed_everything(0)
    if stop is None:
        t.fit(IndexedModel(scheduler), data, ckpt_path=ckpt_path)
    else:
        with pytest.raises(RuntimeError, match=f"lost after step {stop}"):
            t.fit(IndexedModel(scheduler), data, ckpt_path=ckpt_path)
    return Run(t, record, ck, data)


def equal(a: Any, b: Any) -> bool:
    try:
        assert_tree_equal(a, b)
    except AssertionError:
        return False
    return True


def listing(directory: Path) -> list[str]:
    """The files of a checkpoint directory, a symlink with its target."""
    return sorted(p.name + (f" -> {os.readlink(p)}" if p.is_symlink() else "") for p in directory.iterdir())


def restored_from_local(run: Run, step: int) -> None:
    assert str(run.trainer.ckpt_path).endswith(f"restore-step-{step}"), run.trainer.ckpt_path
    assert run.record.start["global_step"] == step
