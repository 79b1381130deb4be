"""Directories of our own in shared places (``/tmp``, ``/dev/shm``, ``tempfile.gettempdir()``), trusted only
where this process's user made them, and made without following a link.

What the package reads back from such a directory (a remote save's spooled parts, which it uploads as the
checkpoint; a worker's results; a downloaded checkpoint) must be something only this user could have written.
Another local user can create a directory under a predictable name in a shared place before us, or plant a
symbolic link there pointing into a directory of theirs (or into one of ours they want us to write over):

- a shared base (``/tmp``) is usable if no one else can rename or replace what we make in it: owned by this
  user or root, and writable by group or others only with the sticky bit (:func:`base_problem`);
- below it, every directory is opened with ``O_NOFOLLOW`` from its parent's descriptor, made mode 0700 whatever
  the umask, and refused where it exists but is a link, another user's, or writable by group or others
  (:func:`make`). :class:`UntrustedDirectoryError` names the path, its owner and mode, and the fix.

The local tier (:mod:`lightning_asyncckpt.tiers.trusted_dirs`) applies the same rules to its own directories.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class UntrustedDirectoryError(PermissionError):
    """A directory of ours that another local user could have written, or a link."""


def owner_and_mode(st: os.stat_result) -> str:
    """``owner uid 65534 (nobody), mode 0755``: what a refusal says about a path."""
    try:
        import pwd

        name = pwd.getpwuid(st.st_uid).pw_name
    except (ImportError, KeyError):
        name = "no user name"
    return f"owner uid {st.st_uid} ({name}), mode {stat.S_IMODE(st.st_mode):04o}"


def who(st: os.stat_result) -> str:
    """``its group and others``: who besides the owner may write a directory of mode ``st``."""
    return " and ".join(w for w, bit in (("its group", 0o020), ("others", 0o002)) if st.st_mode & bit)


def base_problem(dir: Path, what: str = "the local tier", fix: str = "give a directory of your own") -> str | None:
    """(any rank) Why ``dir`` cannot hold directories that ``what`` makes in it safely, or None (also where it
    does not exist). ``fix``: how to choose another (``dir=``, ``TMPDIR``)."""
    me = os.geteuid()
    try:
        link = os.lstat(dir)
        st = os.stat(dir)
    except OSError:
        return None
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
        return (f"{dir} is a symbolic link of another user ({owner_and_mode(link)}), who can point it elsewhere"
                f" at any time. Fix: {fix} (the directory it points to, or one of your own).")
    shown = f"{dir}" if not stat.S_ISLNK(link.st_mode) else f"{dir} (a link to {os.path.realpath(dir)})"
    if st.st_uid not in (me, 0):
        return (f"{shown} belongs to another user ({owner_and_mode(st)}): its owner can rename or replace what"
                f" {what} makes in it, and so plant files that this job (uid {me}) would read. Fix: {fix},"
                " e.g. `mkdir -m 700 /dev/shm/$USER-ckpt` in the job script.")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"{shown} is writable by {who(st)} without the sticky bit ({owner_and_mode(st)}): any of them can"
                f" rename {what}'s directory and put their own in its place. Fix: `chmod go-w` it, or `chmod +t`"
                f" it (as /dev/shm and /tmp are), or {fix} (`mkdir -m 700`).")
    return None


def make(path: Path, base: Path, what: str = "the local tier") -> None:
    """(any thread) Makes ``path`` and the directories between it and ``base`` (which exists, opened as the
    user named it), each mode 0700; one that exists is opened without following a link and must be this
    user's and not writable by group or others (then it is made 0700 too). ``what`` makes them (for errors).
    Raises :class:`UntrustedDirectoryError` naming the path, or ``OSError``."""
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
                    st = os.lstat(name, dir_fd=fd)
                    raise UntrustedDirectoryError(
                        f"{here} is a symbolic link or not a directory ({owner_and_mode(st)}): {what} never follows"
                        f" a link in its own directories. Fix: remove it (`rm {here}`); {what} makes its own.") from None
                raise
            os.close(fd)
            fd = child
            st = os.fstat(fd)
            if st.st_uid != me or st.st_mode & 0o022:
                raise UntrustedDirectoryError(
                    f"{here} ({owner_and_mode(st)}) is not this user's own (uid {me}) or is writable by others:"
                    f" {what} does not use it, as another local user could have planted files there. Fix: remove"
                    f" it (`rm -r {here}`, as its owner or root); {what} makes its own, mode 0700.")
            if stat.S_IMODE(st.st_mode) != 0o700:  # made under a umask, or by an older version: private now
                os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def private_dir(base: Path, name: str, what: str, fix: str) -> Path:
    """(any rank) ``base / name``, a directory of this user's own, mode 0700, in the shared ``base``
    (``/tmp``): made if missing, never through a link. Raises :class:`UntrustedDirectoryError` naming the
    path, its owner and mode, and the fix (``fix``: how to choose another base) where ``base`` lets others
    replace it, or it exists but is a link, another user's, or writable by group or others."""
    base = Path(base)
    problem = base_problem(base, what, fix)
    if problem is not None:
        raise UntrustedDirectoryError(f"lightning-asyncckpt: {problem}")
    try:
        make(base / name, base, what)
    except UntrustedDirectoryError as e:
        raise UntrustedDirectoryError(f"lightning-asyncckpt: {e} Or {fix}.") from None
    return base / name
