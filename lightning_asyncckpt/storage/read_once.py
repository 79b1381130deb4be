"""Read-once resume: with ``W`` ranks loading the same checkpoint together (Lightning's resume and Fabric's
``load`` run on every rank), each rank reads about ``1/W`` of its bytes from the shared storage (one
contiguous byte range, ``os.preadv`` straight into the final buffer; at an fsspec URL, one ranged read) and
the ranks exchange the rest over the job's process group (:mod:`~lightning_asyncckpt.collectives.shares`).
The shared storage serves each byte once per resume instead of ``W`` times: a ``torch.save`` file
(:func:`read_together`, :func:`read_url_together`) or every file of a checkpoint directory
(:func:`read_directory_together`, ``AsyncDDPStrategy``'s, loaded from a private local copy: :func:`local_copy`).

What every rank then holds is the whole file in memory: the load goes on from those bytes as from the file
(the CRC32 of every record checked on them, ``weights_only`` as asked). Where the exchange cannot run, the
caller reads the file as before, after one log line saying why: no process group, a world of one, ranks that
disagree on the path or the file's size (or cannot open it), or a rank whose read of its share failed.

Memory: each rank holds the file's bytes (plus under ``W`` bytes of padding) and one round's chunks
(:func:`~lightning_asyncckpt.collectives.shares.chunk_for`); the load then builds the state from them, so the
peak while loading is the file plus the state, as for a load from any in-memory buffer. A directory's
files are written to a private temporary directory (``TMPDIR``) and the buffer released before the load.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from lightning_asyncckpt.collectives import groups, shares
from lightning_asyncckpt.storage import commit
from lightning_asyncckpt.storage.regular_files import CorruptCheckpointError, open_regular

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedRead:
    """The file's bytes on this rank after a read-once exchange.

    Attributes:
        data: the file's bytes, in memory.
        read: the bytes this rank read from the storage itself (its share).
        world: the ranks that shared the read.
        rounds: the exchange's rounds.
    """

    data: memoryview
    read: int
    world: int
    rounds: int


@dataclass(frozen=True)
class Wanted:
    """What one rank means to read, compared across the ranks before anything is read: the path, its files'
    names and sizes in order (one file: one unnamed entry), or why this rank cannot read it.

    Attributes:
        where: the path or URL, as this rank names it.
        files: (name, size) of each file, in the order of the shared byte range.
        problem: why this rank cannot read it (then every rank reads as before), or None.
    """

    where: str
    files: tuple[tuple[str, int], ...] = ()
    problem: str | None = None

    @property
    def size(self) -> int:
        """The bytes of all the files together."""
        return sum(n for _, n in self.files)

    def offsets(self) -> list[int]:
        """Where each file begins in the shared byte range."""
        out, at = [], 0
        for _, n in self.files:
            out.append(at)
            at += n
        return out


def read_together(path: Path) -> SharedRead | None:
    """(all ranks of the default group, together, the same ``path``: a load that Lightning or Fabric runs on
    every rank) The file's bytes, each rank reading its share once and receiving the others'; None, after one
    log line saying why, where the exchange cannot run (then every rank returns None alike and reads the
    file as before). An error of the process group during the exchange (a rank gone) is raised on the ranks
    left, within the group's timeout.

    Args:
        path: a local ``torch.save`` file (a regular file: checked as it is opened).

    Returns:
        the bytes and what this rank read, or None."""
    world = _world(path)
    if world <= 1:
        return None
    try:
        f = open_regular(path)
    except (OSError, CorruptCheckpointError) as e:
        f, wanted = None, Wanted(os.fspath(path), problem=f"cannot open it: {type(e).__name__}")
    else:
        wanted = Wanted(os.fspath(path), (("", os.fstat(f.fileno()).st_size),))
    try:
        got = _exchange(wanted, world, lambda into, at: _read_range(f.fileno(), into, at))  # type: ignore[union-attr]
        return None if got is None else SharedRead(got[0], got[1], world, got[2])
    finally:
        if f is not None:
            f.close()


def read_url_together(url: str) -> SharedRead | None:
    """(all ranks of the default group, together, the same ``url``) :func:`read_together` for a ``torch.save``
    file at an fsspec URL (an object store): each rank fetches its byte range (``cat_file`` with a start and an
    end: one ranged GET on S3) and receives the rest from the others."""
    from lightning_asyncckpt.storage import remote

    world = _world(url)
    if world <= 1:
        return None
    fs, inner = None, ""
    try:
        fs, inner = remote.filesystem(url, writing=False)
        fs.invalidate_cache(inner)
        wanted = Wanted(url, (("", int(fs.size(inner))),))
    except Exception as e:  # noqa: BLE001 - any backend's error: every rank then reads as before, which says it
        wanted = Wanted(url, problem=f"cannot find its size: {type(e).__name__}")

    def read_share(into: memoryview, start: int) -> str | None:
        if not len(into):
            return None
        try:
            data = fs.cat_file(inner, start=start, end=start + len(into))  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - any backend's error
            return f"{type(e).__name__}: {e}"
        if len(data) != len(into):
            return f"{len(data)} bytes at {start}, not {len(into)}"
        into[:] = data
        return None

    got = _exchange(wanted, world, read_share)
    return None if got is None else SharedRead(got[0], got[1], world, got[2])


@dataclass(frozen=True)
class SharedFiles:
    """The files of a checkpoint directory on this rank after a read-once exchange.

    Attributes:
        files: each file's bytes, by its name in the directory.
        read: the bytes this rank read from the storage itself (its share of all files).
        world: the ranks that shared the read.
    """

    files: dict[str, memoryview]
    read: int
    world: int


def read_directory_together(path: Path) -> SharedFiles | None:
    """(all ranks of the default group, together, the same ``path``) Every file of the checkpoint directory
    ``path`` (``AsyncDDPStrategy``'s: its items' shard files, ``.metadata``, the skeleton), read once across the
    ranks as :func:`read_together` reads one file: the files, in name order, are one byte range of which each
    rank reads its share. None, after one log line, where :func:`read_together` would fall back, and for a
    directory holding anything but regular files (a subdirectory, a link: the checks of the usual read name it).

    Args:
        path: a local, committed checkpoint directory.

    Returns:
        each file's bytes and what this rank read, or None."""
    world = _world(path)
    if world <= 1:
        return None
    wanted = _listing(path)
    offsets = wanted.offsets()

    def read_share(into: memoryview, start: int) -> str | None:
        for (name, size), offset in zip(wanted.files, offsets):  # the files overlapping [start, start + len(into))
            lo, hi = max(start, offset), min(start + len(into), offset + size)
            if lo >= hi:
                continue
            try:
                with open_regular(path / name, follow=False) as f:
                    problem = _read_range(f.fileno(), into[lo - start:hi - start], lo - offset)
            except (OSError, CorruptCheckpointError) as e:
                problem = str(e)
            if problem is not None:
                return f"{name}: {problem}"
        return None

    got = _exchange(wanted, world, read_share)
    if got is None:
        return None
    data, read, _ = got
    files = {name: data[offset:offset + size] for (name, size), offset in zip(wanted.files, offsets)}
    return SharedFiles(files, read, world)


def _listing(path: Path) -> Wanted:
    """The directory's files and sizes in name order, or why it cannot be read together."""
    where = os.fspath(path)
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
        if any(not e.is_file(follow_symlinks=False) for e in entries):
            return Wanted(where, problem="it holds something other than regular files")
        if not any(e.name == commit.METADATA_FILE for e in entries):
            return Wanted(where, problem=f"not a complete checkpoint (no {commit.METADATA_FILE})")
        return Wanted(where, tuple((e.name, e.stat(follow_symlinks=False).st_size) for e in entries))
    except OSError as e:
        return Wanted(where, problem=f"cannot list it: {type(e).__name__}")


def _world(path: Path | str) -> int:
    """The ranks that would share the read of ``path``; 1 (after one log line saying why) where none would."""
    world = groups.world_size() if groups.is_distributed() else 1
    if world <= 1:
        why = "no process group" if not groups.is_distributed() else "a world of one rank"
        log.info("lightning-asyncckpt: %s read by this rank alone (%s)", path, why)
    return world


def _exchange(wanted: Wanted, world: int,
              read_share: Callable[[memoryview, int], str | None]) -> tuple[memoryview, int, int] | None:
    """(all ranks of the default group, together) Agrees on ``wanted``, reads this rank's share of its byte
    range with ``read_share(into, offset)`` (what went wrong, or None), and exchanges: (the bytes, what this
    rank read, the rounds); or None, after one log line saying why every rank reads alone."""
    seen = shares.all_same(wanted)
    if any(other != wanted for other in seen):
        log.warning("lightning-asyncckpt: %s read by every rank alone: the ranks disagree on it (%s)",
                    wanted.where, shares.describe([(w.where, w.size, w.problem) for w in seen]))
        return None
    if wanted.problem is not None:  # every rank alike: the usual read says what is wrong
        log.warning("lightning-asyncckpt: %s read by every rank alone: %s", wanted.where, wanted.problem)
        return None
    size = wanted.size
    share = shares.share_of(size, world)
    buffer = bytearray(world * share)
    me = groups.rank()
    start, end = min(me * share, size), min((me + 1) * share, size)
    problem = read_share(memoryview(buffer)[start:end], start)
    if shares.any_failed(problem is not None):
        log.warning("lightning-asyncckpt: %s read by every rank alone: a rank could not read its share%s",
                    wanted.where, f" (this rank: {problem})" if problem else "")
        return None
    rounds = shares.exchange(buffer, size)
    return memoryview(buffer)[:size], end - start, rounds


def _read_range(fd: int, into: memoryview, offset: int) -> str | None:
    """Reads ``len(into)`` bytes of the open file ``fd`` at ``offset`` into ``into``; what went wrong, or None."""
    done = 0
    try:
        while done < len(into):
            n = os.preadv(fd, [into[done:]], offset + done)
            if n == 0:
                return f"the file ended at byte {offset + done}, before its agreed size"
            done += n
    except OSError as e:
        return f"{e.strerror or e}"
    return None


@contextlib.contextmanager
def local_copy(path: Path, shared: SharedFiles) -> Iterator[Path]:
    """(any rank, to load) The directory ``path`` rebuilt from ``shared`` in a private temporary directory
    (``mkdtemp``: this user's alone; new regular files only), removed afterwards: the usual reader and its
    checks then run on the bytes exchanged, as on a remote checkpoint's local copy. The exchanged buffer is
    released once written, so the bytes are held once."""
    tmp = Path(tempfile.mkdtemp(prefix="asyncckpt-read-once-"))
    try:
        local = tmp / (path.name or "checkpoint")
        local.mkdir()
        for name, data in shared.files.items():
            fd = os.open(local / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            data.release()
        yield local
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
