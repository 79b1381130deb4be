"""``ckpt_path="last"`` on object stores, for trainers that save through ``AsyncCheckpointIO``.

Lightning resolves ``trainer.fit(..., ckpt_path="last")`` with ``ModelCheckpoint._find_last_checkpoints``,
which lists the checkpoint directory with its fsspec filesystem and returns the names as that
filesystem gives them: on ``s3://`` without the scheme (``bucket/run1/last.ckpt``), which Lightning then
looks up on the local disk and does not find. Stock Lightning (through 2.6.6) therefore resumes from
nothing on an object store. Installed once, before any ``fit``, this wrapper gives those names their
scheme back, for trainers whose strategy saves through ``AsyncCheckpointIO`` and only for checkpoint
files on a remote filesystem; everything else is left exactly as Lightning computes it.
"""

from __future__ import annotations

from typing import Any

from lightning_asyncckpt.integration import patches


def install() -> None:
    """(any process, idempotent) Wraps ``ModelCheckpoint._find_last_checkpoints`` as described above."""
    from lightning_asyncckpt.integration.lightning_api import ModelCheckpoint

    def make(original: Any) -> Any:
        def _find_last_checkpoints(self: ModelCheckpoint, trainer: Any) -> set[str]:
            found = original(self, trainer)
            if not found or not _saves_async(trainer) or _is_local(self._fs):
                return found
            # a DCP directory has no modification time for Lightning to compare: left as Lightning finds it
            return {self._fs.unstrip_protocol(p) if self._fs.isfile(p) else p for p in found}

        return _find_last_checkpoints

    patches.wrap_class(ModelCheckpoint, "_find_last_checkpoints", make)


def _saves_async(trainer: Any) -> bool:
    from lightning_asyncckpt.integration.io import find_async_io

    return find_async_io(getattr(trainer, "strategy", None)) is not None


def _is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)
