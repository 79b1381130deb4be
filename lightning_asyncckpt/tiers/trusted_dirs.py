"""Which directories the local tier trusts, and how it makes its own without following a link.

The tier reads back what it wrote (a share's header is a pickle, its bytes become the model's weights), so
everything it reads must be something only this job's user could have written:

- ``dir`` (the user's choice) may be shared, as ``/dev/shm`` and ``/tmp`` are, if no one else can rename or
  replace what the tier makes in it: owned by this user or root, and writable by group or others only with
  the sticky bit. A directory of another (non-root) user is refused even where it is not writable by us
  (root can write anywhere): its owner can swap our ``asyncckpt-local`` for theirs at any time. A symbolic
  link as ``dir`` is followed (the user named it), if it is this user's or root's link to such a directory.
- ``asyncckpt-local/``, the session and ``holder-<rank>`` are the tier's own: made mode 0700 whatever the
  umask, and refused at setup where they exist but are a symbolic link, another user's, or writable by group
  or others: another local user could have planted a step there (a header whose pickle runs code, weights of
  their choice, a manifest with matching CRC32s), or could plant one later.

Below ``dir`` nothing is followed: each directory is opened with ``O_NOFOLLOW`` from its parent's descriptor
(:func:`make`), and the tier's files are opened with ``O_NOFOLLOW`` (:func:`open_file`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from lightning_asyncckpt.storage import private_dirs
from lightning_asyncckpt.storage.private_dirs import UntrustedDirectoryError, owner_and_mode

__all__ = ["UntrustedDirectoryError", "base_problem", "make", "open_file", "owner_and_mode", "read_file",
           "tier_problem"]

_WHAT = "the local tier"


def base_problem(dir: Path) -> str | None:
    """(one rank, at setup) Why ``dir`` cannot hold the tier's directories safely, or None (also where it
    does not exist: :func:`lightning_asyncckpt.tiers.checks.directory` says that)."""
    return private_dirs.base_problem(dir, _WHAT, "give a directory of your own as dir=")


def tier_problem(dir: Path, parts: list[str]) -> str | None:
    """(one rank, at setup, before anything is written) Why an existing directory of the tier's own (``dir``
    joined with each of ``parts`` in turn) cannot be trusted, or None. Stops at the first that is missing."""
    me = os.geteuid()
    path = Path(dir)
    for name in parts:
        path = path / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            return f"{path} cannot be checked: {e}"
        if stat.S_ISLNK(st.st_mode):
            return (f"{path} is a symbolic link (to {os.readlink(path)!r}; {owner_and_mode(st)}): the tier never"
                    " follows a link in its own directories, which it reads code-bearing headers from. Fix: remove"
                    f" the link (`rm {path}`); the tier makes its own directory, mode 0700.")
        if not stat.S_ISDIR(st.st_mode):
            return f"{path} is not a directory ({owner_and_mode(st)}). Fix: remove it; the tier makes its own."
        if st.st_uid != me:
            return (f"{path} was not made by this job's user (uid {me}): {owner_and_mode(st)}. Another user could"
                    " have planted a step there (a header that runs code, weights of their choice). Fix: remove"
                    f" it (`rm -r {path}`, as its owner or root), or give another dir=; the tier makes its own"
                    " directories, mode 0700.")
        if st.st_mode & 0o022:
            return (f"{path} is writable by {private_dirs.who(st)} ({owner_and_mode(st)}): any of them could plant a step there."
                    f" Fix: `chmod 700 {path}` (the tier makes its directories 0700), or remove it.")
    return None


def make(path: Path, base: Path) -> None:
    """(any thread) Makes ``path`` and the directories between it and ``base``, each mode 0700, never through
    a link (:func:`lightning_asyncckpt.storage.private_dirs.make`). Raises :class:`UntrustedDirectoryError`."""
    private_dirs.make(path, base, _WHAT)


def open_file(path: Path, flags: int) -> int:
    """``os.open`` of one of the tier's files: never through a link (``O_NOFOLLOW``); a new file 0600."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    if flags & os.O_CREAT:
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:  # a umask took bits (or an old file): 0600 as .pt
                os.fchmod(fd, 0o600)
        except OSError:
            os.close(fd)
            raise
    return fd


def read_file(path: Path) -> bytes:
    """The bytes of one of the tier's files, never read through a link."""
    fd = open_file(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        return f.read()
