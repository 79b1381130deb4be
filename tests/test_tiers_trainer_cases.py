"""The local tier as a drop-in with the Trainer, audited against stock Lightning (single process, CPU).

Each case runs the same training three ways, with real Trainers and real files: stock Lightning (no plugin;
its ``ModelCheckpoint`` saves), with ``AsyncCheckpointIO(local=LocalTier(...))``, and uninterrupted. A run is
"interrupted" by an exception raised in a callback once some step is done (a lost process); the next Trainer
resumes with ``fit(ckpt_path="last")``. With the local tier everything the user sees is to be as stock:
the steps saved, the final weights, optimizer and scheduler state, progress counters, callback states and
the files in ``ModelCheckpoint``'s directory.

The model reads its input as row ``batch_idx`` of a fixed table: Lightning restarts a loader that is not
resumable from the first batch of the epoch on a mid-epoch resume, but carries the batch index on, so with
the data chosen by index stock's own mid-epoch resume is exact (checked here first, as the baseline).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from test_distributions import PL_PYTHON
from torch.utils.data import DataLoader

from helpers import TinyModel, assert_tree_equal, clone_tree, loader, trainer
from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback, LocalTier
from processes import job_script, launch

pytestmark = pytest.mark.timeout(120)

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


def _data(resumable: bool = False) -> DataLoader:
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
        self.start = _state(trainer)
        self.checkpoint_state = _checkpoint_state(trainer.checkpoint_callback)


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


def _checkpoint_state(ck: ModelCheckpoint | None) -> dict | None:
    """``ModelCheckpoint``'s state that decides which files it keeps, with file names in place of paths."""
    if ck is None:
        return None
    name = lambda p: os.path.basename(p) if p else p  # noqa: E731
    return {"best_k_models": {name(k): float(v) for k, v in ck.best_k_models.items()},
            "best_model_path": name(ck.best_model_path), "kth_best_model_path": name(ck.kth_best_model_path),
            "last_model_path": name(ck.last_model_path)}


def _state(t: L.Trainer) -> dict:
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
        self.final = _state(t) if t.global_step else None


def _fit(root: Path, *, local: bool, max_steps: int, ckpt_path: Any = None, stop: int | None = None,
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
    data = _data(resumable)
    L.seed_everything(0)
    if stop is None:
        t.fit(IndexedModel(scheduler), data, ckpt_path=ckpt_path)
    else:
        with pytest.raises(RuntimeError, match=f"lost after step {stop}"):
            t.fit(IndexedModel(scheduler), data, ckpt_path=ckpt_path)
    return Run(t, record, ck, data)


def _equal(a: Any, b: Any) -> bool:
    try:
        assert_tree_equal(a, b)
    except AssertionError:
        return False
    return True


def _listing(directory: Path) -> list[str]:
    """The files of a checkpoint directory, a symlink with its target."""
    return sorted(p.name + (f" -> {os.readlink(p)}" if p.is_symlink() else "") for p in directory.iterdir())


def _restored_from_local(run: Run, step: int) -> None:
    assert str(run.trainer.ckpt_path).endswith(f"restore-step-{step}"), run.trainer.ckpt_path
    assert run.record.start["global_step"] == step


# 1. accumulate_grad_batches=3 with every_n_train_steps=2 ------------------------------------------------------

def test_accumulation_local_saves_where_stock_modelcheckpoint_saves_and_resumes_exactly(tmp_path):
    """8 batches an epoch, 3 per step. Uninterrupted, the local tier saves at the same (global step, batch)
    points as stock ``ModelCheckpoint(every_n_train_steps=2)``: right after the optimizer step that reaches the
    step, each step once. Lost after step 5, the run resumes from local step 4 (epoch 1, batch 3: an
    accumulation boundary) and ends bit for bit as the uninterrupted one, and as stock's resume from its step-4
    file.

    After either resume the first batch (mid-accumulation, still global step 4) saves step 4 again: stock's
    ``ModelCheckpoint`` does so (its ``_last_global_step_saved`` is not restored), and the local tier does the
    same, at the same batch."""
    every = dict(every_n_train_steps=2, save_top_k=-1)
    kw = dict(max_steps=8, accumulate_grad_batches=3)
    stock = _fit(tmp_path / "stock-u", local=False, checkpoint=every, **kw)
    ours = _fit(tmp_path / "ours-u", local=True, **kw)  # no persistent saves: every checkpoint built is local
    assert stock.record.saves == [(2, 6), (4, 3), (6, 8), (8, 6)]
    assert ours.record.saves == stock.record.saves
    assert_tree_equal(ours.final, stock.final, "uninterrupted, local tier against stock")

    _fit(tmp_path / "stock-i", local=False, checkpoint=every, stop=5, **kw)
    stock_again = _fit(tmp_path / "stock-i", local=False, checkpoint=every,
                       ckpt_path=tmp_path / "stock-i" / "c" / "epoch=1-step=4.ckpt", **kw)
    _fit(tmp_path / "ours-i", local=True, stop=5, **kw)
    again = _fit(tmp_path / "ours-i", local=True, ckpt_path="last", **kw)
    _restored_from_local(again, 4)
    assert stock_again.record.start["batch_progress"]["current"]["ready"] == 3
    assert_tree_equal(again.record.start, stock_again.record.start, "started from local step 4, against stock's file")
    assert stock_again.record.saves == [(4, 4), (6, 8), (8, 6)]  # stock saves step 4 again, mid-accumulation
    assert again.record.saves == stock_again.record.saves
    assert_tree_equal(stock_again.final, stock.final, "stock: resumed against uninterrupted")
    assert_tree_equal(again.final, stock.final, "resumed from local step 4 against uninterrupted")


def test_accumulation_a_second_loss_after_the_mid_accumulation_resave_ends_as_stock(tmp_path):
    """Lost after step 3 (the epoch's end), resumed from step 2 (batch 6); that run saves step 2 again at batch 7
    (mid-accumulation, as stock) and is lost after step 3 again; the third run resumes from that save. Stock then
    ends with other weights than an uninterrupted run (the re-save does not hold batch 7's gradients, which the
    resumed run never sees again: a stock Lightning quirk); with the local tier the run ends exactly as stock's,
    quirk included."""
    every = dict(every_n_train_steps=2, save_top_k=-1)
    kw = dict(max_steps=6, accumulate_grad_batches=3)
    uninterrupted = _fit(tmp_path / "u", local=False, **kw)
    finals = {}
    for name, local in (("stock", False), ("ours", True)):
        ck = None if local else every
        path = "last" if local else tmp_path / name / "c" / "epoch=0-step=2.ckpt"
        _fit(tmp_path / name, local=local, checkpoint=ck, stop=3, **kw)
        second = _fit(tmp_path / name, local=local, checkpoint=ck, stop=3, ckpt_path=path, **kw)
        assert second.record.saves == [(2, 7)]
        third = _fit(tmp_path / name, local=local, checkpoint=ck, ckpt_path=path, **kw)
        assert third.record.start["global_step"] == 2
        assert third.record.start["batch_progress"]["current"]["ready"] == 7
        finals[name] = third.final
    with pytest.raises(AssertionError, match="tensor values differ"):  # stock's quirk
        assert_tree_equal(finals["stock"], uninterrupted.final, "stock, twice lost")
    if not _equal(finals["ours"], uninterrupted.final):  # better than stock would do too
        assert_tree_equal(finals["ours"], finals["stock"], "twice lost, local tier against stock")


class SignalAtBatch(L.Callback):
    """Sends this process SIGTERM at the end of training batch ``batch`` (counted over the run, from 1)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(self, trainer, *a):
        if trainer.fit_loop.epoch_loop.batch_progress.total.ready == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)


def test_accumulation_a_preemption_mid_accumulation_resumes_as_stocks_save_on_exception(tmp_path):
    """SIGTERM at batch 9 (epoch 1's first batch: global step 3, mid-accumulation). The local tier saves step 3
    there, at that batch, and stops; stock with ``ModelCheckpoint(save_on_exception=True)`` saves at the same
    point (stock's default saves nothing then). A resume from either drops batch 9's gradients, so both end
    with other weights than an uninterrupted run, and the same ones. (Where the local tier's last save is the
    step already, as at batch 7, it stops without a new save and the resume is exact.)"""
    kw = dict(max_steps=6, accumulate_grad_batches=3)
    uninterrupted = _fit(tmp_path / "u", local=False, **kw)
    first = _fit(tmp_path / "ours", local=True, callbacks=(SignalAtBatch(9),), **kw)
    assert first.trainer.global_step == 3 and first.record.saves == [(2, 6), (3, 1)]
    ours = _fit(tmp_path / "ours", local=True, ckpt_path="last", **kw)
    _restored_from_local(ours, 3)
    ck = dict(every_n_train_steps=2, save_top_k=-1, save_on_exception=True)
    with pytest.raises(SIGTERMException):
        _fit(tmp_path / "stock", local=False, checkpoint=ck, callbacks=(SignalAtBatch(9),), **kw)
    stock = _fit(tmp_path / "stock", local=False, checkpoint=ck, ckpt_path=tmp_path / "stock" / "c" / "epoch=1-step=3.ckpt",
                 **kw)
    assert stock.record.start["batch_progress"]["current"]["ready"] == 1
    with pytest.raises(AssertionError, match="tensor values differ"):
        assert_tree_equal(stock.final, uninterrupted.final, "stock, resumed from its save on the exception")
    if not _equal(ours.final, uninterrupted.final):  # better than stock would do too
        assert_tree_equal(ours.final, stock.final, "resumed from the emergency save, against stock's")


# 2. an LR scheduler stepped every step, mid-epoch resume -------------------------------------------------------

def test_step_lr_scheduler_mid_epoch_resume_from_a_local_step_matches_stock_and_uninterrupted(tmp_path):
    """StepLR (``interval="step"``), Adam, a resumable loader. Stock: ``ModelCheckpoint(every_n_train_steps=2)``,
    lost after step 11, resumes from its step-10 file (epoch 1, batch 2). Ours: local every 2 steps, persistent
    every 4 (step 8): resumes from local step 10. Same start (weights, moments, LR, scheduler, progress, the
    loader's state) and same end after 20 steps as stock's resume and as the uninterrupted run."""
    kw = dict(max_steps=20, scheduler=True, resumable=True)
    reference = _fit(tmp_path / "u", local=False, **kw)
    stock_ck = dict(every_n_train_steps=2, save_top_k=-1, save_last=True)
    ours_ck = dict(every_n_train_steps=4, save_top_k=-1, save_last=True)
    _fit(tmp_path / "stock", local=False, checkpoint=stock_ck, stop=11, **kw)
    stock = _fit(tmp_path / "stock", local=False, checkpoint=stock_ck, ckpt_path="last", **kw)
    _fit(tmp_path / "ours", local=True, checkpoint=ours_ck, stop=11, **kw)
    ours = _fit(tmp_path / "ours", local=True, checkpoint=ours_ck, ckpt_path="last", **kw)
    assert str(stock.trainer.ckpt_path).endswith("last.ckpt") and stock.record.start["global_step"] == 10
    assert stock.record.start["epoch"] == 1 and stock.record.start["batch_progress"]["current"]["ready"] == 2
    _restored_from_local(ours, 10)
    assert_tree_equal(ours.record.start, stock.record.start, "start: local step 10 against stock's step-10 file")
    assert stock.data.loaded is not None and ours.data.loaded == stock.data.loaded  # the loader's state
    assert reference.final["lr"] == [1e-2 * 0.5 ** (20 // 3)]
    assert_tree_equal(stock.final, reference.final, "stock: resumed against uninterrupted")
    assert_tree_equal(ours.final, reference.final, "resumed from local step 10 against uninterrupted")


# 3. validate / test with ckpt_path="last" after fit -----------------------------------------------------------

class Loaded(L.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self.steps.append(checkpoint["global_step"])


def test_validate_and_test_with_last_after_fit_load_the_persistent_last_ckpt_as_stock(tmp_path):
    """After ``fit`` (local steps up to 10, persistent ``last.ckpt`` at 8), ``validate(ckpt_path="last")`` and
    ``test(ckpt_path="last")``, on the same Trainer and on a new one, load what stock loads: the newest
    ``last.ckpt`` of ``ModelCheckpoint`` (step 8), not the newer local step; with the same results."""
    results = {}
    for name, local in (("stock", False), ("ours", True)):
        loaded = Loaded()
        ck = dict(every_n_train_steps=4, save_top_k=-1, save_last=True)
        run = _fit(tmp_path / name, local=local, checkpoint=ck, max_steps=10, callbacks=(loaded,))
        t = run.trainer
        got = [t.validate(ckpt_path="last", dataloaders=_data(), verbose=False), str(t.ckpt_path)]
        got += [t.test(ckpt_path="last", dataloaders=_data(), verbose=False), str(t.ckpt_path)]
        tier = LocalTier(tmp_path / name / "local", every_n_train_steps=2, replication_factor=1)
        fresh = trainer(tmp_path / name, [AsyncCheckpointIO("nvrx", local=tier)] if local else [],
                        [loaded, ModelCheckpoint(dirpath=tmp_path / name / "c", **ck)])
        got += [fresh.validate(IndexedModel(), ckpt_path="last", dataloaders=_data(), verbose=False),
                str(fresh.ckpt_path)]
        results[name] = (got, loaded.steps)
        if local:
            assert (tmp_path / name / "local" / "asyncckpt-local" / "default" / "holder-0" /
                    "step-0000000010.owner-0.json").is_file()
    (stock, stock_steps), (ours, our_steps) = results["stock"], results["ours"]
    assert stock_steps == [8, 8, 8] and stock[1].endswith("stock/c/last.ckpt")
    assert our_steps == stock_steps
    assert [str(p).replace("/ours/", "/stock/") if isinstance(p, str) else p for p in ours] == stock


def test_after_a_resume_from_a_local_step_loading_trainer_ckpt_path_again_says_what_to_load_instead(tmp_path):
    """Stock: ``trainer.ckpt_path`` is the file ``fit`` resumed from, and ``validate(ckpt_path=trainer.ckpt_path)``
    loads it. A local step is no file (shares in node-local files, read by every rank together at the
    resume): its name is kept there, and loading it again fails with an error that says what it is and what
    to load instead, not Lightning's bare "not found" (a documented difference)."""
    _fit(tmp_path, local=True, max_steps=6)
    run = _fit(tmp_path, local=True, max_steps=8, ckpt_path="last")
    _restored_from_local(run, 6)
    with pytest.raises(FileNotFoundError, match=r"restore-step-6 names step 6 of the local tier.*ckpt_path='last'"):
        run.trainer.validate(ckpt_path=run.trainer.ckpt_path, dataloaders=_data(), verbose=False)


# 4. max_steps ending at a local save step, then fit again with a higher max_steps ---------------------------

@pytest.mark.parametrize("first_max_steps", [10, BATCHES], ids=["mid-epoch", "epoch-end"])
def test_max_steps_ending_at_a_local_save_then_fit_again_further(tmp_path, first_max_steps):
    """``max_steps`` at a local save step (10: mid-epoch; 8: the epoch's last batch), no persistent tier: that
    step is complete in the local tier when ``fit`` returns, and a new Trainer with ``max_steps=16`` and
    ``ckpt_path="last"`` starts there and ends bit for bit as an uninterrupted 16-step run (stock, with its
    ``ModelCheckpoint(every_n_train_steps=2)`` file, does the same)."""
    reference = _fit(tmp_path / "u", local=False, max_steps=16, scheduler=True)
    first = _fit(tmp_path / "ours", local=True, max_steps=first_max_steps, scheduler=True)
    assert first.trainer.global_step == first_max_steps
    holder = tmp_path / "ours" / "local" / "asyncckpt-local" / "default" / "holder-0"
    assert sorted(p.name for p in holder.glob("*.json")) == [f"step-{first_max_steps:010d}.owner-0.json"]
    again = _fit(tmp_path / "ours", local=True, max_steps=16, scheduler=True, ckpt_path="last")
    _restored_from_local(again, first_max_steps)
    assert again.record.saves == [(s, (s - 1) % BATCHES + 1) for s in range(first_max_steps + 2, 17, 2)]
    assert_tree_equal(again.final, reference.final, "second fit from the local step against uninterrupted")
    ck = dict(every_n_train_steps=2, save_top_k=-1, save_last=True)
    _fit(tmp_path / "stock", local=False, checkpoint=ck, max_steps=first_max_steps, scheduler=True)
    stock = _fit(tmp_path / "stock", local=False, checkpoint=ck, max_steps=16, scheduler=True, ckpt_path="last")
    assert_tree_equal(again.record.start, stock.record.start, "start of the second fit, against stock")


# 5. ModelCheckpoint's files with the local tier ----------------------------------------------------------------

LINK_TOP2 = dict(every_n_train_steps=3, save_top_k=2, monitor="newest", mode="max", save_last="link")
DEFAULT_TOP1 = dict(every_n_train_steps=3, save_last=True)  # save_top_k=1, no monitor


@pytest.mark.parametrize("ck", [LINK_TOP2, DEFAULT_TOP1], ids=["link-top2-monitor", "last-top1"])
def test_uninterrupted_the_local_tier_leaves_modelcheckpoints_files_as_stock(tmp_path, ck):
    stock = _fit(tmp_path / "stock", local=False, checkpoint=ck, max_steps=12)
    ours = _fit(tmp_path / "ours", local=True, checkpoint=ck, max_steps=12)
    assert _listing(tmp_path / "ours" / "c") == _listing(tmp_path / "stock" / "c")
    assert _checkpoint_state(ours.checkpoint) == _checkpoint_state(stock.checkpoint)


@pytest.mark.parametrize("ck", [LINK_TOP2, DEFAULT_TOP1], ids=["link-top2-monitor", "last-top1"])
def test_resumed_from_a_local_step_newer_than_the_persistent_one_modelcheckpoints_files_are_as_uninterrupted(
        tmp_path, ck):
    """Local step 8, persistent step 6 (every 3), lost after step 8: resumed from local step 8, whose
    ``ModelCheckpoint`` state already has step 6's save; the directory ends as an uninterrupted run's."""
    stock = _fit(tmp_path / "stock", local=False, checkpoint=ck, max_steps=12)
    _fit(tmp_path / "ours", local=True, checkpoint=ck, max_steps=12, stop=8)
    ours = _fit(tmp_path / "ours", local=True, checkpoint=ck, max_steps=12, ckpt_path="last")
    _restored_from_local(ours, 8)
    assert _listing(tmp_path / "ours" / "c") == _listing(tmp_path / "stock" / "c")
    assert _checkpoint_state(ours.checkpoint) == _checkpoint_state(stock.checkpoint)
    assert_tree_equal(ours.final, stock.final, "resumed from local step 8 against uninterrupted")


@pytest.mark.parametrize("ck", [LINK_TOP2, DEFAULT_TOP1], ids=["link-top2-monitor", "last-top1"])
def test_resumed_from_a_local_step_that_modelcheckpoint_also_saved_its_files_are_as_stock(tmp_path, ck):
    """Local step 6 and persistent step 6 (local every 2, persistent every 3), lost after step 7. Stock resumes
    from its step-6 file and ends with the files of an uninterrupted run. With the local tier the run resumes from
    local step 6 and ``epoch=0-step=6.ckpt`` stays in the directory for good (a third top-k file with
    ``save_top_k=2``; a second one with the default ``save_top_k=1``) when the local save was built before
    ``ModelCheckpoint``'s of the same step; it is built after every callback's hook now (``TierStepEnd``)."""
    uninterrupted = _fit(tmp_path / "u", local=False, checkpoint=ck, max_steps=12)
    _fit(tmp_path / "stock", local=False, checkpoint=ck, max_steps=12, stop=7)
    stock = _fit(tmp_path / "stock", local=False, checkpoint=ck, max_steps=12, ckpt_path="last")
    assert str(stock.trainer.ckpt_path).endswith("last.ckpt") and stock.record.start["global_step"] == 6
    assert_tree_equal(stock.final, uninterrupted.final, "stock: resumed against uninterrupted")
    assert _listing(tmp_path / "stock" / "c") == _listing(tmp_path / "u" / "c")  # stock: as uninterrupted
    _fit(tmp_path / "ours", local=True, checkpoint=ck, max_steps=12, stop=7)
    ours = _fit(tmp_path / "ours", local=True, checkpoint=ck, max_steps=12, ckpt_path="last")
    _restored_from_local(ours, 6)
    assert_tree_equal(ours.final, stock.final, "weights and progress, resumed from local step 6 against stock")
    # the resumed runs' ModelCheckpoint state at their start, and the files they end with
    seen = {"start": ours.record.checkpoint_state, "files": _listing(tmp_path / "ours" / "c")}
    assert seen == {"start": stock.record.checkpoint_state, "files": _listing(tmp_path / "stock" / "c")}


def test_a_stateful_callback_after_the_finalizer_resumes_from_a_local_step_as_from_stocks_file(tmp_path):
    """The README's order, ``callbacks=[AsyncFinalizerCallback(), ..., ModelCheckpoint(...)]``, with a stateful
    callback of the user's (``Counter``) after the finalizer. Resumed from step 10 (lost after step 11), stock's file
    gives it ``batches=10``; a local step built inside the finalizer's hook gave ``batches=9`` (one batch behind an
    uninterrupted run); it is built after every callback's hook now (``TierStepEnd``)."""
    counters = {}
    for name, local in (("stock", False), ("ours", True), ("u", False)):
        ck = dict(every_n_train_steps=2 if name != "ours" else 100, save_top_k=-1, save_last=True)
        if name != "u":
            _fit(tmp_path / name, local=local, checkpoint=ck, max_steps=14, stop=11,
                 callbacks=(AsyncFinalizerCallback(), Counter()))
        counter = Counter()
        run = _fit(tmp_path / name, local=local, checkpoint=ck, max_steps=14, ckpt_path=None if name == "u" else "last",
                   callbacks=(AsyncFinalizerCallback(), counter))
        counters[name] = counter.batches
        if name == "ours":
            _restored_from_local(run, 10)
    assert counters["stock"] == counters["u"] == 14
    assert counters["ours"] == counters["stock"]


# 6. the pytorch_lightning distribution ------------------------------------------------------------------------

def test_pytorch_lightning_one_line_local_tier_resumes_mid_epoch_exactly(tmp_path):
    """Under ``.venv-pl`` (``pytorch_lightning`` alone): ``plugins=[AsyncCheckpointIO(local=LocalTier(...))]`` and
    no finalizer passed (the entry point adds it); lost after step 11, the next Trainer resumes from local step 10
    and ends bit for bit as an uninterrupted run, with StepLR and Adam (``tests/jobs/pl_tier_cases_job.py``)."""
    if not PL_PYTHON.exists():
        pytest.skip(f"{PL_PYTHON} is missing: `make test` builds it (the pytorch-lightning environment)")
    out = tmp_path / "out"
    with launch([PL_PYTHON, job_script("pl_tier_cases_job.py"), "--out", str(out)], out, 100, cwd=tmp_path) as job:
        job.wait()
    path = out / "report.json"
    assert path.exists(), f"no report; log:\n{(out / 'log.txt').read_text()[-4000:]}"
    report = json.loads(path.read_text())
    assert "crash" not in report, report["crash"]
    assert report["lightning_importable"] is False
    assert report["plugin"] == "AsyncCheckpointIO" and report["finalizers"] == 1
    assert report["local_saves"] == [2, 4, 6, 8, 10]
    assert report["resumed_step"] == 10 and report["ckpt_path"].endswith("restore-step-10"), report
    assert report["start_equal_stock"] is True  # the same start as stock's resume from its step-10 file
    assert report["final_equal"] is True and report["stock_final_equal"] is True
