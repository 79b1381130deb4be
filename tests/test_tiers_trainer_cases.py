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

import os
import signal

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from tier_cases import (
    BATCHES,
    IndexedModel,
    equal,
    fit,
    indexed_data,
    restored_from_local,
)

from helpers import assert_tree_equal, trainer
from lightning_asyncckpt import AsyncCheckpointIO, LocalTier
from processes import PL_PYTHON, job_command, launch, rank_reports

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``uninterrupted(**kw)``: stock's uninterrupted ``fit(local=False, **kw)``, run once per module (and
    pytest process) for each ``kw``: several cases compare against the same one. Nothing here changes it."""
    runs = {}

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in runs:
            runs[key] = fit(tmp_path_factory.mktemp("uninterrupted"), local=False, **kw)
        return runs[key]

    return get

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
    stock = fit(tmp_path / "stock-u", local=False, checkpoint=every, **kw)
    ours = fit(tmp_path / "ours-u", local=True, **kw)  # no persistent saves: every checkpoint built is local
    assert stock.record.saves == [(2, 6), (4, 3), (6, 8), (8, 6)]
    assert ours.record.saves == stock.record.saves
    assert_tree_equal(ours.final, stock.final, "uninterrupted, local tier against stock")

    fit(tmp_path / "stock-i", local=False, checkpoint=every, stop=5, **kw)
    stock_again = fit(tmp_path / "stock-i", local=False, checkpoint=every,
                       ckpt_path=tmp_path / "stock-i" / "c" / "epoch=1-step=4.ckpt", **kw)
    fit(tmp_path / "ours-i", local=True, stop=5, **kw)
    again = fit(tmp_path / "ours-i", local=True, ckpt_path="last", **kw)
    restored_from_local(again, 4)
    assert stock_again.record.start["batch_progress"]["current"]["ready"] == 3
    assert_tree_equal(again.record.start, stock_again.record.start, "started from local step 4, against stock's file")
    assert stock_again.record.saves == [(4, 4), (6, 8), (8, 6)]  # stock saves step 4 again, mid-accumulation
    assert again.record.saves == stock_again.record.saves
    assert_tree_equal(stock_again.final, stock.final, "stock: resumed against uninterrupted")
    assert_tree_equal(again.final, stock.final, "resumed from local step 4 against uninterrupted")


def test_accumulation_a_second_loss_after_the_mid_accumulation_resave_ends_as_stock(tmp_path, uninterrupted):
    """Lost after step 3 (the epoch's end), resumed from step 2 (batch 6); that run saves step 2 again at batch 7
    (mid-accumulation, as stock) and is lost after step 3 again; the third run resumes from that save. Stock then
    ends with other weights than an uninterrupted run (the re-save does not hold batch 7's gradients, which the
    resumed run never sees again: a stock Lightning quirk); with the local tier the run ends exactly as stock's,
    quirk included."""
    every = dict(every_n_train_steps=2, save_top_k=-1)
    kw = dict(max_steps=6, accumulate_grad_batches=3)
    reference = uninterrupted(**kw)
    finals = {}
    for name, local in (("stock", False), ("ours", True)):
        ck = None if local else every
        path = "last" if local else tmp_path / name / "c" / "epoch=0-step=2.ckpt"
        fit(tmp_path / name, local=local, checkpoint=ck, stop=3, **kw)
        second = fit(tmp_path / name, local=local, checkpoint=ck, stop=3, ckpt_path=path, **kw)
        assert second.record.saves == [(2, 7)]
        third = fit(tmp_path / name, local=local, checkpoint=ck, ckpt_path=path, **kw)
        assert third.record.start["global_step"] == 2
        assert third.record.start["batch_progress"]["current"]["ready"] == 7
        finals[name] = third.final
    with pytest.raises(AssertionError, match="tensor values differ"):  # stock's quirk
        assert_tree_equal(finals["stock"], reference.final, "stock, twice lost")
    if not equal(finals["ours"], reference.final):  # better than stock would do too
        assert_tree_equal(finals["ours"], finals["stock"], "twice lost, local tier against stock")


class SignalAtBatch(L.Callback):
    """Sends this process SIGTERM at the end of training batch ``batch`` (counted over the run, from 1)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(self, trainer, *a):
        if trainer.fit_loop.epoch_loop.batch_progress.total.ready == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)


def test_accumulation_a_preemption_mid_accumulation_resumes_as_stocks_save_on_exception(tmp_path, uninterrupted):
    """SIGTERM at batch 9 (epoch 1's first batch: global step 3, mid-accumulation). The local tier saves step 3
    there, at that batch, and stops; stock with ``ModelCheckpoint(save_on_exception=True)`` saves at the same
    point (stock's default saves nothing then). A resume from either drops batch 9's gradients, so both end
    with other weights than an uninterrupted run, and the same ones. (Where the local tier's last save is the
    step already, as at batch 7, it stops without a new save and the resume is exact.)"""
    kw = dict(max_steps=6, accumulate_grad_batches=3)
    reference = uninterrupted(**kw)
    first = fit(tmp_path / "ours", local=True, callbacks=(SignalAtBatch(9),), **kw)
    assert first.trainer.global_step == 3 and first.record.saves == [(2, 6), (3, 1)]
    ours = fit(tmp_path / "ours", local=True, ckpt_path="last", **kw)
    restored_from_local(ours, 3)
    ck = dict(every_n_train_steps=2, save_top_k=-1, save_on_exception=True)
    with pytest.raises(SIGTERMException):
        fit(tmp_path / "stock", local=False, checkpoint=ck, callbacks=(SignalAtBatch(9),), **kw)
    stock = fit(tmp_path / "stock", local=False, checkpoint=ck, ckpt_path=tmp_path / "stock" / "c" / "epoch=1-step=3.ckpt",
                 **kw)
    assert stock.record.start["batch_progress"]["current"]["ready"] == 1
    with pytest.raises(AssertionError, match="tensor values differ"):
        assert_tree_equal(stock.final, reference.final, "stock, resumed from its save on the exception")
    if not equal(ours.final, reference.final):  # better than stock would do too
        assert_tree_equal(ours.final, stock.final, "resumed from the emergency save, against stock's")


# 2. an LR scheduler stepped every step, mid-epoch resume -------------------------------------------------------

def test_step_lr_scheduler_mid_epoch_resume_from_a_local_step_matches_stock_and_uninterrupted(tmp_path):
    """StepLR (``interval="step"``), Adam, a resumable loader. Stock: ``ModelCheckpoint(every_n_train_steps=2)``,
    lost after step 11, resumes from its step-10 file (epoch 1, batch 2). Ours: local every 2 steps, persistent
    every 4 (step 8): resumes from local step 10. Same start (weights, moments, LR, scheduler, progress, the
    loader's state) and same end after 20 steps as stock's resume and as the uninterrupted run."""
    kw = dict(max_steps=20, scheduler=True, resumable=True)
    reference = fit(tmp_path / "u", local=False, **kw)
    stock_ck = dict(every_n_train_steps=2, save_top_k=-1, save_last=True)
    ours_ck = dict(every_n_train_steps=4, save_top_k=-1, save_last=True)
    fit(tmp_path / "stock", local=False, checkpoint=stock_ck, stop=11, **kw)
    stock = fit(tmp_path / "stock", local=False, checkpoint=stock_ck, ckpt_path="last", **kw)
    fit(tmp_path / "ours", local=True, checkpoint=ours_ck, stop=11, **kw)
    ours = fit(tmp_path / "ours", local=True, checkpoint=ours_ck, ckpt_path="last", **kw)
    assert str(stock.trainer.ckpt_path).endswith("last.ckpt") and stock.record.start["global_step"] == 10
    assert stock.record.start["epoch"] == 1 and stock.record.start["batch_progress"]["current"]["ready"] == 2
    restored_from_local(ours, 10)
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
        run = fit(tmp_path / name, local=local, checkpoint=ck, max_steps=10, callbacks=(loaded,))
        t = run.trainer
        got = [t.validate(ckpt_path="last", dataloaders=indexed_data(), verbose=False), str(t.ckpt_path)]
        got += [t.test(ckpt_path="last", dataloaders=indexed_data(), verbose=False), str(t.ckpt_path)]
        tier = LocalTier(tmp_path / name / "local", every_n_train_steps=2, replication_factor=1)
        fresh = trainer(tmp_path / name, [AsyncCheckpointIO("nvrx", local=tier)] if local else [],
                        [loaded, ModelCheckpoint(dirpath=tmp_path / name / "c", **ck)])
        got += [fresh.validate(IndexedModel(), ckpt_path="last", dataloaders=indexed_data(), verbose=False),
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
    fit(tmp_path, local=True, max_steps=6)
    run = fit(tmp_path, local=True, max_steps=8, ckpt_path="last")
    restored_from_local(run, 6)
    with pytest.raises(FileNotFoundError, match=r"restore-step-6 names step 6 of the local tier.*ckpt_path='last'"):
        run.trainer.validate(ckpt_path=run.trainer.ckpt_path, dataloaders=indexed_data(), verbose=False)


# 4. max_steps ending at a local save step, then fit again with a higher max_steps ---------------------------

@pytest.mark.parametrize("first_max_steps", [10, BATCHES], ids=["mid-epoch", "epoch-end"])
def test_max_steps_ending_at_a_local_save_then_fit_again_further(tmp_path, first_max_steps, uninterrupted):
    """``max_steps`` at a local save step (10: mid-epoch; 8: the epoch's last batch), no persistent tier: that
    step is complete in the local tier when ``fit`` returns, and a new Trainer with ``max_steps=16`` and
    ``ckpt_path="last"`` starts there and ends bit for bit as an uninterrupted 16-step run (stock, with its
    ``ModelCheckpoint(every_n_train_steps=2)`` file, does the same)."""
    reference = uninterrupted(max_steps=16, scheduler=True)
    first = fit(tmp_path / "ours", local=True, max_steps=first_max_steps, scheduler=True)
    assert first.trainer.global_step == first_max_steps
    holder = tmp_path / "ours" / "local" / "asyncckpt-local" / "default" / "holder-0"
    assert sorted(p.name for p in holder.glob("*.json")) == [f"step-{first_max_steps:010d}.owner-0.json"]
    again = fit(tmp_path / "ours", local=True, max_steps=16, scheduler=True, ckpt_path="last")
    restored_from_local(again, first_max_steps)
    assert again.record.saves == [(s, (s - 1) % BATCHES + 1) for s in range(first_max_steps + 2, 17, 2)]
    assert_tree_equal(again.final, reference.final, "second fit from the local step against uninterrupted")
    ck = dict(every_n_train_steps=2, save_top_k=-1, save_last=True)
    fit(tmp_path / "stock", local=False, checkpoint=ck, max_steps=first_max_steps, scheduler=True)
    stock = fit(tmp_path / "stock", local=False, checkpoint=ck, max_steps=16, scheduler=True, ckpt_path="last")
    assert_tree_equal(again.record.start, stock.record.start, "start of the second fit, against stock")


# 6. the pytorch_lightning distribution ------------------------------------------------------------------------

def test_pytorch_lightning_one_line_local_tier_resumes_mid_epoch_exactly(tmp_path):
    """Under ``.venv-pl`` (``pytorch_lightning`` alone): ``plugins=[AsyncCheckpointIO(local=LocalTier(...))]`` and
    no finalizer passed (the entry point adds it); lost after step 11, the next Trainer resumes from local step 10
    and ends bit for bit as an uninterrupted run, with StepLR and Adam (``tests/jobs/pl_tier_cases_job.py``)."""
    if not PL_PYTHON.exists():
        pytest.skip(f"{PL_PYTHON} is missing: `make test` builds it (the pytorch-lightning environment)")
    out = tmp_path / "out"
    with launch([*job_command("pl_tier_cases_job", PL_PYTHON), "--out", str(out)], out, 100, cwd=tmp_path) as job:
        job.wait()
    (report,) = rank_reports(out, 1, lambda: (out / "log.txt").read_text()[-4000:])
    assert report["lightning_importable"] is False
    assert report["plugin"] == "AsyncCheckpointIO" and report["finalizers"] == 1
    assert report["local_saves"] == [2, 4, 6, 8, 10]
    assert report["resumed_step"] == 10 and report["ckpt_path"].endswith("restore-step-10"), report
    assert report["start_equal_stock"] is True  # the same start as stock's resume from its step-10 file
    assert report["final_equal"] is True and report["stock_final_equal"] is True


# 7. strategy="ddp_spawn" ---------------------------------------------------------------------------------------

# ddp_spawn runs in `make test-all`, to keep `make test` under 15 minutes (pytorch_lightning with the local tier
# stays in `make test`: the one-line mid-epoch resume)
@pytest.mark.slow  # both distributions: about 100 s each on 2 idle cores, in `make test-all`
@pytest.mark.parametrize("distribution", ["lightning", "pytorch_lightning"])
def test_ddp_spawn_resumes_from_the_newer_local_step(tmp_path, distribution):
    """``ddp_spawn`` pickles the trainer with its callbacks into the processes it spawns, where nothing of this
    package's ``__init__`` runs: ``ckpt_path="last"`` there still consults the local tier and resumes from its
    step 4, not from the persistent ``last.ckpt`` of step 3 (``tests/jobs/spawn_tier_job.py``); under either
    distribution."""
    import sys
    from pathlib import Path

    python = PL_PYTHON if distribution == "pytorch_lightning" else Path(sys.executable)
    if not python.exists():
        pytest.skip(f"{python} is missing: `make test` builds it (the pytorch-lightning environment)")
    out = tmp_path / "out"
    with launch([*job_command("spawn_tier_job", python), str(out)], out, 180, cwd=tmp_path) as job:
        job.wait()
    log = (out / "log.txt").read_text()
    starts = {}
    for n in (1, 2):  # a fit's rank that never started wrote no report: the test fails with the log
        for rank, report in enumerate(rank_reports(out, 2, lambda: log[-4000:], prefix=f"start-{n}-rank")):
            starts[n, rank] = report
    assert starts[1, 0]["step"] == 0
    for rank in (0, 1):
        assert starts[2, rank]["step"] == 4, (starts, log[-4000:])
        assert starts[2, rank]["ckpt_path"].endswith("restore-step-4")
    assert "resuming from the local tier at step 4" in log
