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


def check_save_path(path: Any, storage_options: Any, writes_file: bool) -> Path:
    """Bad input is an error in the trainer, at save time, never a background crash. ``writes_file``: the
    save is one ``torch.save`` file (which replaces a file, or a checkpoint directory of 0.1, at ``path``),
    else a DCP directory (which replaces a directory)."""
    if storage_options:
        raise TypeError(
            f"`storage_options` is not supported by `AsyncCheckpointIO.save_checkpoint`; got {storage_options!r}."
        )
    path = local_path(path)
    if writes_file and path.is_dir() and not path.is_symlink() and not _is_checkpoint_dir(path):
        raise IsADirectoryError(
            f"Cannot save a checkpoint file at {str(path)!r}: it is a directory that is not a checkpoint."
            " Save to another path, or remove the directory."
        )
    if not writes_file and path.is_file() and not path.is_symlink():
        raise FileExistsError(
            f"`AsyncCheckpointIO(format='dcp')` saves checkpoints as directories, but {str(path)!r} is an existing"
            " regular file. Remove it, save to another path, or use `format='auto'` (files, as stock Lightning)."
        )
    return path


def _is_checkpoint_dir(path: Path) -> bool:
    return (path / ".metadata").is_file()
