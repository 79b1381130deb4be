"""Where a checkpoint goes: a :class:`Destination`, a local directory entry or an fsspec URL.

Every decision between local and remote storage is made here, once, when a path becomes a destination
(:func:`of`); the rest of the package asks the destination (``is_remote``, the hidden path a save is written
into, publish, discard, existence) and never looks at the path's type.

- :class:`LocalDestination`: a local or mounted path (``file://`` URLs included). A save is written into a
  hidden sibling (``.asyncckpt-incomplete-*``, :mod:`~lightning_asyncckpt.storage.commit`) and published by
  an atomic rename; an NFS-style replace goes through an aside name.
- :class:`RemoteDestination`: any other fsspec URL (``s3://``, ``gs://``, ``memory://``, ...). A file is
  written at its URL, visible only once the upload completes; a DCP directory is written into this node's
  local spool first, uploaded by its worker, and published by uploading ``.metadata`` last
  (:mod:`~lightning_asyncckpt.storage.remote`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Protocol

from lightning_asyncckpt.storage import commit, remote


class Destination(Protocol):
    """A checkpoint's place in storage, as every rank and the trainer's threads name it."""

    @property
    def location(self) -> Path | str:
        """How saves, records, logs and the worker name it: a local ``Path``, or the URL as a ``str``."""
        ...

    @property
    def is_remote(self) -> bool:
        """Whether it is in an object store (no rename; the training thread does no I/O there)."""
        ...

    def parent(self) -> Destination:
        """The directory it is in."""
        ...

    def exists(self) -> bool:
        """(any rank) Whether something is there now."""
        ...

    def is_directory(self) -> bool:
        """(any rank) Whether a directory (a DCP checkpoint, or a prefix of objects) is there now."""
        ...

    def check_for_save(self, writes_file: bool) -> None:
        """(the saving rank, at the save call) A clear error now for a path a save cannot replace: an
        unknown scheme or a missing fsspec backend, a directory that is not a checkpoint where a file goes,
        a regular file where a DCP directory goes."""
        ...

    def open_directory(self, rank: int, token: str) -> Path | None:
        """(writing ranks, once per directory and run; on the directory's destination) Makes it ready for
        saves: made if missing, and (rank 0) dead saves' leftovers removed except the run ``token``'s; a
        bucket checked to exist instead.

        Returns:
            The local spool its directory saves are written into first (its leftovers are the caller's to
            sweep, once per node and run), or None where saves are written beside their target.
        """
        ...

    def temp_path(self, name: str, writes_file: bool, rank: int | None = None) -> Path | str:
        """The hidden path a save named ``name`` (unique to the run and save) is written into: a hidden
        sibling of the target; a remote file's URL itself (invisible until its upload completes); a remote
        directory's spool directory (per ``rank`` for a part of a collective save)."""
        ...

    def upload_from(self, tmp: Path | str) -> tuple[str, str] | None:
        """What the worker uploads once it wrote a DCP directory into ``tmp``: ``(tmp, url)``, else None."""
        ...

    def publish(self, tmp: Path | str, writes_file: bool) -> None:
        """(the coordinator) Makes the complete save in ``tmp`` visible here: an atomic rename (replacing
        what is there in one step); for a remote directory the upload of its ``.metadata``; nothing for a
        remote file (visible once uploaded)."""
        ...

    def discard(self, what: str) -> bool:
        """(this rank; a remote one off the training thread) Removes what is here, logging a failure as
        ``what``; never raises.

        Returns:
            Whether it is gone.
        """
        ...

    def localize(self) -> contextlib.AbstractContextManager[Path]:
        """(any rank, to load) The checkpoint as a local path: itself, or a temporary local copy of a
        remote one (removed afterwards)."""
        ...


class LocalDestination:
    """A local or mounted path."""

    is_remote = False

    def __init__(self, path: Path) -> None:
        self.path = path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LocalDestination) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    def __repr__(self) -> str:
        return f"LocalDestination({str(self.path)!r})"

    @property
    def location(self) -> Path:
        return self.path

    def parent(self) -> LocalDestination:
        return LocalDestination(self.path.parent)

    def exists(self) -> bool:
        return self.path.exists()

    def is_directory(self) -> bool:
        return self.path.is_dir()

    def check_for_save(self, writes_file: bool) -> None:
        path = self.path
        if writes_file and path.is_dir() and not path.is_symlink() and not (path / ".metadata").is_file():
            raise IsADirectoryError(
                f"Cannot save a checkpoint file at {str(path)!r}: it is a directory that is not a checkpoint."
                " Save to another path, or remove the directory."
            )
        if not writes_file and path.is_file() and not path.is_symlink():
            raise FileExistsError(
                f"`AsyncCheckpointIO(format='dcp')` saves checkpoints as directories, but {str(path)!r} is an"
                " existing regular file. Remove it, save to another path, or use `format='auto'` (files, as"
                " stock Lightning)."
            )

    def open_directory(self, rank: int, token: str) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            commit.cleanup_leftovers(self.path, keep_prefix=commit.tmp_for(self.path, token).name)
        return None

    def temp_path(self, name: str, writes_file: bool, rank: int | None = None) -> Path:
        return commit.tmp_for(self.path, name)

    def upload_from(self, tmp: Path | str) -> None:
        return None

    def publish(self, tmp: Path | str, writes_file: bool) -> None:
        (commit.publish_file if writes_file else commit.publish)(Path(tmp), self.path)

    def discard(self, what: str) -> bool:
        return commit.try_remove(self.path, what)

    def localize(self) -> contextlib.AbstractContextManager[Path]:
        return contextlib.nullcontext(self.path)


class RemoteDestination:
    """An fsspec URL that is not a local file."""

    is_remote = True

    def __init__(self, url: str) -> None:
        self.url = url

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemoteDestination) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __repr__(self) -> str:
        return f"RemoteDestination({self.url!r})"

    @property
    def location(self) -> str:
        return self.url

    def parent(self) -> RemoteDestination:
        return RemoteDestination(remote.parent(self.url))

    def exists(self) -> bool:
        remote.forget(self.url)
        fs, inner = remote.filesystem(self.url, writing=False)
        return fs.exists(inner)

    def is_directory(self) -> bool:
        remote.forget(self.url)  # the worker (another process) may have replaced it
        fs, inner = remote.filesystem(self.url, writing=False)
        return fs.isdir(inner)

    def check_for_save(self, writes_file: bool) -> None:
        remote.filesystem(self.url)  # an unknown scheme or a missing backend: a clear error now

    def open_directory(self, rank: int, token: str) -> Path:
        remote.check_directory(self.url)  # a missing bucket is an error here, at save time
        return remote.spool_root()

    def temp_path(self, name: str, writes_file: bool, rank: int | None = None) -> Path | str:
        if writes_file:
            return self.url
        # a spool directory is per rank: the ranks of one node share the spool root
        return commit.tmp_for(remote.spool_root() / "x", name if rank is None else f"{name}-r{rank}")

    def upload_from(self, tmp: Path | str) -> tuple[str, str]:
        return str(tmp), self.url

    def publish(self, tmp: Path | str, writes_file: bool) -> None:
        if not writes_file:  # a file was visible once uploaded; a directory once its .metadata is
            remote.publish_metadata(Path(tmp), self.url)

    def discard(self, what: str) -> bool:
        return remote.remove(self.url, what)

    def localize(self) -> contextlib.AbstractContextManager[Path]:
        return remote.localize(self.url)


def of(path: object) -> LocalDestination | RemoteDestination:
    """The destination ``path`` names: a ``str`` or ``os.PathLike``, a local path (``file://`` URLs
    included) or an fsspec URL. A clear error for any other type."""
    try:
        text = os.fspath(path)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"lightning-asyncckpt: a checkpoint path must be a str or os.PathLike (a local path or an"
                        f" fsspec URL such as s3://bucket/ckpt); got {type(path).__name__} {_short(path)}") from None
    if isinstance(text, bytes):
        text = text.decode()
    return RemoteDestination(text) if remote.is_remote(text) else LocalDestination(local_path(text))


def local_path(path: object) -> Path:
    """A local or mounted path (``file://`` URLs included); a clear error for other URLs."""
    text = os.fspath(path)  # type: ignore[call-overload]
    if isinstance(text, bytes):
        text = text.decode()
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        raise ValueError(f"{text!r} is a remote URL; this operation takes a local or mounted path.")
    return Path(text)


def plain_path(path: object) -> Path | None:
    """``path`` as a ``Path`` where it is a ``str`` or ``Path`` with no URL scheme (``file://`` included),
    else None: for the checks that only a plain local name can pass."""
    if not isinstance(path, (str, Path)) or "://" in str(path):
        return None
    return Path(path)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

