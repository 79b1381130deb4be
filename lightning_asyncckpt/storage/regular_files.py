"""Opening one of a checkpoint's own files for reading: a regular file only, without blocking on a FIFO and,
where asked, without following a link out of the checkpoint. Below both :mod:`~lightning_asyncckpt.storage.commit`
(which reads ``.asyncckpt.json``) and :mod:`~lightning_asyncckpt.format.integrity` (every other file)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO


class CorruptCheckpointError(RuntimeError):
    """A checkpoint that must not be used: a record or item that does not match its CRC32 or size, a missing or
    damaged part, or a path that leads outside the checkpoint or to something other than a regular file. The
    message names the file and the record or item."""


def open_regular(path: Path, follow: bool = True) -> BinaryIO:
    """Opens ``path`` for reading without blocking (``O_NONBLOCK``: a FIFO would wait for a writer) and, unless
    ``follow``, without following a symlink; raises :class:`CorruptCheckpointError` for anything that is not a
    regular file (FIFO, device, directory, socket), ``OSError`` if it cannot be opened."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError:
        if not follow and os.path.islink(path):
            raise CorruptCheckpointError(f"{path}: a symlink, where the checkpoint's own file must be") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{path}: not a regular file ({_kind(mode)}): not a checkpoint")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"
