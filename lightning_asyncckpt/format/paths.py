"""Checkpoint paths: which ones a save accepts, checked at the call that names them.

A checkpoint path is a local :class:`~pathlib.Path` (``file://`` URLs included) or, for every other fsspec
URL (``s3://``, ``gs://``, ``memory://``, ...), the URL as a ``str`` (see :mod:`lightning_asyncckpt.format.remote`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from lightning_asyncckpt.format import commit, remote


def local_path(path: str | os.PathLike) -> Path:
    """A local or mounted path (``file://`` URLs included); a clear error for other URLs."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = text.decode()
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        raise ValueError(f"{text!r} is a remote URL; this operation takes a local or mounted path.")
    return Path(text)


def checkpoint_path(path: str | os.PathLike) -> Path | str:
    """A local path as a ``Path``, a remote URL as its ``str``: how saves, loads and removals name it."""
    try:
        text = os.fspath(path)
    except TypeError:
        raise TypeError(f"lightning-asyncckpt: a checkpoint path must be a str or os.PathLike (a local path or an"
                        f" fsspec URL such as s3://bucket/ckpt); got {type(path).__name__} {_short(path)}") from None
    if isinstance(text, bytes):
        text = text.decode()
    return text if remote.is_remote(text) else local_path(text)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parent(path: Path | str) -> Path | str:
    return remote.parent(path) if isinstance(path, str) else path.parent


def check_save_path(path: str | os.PathLike, storage_options: object, writes_file: bool) -> Path | str:
    """Bad input is an error in the trainer, at save time, never a background crash. ``writes_file``: the
    save is one ``torch.save`` file (which replaces a file, or a checkpoint directory of 0.1, at ``path``),
    else a DCP directory (which replaces a directory)."""
    if storage_options:
        raise TypeError(
            f"`storage_options` is not supported by `AsyncCheckpointIO.save_checkpoint`; got {storage_options!r}."
        )
    path = checkpoint_path(path)
    if isinstance(path, str):
        remote.filesystem(path)  # an unknown scheme or a missing backend: a clear error now
        return path
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


def wait_until_landed(path: Path | str, timeout_s: float, poll_s: float) -> None:
    """(a rank about to read ``path``, with other ranks up) While a local ``path`` does not exist yet and a save
    into its directory is still being written by a live process (another rank's: Fabric saves on rank 0,
    then every rank loads), waits for it to land, at most ``timeout_s``. Returns at once when ``path``
    exists, is remote, or nothing is in flight there: reading a path nobody writes fails as stock does."""
    if not isinstance(path, Path):
        return
    deadline = time.monotonic() + timeout_s
    while not path.exists() and commit.saves_in_flight(path.parent) and time.monotonic() < deadline:
        time.sleep(poll_s)
