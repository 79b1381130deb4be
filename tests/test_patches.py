"""``integration.patches``: each wrapper this package puts on a Lightning object is marked, made once, and
given back by undo, on real Lightning objects."""

from __future__ import annotations

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_asyncckpt.integration import patches, resume


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


def test_the_class_wrapper_is_installed_once_and_undone():
    patches.undo_class_patches()  # another test's callback may have installed it
    plain = ModelCheckpoint._find_last_checkpoints
    try:
        resume.install()
        resume.install()
        assert patches.is_ours(ModelCheckpoint._find_last_checkpoints)
        patches.undo_class_patches()
        assert ModelCheckpoint._find_last_checkpoints is plain and not patches.is_ours(plain)
    finally:
        resume.install()  # as every AsyncFinalizerCallback leaves it
