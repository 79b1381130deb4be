"""torchao's low-bit optimizers (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``) under Lightning's Trainer, with
each engine: the plugin writes the optimizer states as stock ``TorchCheckpointIO`` does (their subclass
types, about stock's size), and a resume from its checkpoint continues with the losses of the run that was
never interrupted (stock's own run, which also wrote the step's checkpoint with stock's plugin). Stock
Lightning 2.6.6 cannot resume such a checkpoint (a callable ``map_location``); the plugin can, stock's too.

The optimizers' step runs eagerly (``torch.compile`` is the identity in these tests): torchao compiles it otherwise, 10 to 30 s
per optimizer on this machine, which the subject does not need. Real worker processes, real files."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import TinyModel, loader, trainer
from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback, LocalTier

optim = pytest.importorskip("torchao.optim", reason="torchao is a test extra")

OPTIMIZERS = {"AdamW8bit": "OptimState8bit", "AdamW4bit": "OptimState4bit", "AdamWFp8": "OptimStateFp8"}
WIDTH = 64  # torchao quantizes the states of tensors of 4096 elements and more: the two weights here
DATA = dict(width=WIDTH, n=32, batch_size=8)  # 4 steps per epoch: the checkpoint at step 4 ends an epoch


class AoModel(TinyModel):
    def __init__(self, optimizer: str = "AdamW8bit", width: int = WIDTH):
        super().__init__(width=width)
        self.save_hyperparameters()

    def configure_optimizers(self):
        return getattr(optim, self.hparams.optimizer)(self.parameters(), lr=1e-2)


class Losses(L.Callback):
    def __init__(self):
        self.by_step: dict[int, float] = {}
        self.start_state: set[str] = set()

    def on_train_start(self, trainer, pl_module):
        self.start_state = {type(v).__name__ for s in trainer.optimizers[0].state.values() for v in s.values()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.by_step[trainer.global_step] = outputs["loss"].item()


def _state_types(ckpt: dict) -> dict:
    return {(p, k): type(v).__name__ for p, s in ckpt["optimizer_states"][0]["state"].items() for k, v in s.items()}


@pytest.fixture(autouse=True)
def eager_steps(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, *args, **kwargs: fn)  # torchao compiles its step at each call


def _fit(tmp_path, name, optimizer, plugins, max_steps, ckpt_path=None, every=4, width=WIDTH, dirpath=None, n=32):
    L.seed_everything(3)
    losses = Losses()
    callbacks = [losses] + ([AsyncFinalizerCallback()] if plugins else [])
    if every:
        callbacks.append(ModelCheckpoint(dirpath=dirpath or tmp_path / name, every_n_train_steps=every, save_top_k=-1,
                                         save_last=True))
    t = trainer(tmp_path / name, plugins, callbacks, max_steps=max_steps, enable_checkpointing=bool(every))
    t.fit(AoModel(optimizer, width), loader(**{**DATA, "width": width, "n": n}), ckpt_path=ckpt_path)
    return losses


# make test: each optimizer with mcore (its fork worker: 5 to 16 s each here), and AdamW8bit with nvrx too (its
# spawned worker imports torchao: 20 to 50 s each on this loaded 2-core machine); make test-all: all six
CASES = [
    pytest.param(o, e, w, id=f"{o}-{e}", marks=() if e == "mcore" or o == "AdamW8bit" else pytest.mark.slow)
    for e, w in (("nvrx", "persistent"), ("mcore", "fork")) for o in OPTIMIZERS
]


@pytest.mark.parametrize("optimizer, engine, worker", CASES)
def test_torchao_states_are_saved_as_stock_and_resume_exactly(tmp_path, optimizer, engine, worker):
    # stock: 8 steps in one run, its checkpoint at step 4 written by stock's plugin
    stock = _fit(tmp_path, "stock", optimizer, [], max_steps=8)
    stock_file = tmp_path / "stock" / "epoch=0-step=4.ckpt"

    io = AsyncCheckpointIO(engine, worker=worker, timeout_s=120)
    try:
        _fit(tmp_path, "ours", optimizer, [io], max_steps=4)
        ours_file = tmp_path / "ours" / "epoch=0-step=4.ckpt"
        theirs = torch.load(stock_file, map_location="cpu", weights_only=True)
        mine = torch.load(ours_file, map_location="cpu", weights_only=True)
        assert _state_types(mine) == _state_types(theirs)
        assert OPTIMIZERS[optimizer] in set(_state_types(mine).values())
        size, stock_size = ours_file.stat().st_size, stock_file.stat().st_size
        assert abs(size - stock_size) <= 0.05 * stock_size, (size, stock_size)

        resumed = _fit(tmp_path, "resumed", optimizer, [io], max_steps=8, ckpt_path=str(ours_file), every=0)
    finally:
        io.teardown()
    # the resumed optimizer holds torchao's states again, and trains on as the uninterrupted run did
    assert OPTIMIZERS[optimizer] in resumed.start_state, resumed.start_state
    assert sorted(resumed.by_step) == [5, 6, 7, 8]
    assert [resumed.by_step[s] for s in range(5, 9)] == [stock.by_step[s] for s in range(5, 9)]


def test_stock_cannot_resume_torchao_states_the_plugin_can(tmp_path):
    _fit(tmp_path, "stock", "AdamW8bit", [], max_steps=4)
    stock_file = tmp_path / "stock" / "epoch=0-step=4.ckpt"
    with pytest.raises(RuntimeError, match="Callable map_location not supported"):
        TorchCheckpointIO().load_checkpoint(stock_file)  # what Trainer.fit(ckpt_path=...) calls with stock's plugin
    io = AsyncCheckpointIO("nvrx", timeout_s=120)
    try:
        loaded = io.load_checkpoint(stock_file)  # Lightning's call: no map_location, its callable default
        assert set(_state_types(loaded).values()) >= {"OptimState8bit"}
        resumed = _fit(tmp_path, "resumed", "AdamW8bit", [io], max_steps=6, ckpt_path=str(stock_file), every=0)
    finally:
        io.teardown()
    assert "OptimState8bit" in resumed.start_state


# make test-all: 25 to 95 s here (the lazy rule and a local share are unit-tested in test_subclasses.py)
@pytest.mark.slow
def test_a_lazy_local_tier_resume_keeps_torchao_states_and_trains_on_exactly(tmp_path):
    """Width 256: each 8-bit ``codes`` is 64 KiB, the least a lazy snapshot leaves to its background copy. 6 steps
    an epoch: the local step 6 ends one (Lightning restarts an epoch resumed in its middle from its first batch)."""
    stock = _fit(tmp_path, "stock", "AdamW8bit", [], max_steps=8, width=256, n=48)
    (tmp_path / "local").mkdir()

    def io():
        return AsyncCheckpointIO("nvrx", snapshot="lazy", timeout_s=120,
                                 local=LocalTier(tmp_path / "local", every_n_train_steps=2))

    first = io()
    try:  # persistent at 4, local at 2, 4 and 6
        _fit(tmp_path, "first", "AdamW8bit", [first], max_steps=6, width=256, dirpath=tmp_path / "c", n=48)
        assert first.history and all(r.lazy_nbytes > 0 for r in first.history)  # the codes were copied lazily
    finally:
        first.teardown()
    again = io()
    try:
        resumed = _fit(tmp_path, "again", "AdamW8bit", [again], max_steps=8, ckpt_path="last", width=256,
                       dirpath=tmp_path / "c", n=48)
    finally:
        again.teardown()
    assert "OptimState8bit" in resumed.start_state, resumed.start_state
    assert sorted(resumed.by_step) == [7, 8]  # from the local step 6
    assert [resumed.by_step[s] for s in (7, 8)] == [stock.by_step[s] for s in (7, 8)]
