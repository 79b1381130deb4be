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

import contextlib
import errno
import os
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class UntrustedDirectoryError(PermissionError):
    """A directory of the local tier that another local user could have written, or a link."""


def owner_and_mode(st: os.stat_result) -> str:
    """``uid 65534 (nobody), mode 0755``: what a refusal says about a path."""
    try:
        import pwd

        name = pwd.getpwuid(st.st_uid).pw_name
    except (ImportError, KeyError):
        name = "no user name"
    return f"owner uid {st.st_uid} ({name}), mode {stat.S_IMODE(st.st_mode):04o}"


def base_problem(dir: Path) -> str | None:
    """(one rank, at setup) Why ``dir`` cannot hold the tier's directories safely, or None (also where it
    does not exist: :func:`lightning_asyncckpt.tiers.checks.directory` says that)."""
    me = os.geteuid()
    try:
        link = os.lstat(dir)
        st = os.stat(dir)
    except OSError:
        return None
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
        return (f"{dir} is a symbolic link of another user ({owner_and_mode(link)}), who can point it elsewhere"
                " at any time. Fix: give the directory it points to (or one of your own) as dir=.")
    shown = f"{dir}" if not stat.S_ISLNK(link.st_mode) else f"{dir} (a link to {os.path.realpath(dir)})"
    if st.st_uid not in (me, 0):
        return (f"{shown} belongs to another user ({owner_and_mode(st)}): its owner can rename or replace what the"
                f" tier makes in it, and so plant a checkpoint that this job (uid {me}) would resume from. Fix: a"
                " directory of your own, e.g. `mkdir -m 700 /dev/shm/$USER-ckpt` in the job script.")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"{shown} is writable by {_who(st)} without the sticky bit ({owner_and_mode(st)}): any of them can"
                " rename the tier's directory and put their own in its place. Fix: `chmod go-w` it, or `chmod +t`"
                " it (as /dev/shm and /tmp are), or give a directory of your own below it (`mkdir -m 700`).")
    return None


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
            return (f"{path} is writable by {_who(st)} ({owner_and_mode(st)}): any of them could plant a step there."
                    f" Fix: `chmod 700 {path}` (the tier makes its directories 0700), or remove it.")
    return None


def _who(st: os.stat_result) -> str:
    return " and ".join(w for w, bit in (("its group", 0o020), ("others", 0o002)) if st.st_mode & bit)


def make(path: Path, base: Path) -> None:
    """(any thread) Makes ``path`` and the directories between it and ``base`` (which exists, opened as the
    user named it), each mode 0700; one that exists is opened without following a link and must be this
    user's and not writable by group or others (then it is made 0700 too). Raises
    :class:`UntrustedDirectoryError` naming the path, or ``OSError``."""
    path, base = Path(path), Path(base)
    me = os.geteuid()
    fd = os.open(base, _DIR_FLAGS)
    try:
        here = base
        for name in path.relative_to(base).parts:
            here = here / name
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=fd)
            try:
                child = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UntrustedDirectoryError(
                        f"{here} is a symbolic link or not a directory: the local tier never follows a link in its"
                        f" own directories. Fix: remove it (`rm {here}`); the tier makes its own.") from None
                raise
            os.close(fd)
            fd = child
            st = os.fstat(fd)
            if st.st_uid != me or st.st_mode & 0o022:
                raise UntrustedDirectoryError(
                    f"{here} ({owner_and_mode(st)}) is not this user's own (uid {me}) or is writable by others: the"
                    f" local tier does not use it. Fix: remove it (`rm -r {here}`); the tier makes its own, 0700.")
            if stat.S_IMODE(st.st_mode) != 0o700:  # made under a umask, or by an older version: private now
                os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


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
