"""Checkpoint paths: which ones a save accepts, checked at the call that names them.

A checkpoint path is a local :class:`~pathlib.Path` (``file://`` URLs included) or, for every other fsspec
URL (``s3://``, ``gs://``, ``memory://``, ...), the URL as a ``str``: the ``location`` of its
:class:`~lightning_asyncckpt.storage.destination.Destination`, which decides between the two.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from lightning_asyncckpt.storage import commit, destination
from lightning_asyncckpt.storage.destination import Destination


def checkpoint_path(path: str | os.PathLike) -> Path | str:
    """A local path as a ``Path``, a remote URL as its ``str``: how saves, loads and removals name it."""
    return destination.of(path).location


def check_save_path(path: str | os.PathLike, storage_options: object, writes_file: bool) -> Destination:
    """Bad input is an error in the trainer, at save time, never a background crash. ``writes_file``: the
    save is one ``torch.save`` file (which replaces a file, or a checkpoint directory of 0.1, at ``path``),
    else a DCP directory (which replaces a directory).

    Returns:
        Where the save goes.
    """
    if storage_options:
        raise TypeError(
            f"`storage_options` is not supported by `AsyncCheckpointIO.save_checkpoint`; got {storage_options!r}."
        )
    dest = destination.of(path)
    dest.check_for_save(writes_file)
    return dest


def wait_until_landed(path: Path | str, timeout_s: float, poll_s: float) -> None:
    """(a rank about to read ``path``, with other ranks up) While a local ``path`` does not exist yet and a save
    into its directory is still being written by a live process (another rank's: Fabric saves on rank 0,
    then every rank loads), waits for it to land, at most ``timeout_s``. Returns at once when ``path``
    exists, is remote, or nothing is in flight there: reading a path nobody writes fails as stock does."""
    dest = destination.of(path)
    if dest.is_remote:
        return
    path = Path(dest.location)
    deadline = time.monotonic() + timeout_s
    while not path.exists() and commit.saves_in_flight(path.parent) and time.monotonic() < deadline:
        time.sleep(poll_s)
