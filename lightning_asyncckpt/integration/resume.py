"""``ckpt_path="last"`` on object stores, for trainers that save through ``AsyncCheckpointIO``.

Lightning resolves ``trainer.fit(..., ckpt_path="last")`` with ``ModelCheckpoint._find_last_checkpoints``,
which lists the checkpoint directory with its fsspec filesystem and returns the names as that
filesystem gives them: on ``s3://`` without the scheme (``bucket/run1/last.ckpt``), which Lightning then
looks up on the local disk and does not find. Stock Lightning (through 2.6.6) therefore resumes from
nothing on an object store. While a trainer that saves through ``AsyncCheckpointIO`` resolves ``"last"``
(:func:`schemes_kept`, from its connector's ``_parse_ckpt_path``: :mod:`~lightning_asyncckpt.integration.tier_resume`),
its checkpoint callbacks give those names their scheme back, only for checkpoint files on a remote
filesystem; everything else is left exactly as Lightning computes it, and no other trainer is touched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from lightning_asyncckpt.integration.patches import InstancePatches

if TYPE_CHECKING:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint


@contextmanager
def schemes_kept(trainer: Trainer) -> Iterator[None]:
    """(the rank resolving ``ckpt_path="last"``, inside ``_parse_ckpt_path``: every rank) Within it, the
    ``_find_last_checkpoints`` of ``trainer``'s checkpoint callbacks keep a remote file's scheme; given back
    on exit.

    Args:
        trainer: a Trainer whose strategy saves through ``AsyncCheckpointIO`` (others are left alone).
    """
    made = InstancePatches()
    if _saves_async(trainer):
        for cb in getattr(trainer, "checkpoint_callbacks", []):
            made.wrap(cb, "_find_last_checkpoints", _with_scheme(cb))
    try:
        yield
    finally:
        made.undo()


def _with_scheme(cb: ModelCheckpoint) -> Callable[[Callable[[Trainer], set[str]]], Callable[[Trainer], set[str]]]:
    def make(original: Callable[[Trainer], set[str]]) -> Callable[[Trainer], set[str]]:
        def _find_last_checkpoints(trainer: Trainer) -> set[str]:
            found = original(trainer)
            if not found or _is_local(cb._fs):
                return found
            # a DCP directory has no modification time for Lightning to compare: left as Lightning finds it
            return {cb._fs.unstrip_protocol(p) if cb._fs.isfile(p) else p for p in found}

        return _find_last_checkpoints

    return make


def _saves_async(trainer: Trainer) -> bool:
    from lightning_asyncckpt.integration.io import find_async_io

    return find_async_io(getattr(trainer, "strategy", None)) is not None


def _is_local(fs: object) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)
