"""Checkpoint paths: which ones a save accepts, checked at the call that names them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def local_path(path: Any) -> Path:
    """A local or mounted path (``file://`` URLs included); a clear error for other URLs."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = text.decode()
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        raise ValueError(
            f"`AsyncCheckpointIO` writes to local or mounted filesystems only; got {text!r}."
            " Mount the remote storage (e.g. with a FUSE client) or use Lightning's `TorchCheckpointIO`."
        )
    return Path(text)


def check_save_path(path: Any, storage_options: Any) -> Path:
    """Bad input is an error in the trainer, at save time, never a background crash."""
    if storage_options:
        raise TypeError(
            f"`storage_options` is not supported by `AsyncCheckpointIO.save_checkpoint`; got {storage_options!r}."
        )
    path = local_path(path)
    if path.is_file() and not path.is_symlink():
        raise FileExistsError(
            f"`AsyncCheckpointIO` saves checkpoints as directories, but {str(path)!r} is an existing regular"
            " file (perhaps from `TorchCheckpointIO`). Remove it or save to another path."
        )
    return path
