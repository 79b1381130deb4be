"""The finalizer callback (``AsyncFinalizerCallback``) under Lightning's Trainer on one device: the
plugin alone gets exactly one, from the package's entry point or without it; an explicit one makes the
automatic one inert; it allocates the staging buffers before the first save; and each committed save reaches
the loggers and the log (unless ``log_metrics=False``).
"""

import os
import re

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import SlowSteps, TinyModel, dir_entries, latest_raise_step, loader, trainer
from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback, CheckpointWriteError, testing
from processes import live_children


@pytest.mark.parametrize("entry_point", [True, False], ids=["installed", "source-checkout"])
def test_plugin_alone_gets_exactly_one_finalizer_with_or_without_the_entry_point(tmp_path, monkeypatch, entry_point):
    """Run from a source checkout (no entry point installed), a Trainer made after the plugin gets the finalizer
    all the same; installed, the entry point gives it and nothing adds a second."""
    if not entry_point:
        from lightning_asyncckpt.integration.lightning_api import trainer_module

        monkeypatch.setattr(trainer_module("trainer.connectors.callback_connector"), "_load_external_callbacks",
                            lambda group: [])
    io = AsyncCheckpointIO("nvrx")
    t = trainer(tmp_path, [io], [], max_steps=1)
    auto = [cb for cb in t.callbacks if isinstance(cb, AsyncFinalizerCallback)]
    assert len(auto) == 1


def test_plugin_alone_registers_the_finalizer(tmp_path):
    io = AsyncCheckpointIO("nvrx")
    ck = ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=4, save_top_k=-1)
    t = trainer(tmp_path, [io], [ck], max_steps=40)
    auto = [cb for cb in t.callbacks if isinstance(cb, AsyncFinalizerCallback)]
    assert len(auto) == 1 and auto[0]._auto  # from the package's Lightning entry point

    class BreakDisk(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 6:
                io.write_hook = testing.FailWrite()

    t.callbacks[:0] = [BreakDisk(), SlowSteps()]
    with pytest.raises(CheckpointWriteError, match="ENOSPC"):
        t.fit(TinyModel(), loader())
    assert 8 <= t.global_step <= latest_raise_step(8), t.global_step  # raised by the finalizer within steps
    assert dir_entries(tmp_path / "c") == ["epoch=0-step=4.ckpt"]


def test_plugin_without_any_finalizer_on_one_device(tmp_path):
    io = AsyncCheckpointIO("nvrx")
    io.write_hook = testing.FailWrite()
    ck = ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=4, save_top_k=-1)
    t = trainer(tmp_path, [io], [ck], max_steps=12)
    t.callbacks[:] = [cb for cb in t.callbacks if not isinstance(cb, AsyncFinalizerCallback)]
    with pytest.raises(CheckpointWriteError, match="ENOSPC"):  # at the next save or at teardown
        t.fit(TinyModel(), loader())
    assert live_children() == []
    assert not (tmp_path / "c").exists() or dir_entries(tmp_path / "c") == []


def test_explicit_callback_makes_the_automatic_one_inert(tmp_path):
    io = AsyncCheckpointIO("nvrx", worker="fork")
    mine = AsyncFinalizerCallback()
    t = trainer(tmp_path, [io], [mine], max_steps=2)
    t.fit(TinyModel(), loader())
    auto = [cb for cb in t.callbacks if isinstance(cb, AsyncFinalizerCallback) and cb._auto]
    assert mine._io is io and all(cb._io is None for cb in auto)


def test_staging_buffers_are_ready_before_the_first_save(tmp_path):
    """After the first optimizer step, the callback allocates the staging buffers (the persistent worker's
    shared memory), so that the first save only copies, as later saves do."""
    import lightning as L

    io = AsyncCheckpointIO("nvrx", worker="persistent")
    seen = {}

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, *a):
            if trainer.global_step == 1:
                seen["buffers"] = dict(enumerate(io.session.staging_buffers()))
                seen["saved"] = len(io.history) + io.session.num_pending

        def on_train_end(self, trainer, *a):
            seen["after"] = io.session.staging_buffers()

    ck = ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=1, save_top_k=1, monitor="step", mode="max")
    trainer(tmp_path, [io], [AsyncFinalizerCallback(), Look(), ck], max_steps=3).fit(TinyModel(width=128), loader(width=128))
    assert seen["saved"] == 0  # before the first save
    model_bytes = 2 * (128 * 128 + 128) * 4
    assert sum(b.numel() * b.element_size() for b in seen["buffers"].values()) >= 3 * model_bytes  # weights + Adam
    assert all(b.is_shared() for b in seen["buffers"].values()), [(n, b.is_shared()) for n, b in seen["buffers"].items()]
    assert all(any(b is a for a in seen["after"]) for b in seen["buffers"].values())  # reused by the saves


def test_every_committed_save_reaches_the_loggers_and_the_log(tmp_path):
    """Rank 0 logs each committed save's figures under ``asyncckpt/`` and one INFO line per checkpoint."""
    import csv
    import logging

    from lightning.pytorch.loggers import CSVLogger

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Collect(level=logging.INFO)
    logging.getLogger("lightning_asyncckpt").addHandler(handler)
    try:
        io = AsyncCheckpointIO("nvrx", worker="persistent")
        ck = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_train_steps=5)
        logger = CSVLogger(tmp_path / "logs", name="", version="")
        t = trainer(tmp_path, [io], [AsyncFinalizerCallback(), ck], max_steps=20, logger=logger, log_every_n_steps=1)
        t.fit(TinyModel(width=64, layers=2), loader(width=64, n=64))
    finally:
        logging.getLogger("lightning_asyncckpt").removeHandler(handler)

    assert len(io.history) == 4
    with open(tmp_path / "logs" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("asyncckpt/bytes_written")]
    assert len(rows) == 4
    for row, record in zip(rows, io.history):
        on_disk = os.path.getsize(record.path)  # stock's one torch.save file
        assert int(float(row["asyncckpt/bytes_written"])) == record.nbytes == on_disk
        assert float(row["asyncckpt/stall_seconds"]) == pytest.approx(record.stall_s)
        assert float(row["asyncckpt/write_seconds"]) == pytest.approx(record.write_s)
        assert float(row["asyncckpt/write_seconds"]) > 0 and float(row["asyncckpt/stall_seconds"]) > 0
        assert float(row["asyncckpt/write_gb_per_second"]) == pytest.approx(record.nbytes / record.write_s / 1e9)
        assert 0 <= float(row["asyncckpt/pending_saves"]) < 2
    assert [r.step for r in io.history] == [5, 10, 15, 20]
    committed = [ln for ln in lines if ln.startswith("lightning-asyncckpt: committed ")]
    assert [ln.split()[2].rstrip(":") for ln in committed] == [os.path.basename(r.path) for r in io.history]
    assert all(re.search(r" in \d+\.\d+ s \(\d+(\.\d+)? ([KMG]i)?B/s\); training stalled \d+\.\d+ s$", ln) for ln in committed)


def test_log_metrics_false_logs_nothing(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    io = AsyncCheckpointIO("mcore", worker="fork")
    ck = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_train_steps=5)
    t = trainer(tmp_path, [io], [AsyncFinalizerCallback(log_metrics=False), ck], max_steps=10,
                logger=CSVLogger(tmp_path / "logs", name="", version=""), log_every_n_steps=1)
    t.fit(TinyModel(width=32, layers=1), loader(width=32, n=32))
    assert len(io.history) == 2
    text = (tmp_path / "logs" / "metrics.csv").read_text() if (tmp_path / "logs" / "metrics.csv").exists() else ""
    assert "asyncckpt/" not in text
