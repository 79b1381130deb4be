"""``integration.patches``: each wrapper this package puts on a Lightning object is marked, made once, and
given back by undo, on real Lightning objects."""

from __future__ import annotations

import contextlib
import gc
import logging
import os

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import lightning_asyncckpt
from helpers import TinyModel, in_fresh_process, loader, trainer
from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback
from lightning_asyncckpt.integration import lightning_api, patches


def test_instance_wrappers_are_made_once_and_given_back(tmp_path):
    cb, logger = ModelCheckpoint(dirpath=tmp_path), CSVLogger(tmp_path)
    own = lambda *a: None  # noqa: E731 - an instance attribute the user set before ours
    logger.after_save_checkpoint = own
    made = patches.InstancePatches()
    calls = []

    def make(original):
        return lambda *a: calls.append(a) or original(*a)

    assert made.wrap(cb, "file_exists", make) is not None
    assert made.wrap(logger, "after_save_checkpoint", make) is not None
    assert made.wrap(cb, "file_exists", make) is None  # ours already: never wrapped twice
    assert patches.is_ours(cb.file_exists) and patches.is_ours(logger.after_save_checkpoint)
    logger.after_save_checkpoint(cb)
    assert calls == [(cb,)]
    assert made.wrap(cb, "no_such_method", make) is None
    made.undo()
    assert "file_exists" not in vars(cb) and logger.after_save_checkpoint is own


def test_the_class_wrapper_lives_while_a_plugin_does(request):
    """``on_trainer_init`` is wrapped once, however many plugins are made, and given back when the last is
    collected (in a fresh process: no earlier test's plugin alive)."""
    if not in_fresh_process(request):
        return
    from lightning_asyncckpt.integration import autoattach

    connector = lightning_api.trainer_module("trainer.connectors.callback_connector")._CallbackConnector
    gc.collect()  # the plugins of earlier tests

    class Owner:
        pass

    first, second = Owner(), Owner()
    autoattach.install(first)
    wrapped = connector.on_trainer_init
    autoattach.install(second)
    assert patches.is_ours(wrapped) and connector.on_trainer_init is wrapped
    del first
    assert connector.on_trainer_init is wrapped  # the second may yet be taken by a Trainer
    del second
    assert not patches.is_ours(connector.on_trainer_init) and not patches.class_patched()


def test_the_connector_wrappers_pickle_with_the_trainer(tmp_path):
    """``strategy="ddp_spawn"`` pickles the trainer into the processes it spawns: the wrappers on its checkpoint
    connector go with it, and still wrap there."""
    import pickle

    t = trainer(tmp_path, [AsyncCheckpointIO("nvrx", worker="fork")], [], max_steps=1)
    assert patches.is_ours(t._checkpoint_connector.resume_start)
    connector = pickle.loads(pickle.dumps(t._checkpoint_connector))
    assert patches.is_ours(connector.resume_start) and connector.resume_start._obj is connector


# -- a Trainer without the plugin runs Lightning's own code -------------------------------------------------

PACKAGE_DIR = os.path.dirname(os.path.abspath(lightning_asyncckpt.__file__)) + os.sep


class Boom(RuntimeError):
    pass


class RaisingModel(TinyModel):
    def training_step(self, batch, batch_idx):
        raise Boom("from training_step")


def _our_frames(error: BaseException) -> list[str]:
    """The frames of this package in ``error``'s traceback, as ``file:line``."""
    tb, ours = error.__traceback__, []
    while tb is not None:
        filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if filename.startswith(PACKAGE_DIR):
            ours.append(f"{filename}:{tb.tb_lineno}")
        tb = tb.tb_next
    return ours


@contextlib.contextmanager
def _entry_point_log():
    """The lines Lightning logs as it loads callbacks from entry points (``Adding 1 callbacks ...``)."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger(f"{lightning_api.fabric_module().__name__}.utilities.registry")
    handler, level = Collect(level=logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _assert_runs_lightnings_own_code(t) -> None:
    """Nothing of this package on ``t``: no finalizer added, and every method the package wraps for a trainer
    that uses the plugin is Lightning's own, on the class and on this trainer's objects."""
    assert not [cb for cb in t.callbacks if isinstance(cb, AsyncFinalizerCallback)], t.callbacks
    checkpoint_connector = type(t._checkpoint_connector)
    for owner, name in [(checkpoint_connector, "_parse_ckpt_path"), (checkpoint_connector, "resume_start"),
                        (ModelCheckpoint, "_find_last_checkpoints"),
                        (type(t._callback_connector), "on_trainer_init")]:
        assert not patches.is_ours(getattr(owner, name)), f"{owner.__name__}.{name} is wrapped"
        assert vars(owner)[name].__module__.startswith(lightning_api.trainer_module().__name__), (owner, name)
    for obj in [t._checkpoint_connector, t._callback_connector, t.strategy, *t.checkpoint_callbacks]:
        wrapped = [n for n, v in vars(obj).items() if callable(v) and patches.is_ours(v)]
        assert wrapped == [], f"{type(obj).__name__}: {wrapped}"


def test_a_trainer_without_the_plugin_runs_lightnings_own_code(tmp_path, request):
    """Installed and imported, the package adds nothing to a Trainer that does not use it: no callback (and no
    ``Adding 1 callbacks from entry point`` line), no wrapped method, and no frame of this package in the
    traceback of an error raised in ``training_step`` or by Lightning's own resume (in a fresh process, as a
    user's script that never makes a plugin)."""
    if not in_fresh_process(request):
        return
    gc.collect()  # the plugins of earlier tests, and with them the wrapper of Trainer construction
    with _entry_point_log() as lines:
        t = trainer(tmp_path, [], [ModelCheckpoint(dirpath=tmp_path / "c")], max_steps=2)
    assert not [ln for ln in lines if "entry point" in ln], lines
    _assert_runs_lightnings_own_code(t)
    with pytest.raises(Boom) as raised:
        t.fit(RaisingModel(), loader())
    assert _our_frames(raised.value) == []
    t = trainer(tmp_path, [], [], max_steps=2)
    with pytest.raises(FileNotFoundError) as raised:  # raised in Lightning's resume_start
        t.fit(TinyModel(), loader(), ckpt_path=str(tmp_path / "missing.ckpt"))
    assert _our_frames(raised.value) == []
    _assert_runs_lightnings_own_code(t)


def _fit_with_the_plugin(tmp_path) -> None:
    io = AsyncCheckpointIO("nvrx", worker="fork")
    t = trainer(tmp_path, [io], [ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=1)], max_steps=2)
    assert len([cb for cb in t.callbacks if isinstance(cb, AsyncFinalizerCallback)]) == 1
    assert patches.is_ours(t._checkpoint_connector._parse_ckpt_path)
    t.fit(TinyModel(), loader())
    assert len(io.history) == 2


def test_after_a_trainer_with_the_plugin_the_next_trainer_without_it_is_unwrapped(tmp_path, request):
    """The wrappers of a trainer that used the plugin stay on that trainer: once it and its plugin are gone, a
    Trainer made without the plugin in the same process runs Lightning's own code (in a fresh process)."""
    if not in_fresh_process(request):
        return
    _fit_with_the_plugin(tmp_path)  # in a frame of its own: save_hyperparameters keeps a copy of its locals
    gc.collect()  # trainers hold reference cycles
    plain = trainer(tmp_path, [], [ModelCheckpoint(dirpath=tmp_path / "d")], max_steps=2)
    _assert_runs_lightnings_own_code(plain)
    with pytest.raises(Boom) as raised:
        plain.fit(RaisingModel(), loader())
    assert _our_frames(raised.value) == []


def test_a_trainer_made_with_the_packages_strategy_alone_is_attached(tmp_path):
    """``AsyncDDPStrategy()`` without a plugin (it makes its ``AsyncCheckpointIO`` when first asked): the Trainer
    gets the finalizer and the resume wrappers as it is made, and no plugin is made before it is needed."""
    from lightning_asyncckpt import AsyncDDPStrategy

    t = trainer(tmp_path, [], [], strategy=AsyncDDPStrategy(), max_steps=1)
    assert len([cb for cb in t.callbacks if isinstance(cb, AsyncFinalizerCallback)]) == 1
    assert patches.is_ours(t._checkpoint_connector._parse_ckpt_path)
    assert vars(t.strategy).get("_checkpoint_io") is None
