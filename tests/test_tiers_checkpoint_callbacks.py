"""The local tier and the callbacks after ``AsyncFinalizerCallback``: ``ModelCheckpoint``'s files and state, and a
stateful callback's, resume from a local step as from stock's file of that step (see ``test_tiers_trainer_cases.py``)."""
from __future__ import annotations

import pytest
from tier_cases import (
    Counter,
    checkpoint_state,
    fit,
    listing,
    restored_from_local,
)

from helpers import assert_tree_equal
from lightning_asyncckpt import AsyncFinalizerCallback

pytestmark = pytest.mark.timeout(120)

# 5. ModelCheckpoint's files with the local tier ----------------------------------------------------------------

LINK_TOP2 = dict(every_n_train_steps=3, save_top_k=2, monitor="newest", mode="max", save_last="link")
DEFAULT_TOP1 = dict(every_n_train_steps=3, save_last=True)  # save_top_k=1, no monitor


@pytest.mark.parametrize("ck", [LINK_TOP2, DEFAULT_TOP1], ids=["link-top2-monitor", "last-top1"])
def test_uninterrupted_the_local_tier_leaves_modelcheckpoints_files_as_stock(tmp_path, ck):
    stock = fit(tmp_path / "stock", local=False, checkpoint=ck, max_steps=12)
    ours = fit(tmp_path / "ours", local=True, checkpoint=ck, max_steps=12)
    assert listing(tmp_path / "ours" / "c") == listing(tmp_path / "stock" / "c")
    assert checkpoint_state(ours.checkpoint) == checkpoint_state(stock.checkpoint)


@pytest.mark.parametrize("ck", [LINK_TOP2, DEFAULT_TOP1], ids=["link-top2-monitor", "last-top1"])
def test_resumed_from_a_local_step_newer_than_the_persistent_one_modelcheckpoints_files_are_as_uninterrupted(
        tmp_path, ck):
    """Local step 8, persistent step 6 (every 3), lost after step 8: resumed from local step 8, whose
    ``ModelCheckpoint`` state already has step 6's save; the directory ends as an uninterrupted run's."""
    stock = fit(tmp_path / "stock", local=False, checkpoint=ck, max_steps=12)
    fit(tmp_path / "ours", local=True, checkpoint=ck, max_steps=12, stop=8)
    ours = fit(tmp_path / "ours", local=True, checkpoint=ck, max_steps=12, ckpt_path="last")
    restored_from_local(ours, 8)
    assert listing(tmp_path / "ours" / "c") == listing(tmp_path / "stock" / "c")
    assert checkpoint_state(ours.checkpoint) == checkpoint_state(stock.checkpoint)
    assert_tree_equal(ours.final, stock.final, "resumed from local step 8 against uninterrupted")


@pytest.mark.parametrize("ck", [LINK_TOP2, DEFAULT_TOP1], ids=["link-top2-monitor", "last-top1"])
def test_resumed_from_a_local_step_that_modelcheckpoint_also_saved_its_files_are_as_stock(tmp_path, ck):
    """Local step 6 and persistent step 6 (local every 2, persistent every 3), lost after step 7. Stock resumes
    from its step-6 file and ends with the files of an uninterrupted run. With the local tier the run resumes from
    local step 6 and ``epoch=0-step=6.ckpt`` stays in the directory for good (a third top-k file with
    ``save_top_k=2``; a second one with the default ``save_top_k=1``) when the local save was built before
    ``ModelCheckpoint``'s of the same step; it is built after every callback's hook now (``TierStepEnd``)."""
    uninterrupted = fit(tmp_path / "u", local=False, checkpoint=ck, max_steps=12)
    fit(tmp_path / "stock", local=False, checkpoint=ck, max_steps=12, stop=7)
    stock = fit(tmp_path / "stock", local=False, checkpoint=ck, max_steps=12, ckpt_path="last")
    assert str(stock.trainer.ckpt_path).endswith("last.ckpt") and stock.record.start["global_step"] == 6
    assert_tree_equal(stock.final, uninterrupted.final, "stock: resumed against uninterrupted")
    assert listing(tmp_path / "stock" / "c") == listing(tmp_path / "u" / "c")  # stock: as uninterrupted
    fit(tmp_path / "ours", local=True, checkpoint=ck, max_steps=12, stop=7)
    ours = fit(tmp_path / "ours", local=True, checkpoint=ck, max_steps=12, ckpt_path="last")
    restored_from_local(ours, 6)
    assert_tree_equal(ours.final, stock.final, "weights and progress, resumed from local step 6 against stock")
    # the resumed runs' ModelCheckpoint state at their start, and the files they end with
    seen = {"start": ours.record.checkpoint_state, "files": listing(tmp_path / "ours" / "c")}
    assert seen == {"start": stock.record.checkpoint_state, "files": listing(tmp_path / "stock" / "c")}


def test_a_stateful_callback_after_the_finalizer_resumes_from_a_local_step_as_from_stocks_file(tmp_path):
    """The README's order, ``callbacks=[AsyncFinalizerCallback(), ..., ModelCheckpoint(...)]``, with a stateful
    callback of the user's (``Counter``) after the finalizer. Resumed from step 10 (lost after step 11), stock's file
    gives it ``batches=10``; a local step built inside the finalizer's hook gave ``batches=9`` (one batch behind an
    uninterrupted run); it is built after every callback's hook now (``TierStepEnd``)."""
    counters = {}
    for name, local in (("stock", False), ("ours", True), ("u", False)):
        ck = dict(every_n_train_steps=2 if name != "ours" else 100, save_top_k=-1, save_last=True)
        if name != "u":
            fit(tmp_path / name, local=local, checkpoint=ck, max_steps=14, stop=11,
                 callbacks=(AsyncFinalizerCallback(), Counter()))
        counter = Counter()
        run = fit(tmp_path / name, local=local, checkpoint=ck, max_steps=14, ckpt_path=None if name == "u" else "last",
                   callbacks=(AsyncFinalizerCallback(), counter))
        counters[name] = counter.batches
        if name == "ours":
            restored_from_local(run, 10)
    assert counters["stock"] == counters["u"] == 14
    assert counters["ours"] == counters["stock"]
