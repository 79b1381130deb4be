"""Integrity of a checkpoint before it is used: the one set of checks that both the loads (``ckpt_path=``,
``AsyncCheckpointIO.load_checkpoint``, ``fabric.load`` through the package's strategies) and the CLI's ``verify``
run, so that the two cannot disagree.

- A ``torch.save`` file (and each DCP item, and the skeleton and ``meta.pt`` beside them) is a zip archive whose
  central directory holds each record's size and CRC32. ``torch.load`` checks none of them: a flipped bit in a
  weight loads silently. :func:`scan_torch_zip` reads every record where torch's own reader finds it and checks
  it against its CRC32 (ISA-L where installed: about 20 GB/s from the page cache, through a memory map: no copy).
- A DCP directory's ``.metadata`` names the file and byte range of each item. A crafted one could point outside
  the checkpoint (an absolute path, ``..``, a symlink) or at a FIFO or device, which would block the reader or
  read another file: :func:`shard_path` accepts only a regular file inside the directory, and every file is
  opened with ``O_NONBLOCK`` (and ``O_NOFOLLOW`` inside a checkpoint) and checked with ``fstat`` before a read.
- This package's replicated layouts keep the checkpoint's structure in a skeleton file: one that is missing or
  damaged is refused instead of loading a dict of the wrong shape.

Checking costs one pass of CRC32 over the checkpoint's bytes as they lie in the page cache (measured with
``benchmarks/bench_verify_load.py``); ``AsyncCheckpointIO(verify_on_load=False)`` turns the CRC32 part off (the
path checks stay). A problem is raised as :class:`CorruptCheckpointError`, naming the file and the record or item.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import stat
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from lightning_asyncckpt.format import commit

META_FILE = "meta.pt"
ZIP_MAGIC = b"PK\x03\x04"
_CHUNK = 16 << 20
_REPLICATED_LAYOUTS = ("single-writer", "distributed")  # layouts whose structure is the skeleton file


def _crc32() -> Callable[..., int]:
    try:
        from isal import isal_zlib

        return isal_zlib.crc32
    except ImportError:
        return zlib.crc32


crc32 = _crc32()


class CorruptCheckpointError(RuntimeError):
    """A checkpoint that must not be used: a record or item that does not match its CRC32 or size, a missing or
    damaged part, or a path that leads outside the checkpoint or to something other than a regular file. The
    message names the file and the record or item."""


class ArchiveError(ValueError):
    """A ``torch.save`` payload whose zip archive cannot be opened at all (no record was checked)."""


@dataclass
class ZipCheck:
    """Outcome of :func:`scan_torch_zip`: ``bad`` names each record that is not what the archive says."""

    records: int = 0
    crc_checked: int = 0  # records that carry a CRC32 (all, unless written with CRC32 turned off)
    bytes_read: int = 0
    bad: list[str] = field(default_factory=list)


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


# -- opening without following links out or blocking ----------------------------------------------------------
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


def shard_path(root: Path, rel: Any) -> Path:
    """The file ``rel`` (a ``relative_path`` of ``.metadata``) inside the checkpoint directory ``root``; raises
    :class:`CorruptCheckpointError` for an absolute path, ``..``, or a path that resolves outside ``root``."""
    where = f"{root / commit.METADATA_FILE}: the item path {rel!r}"
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise CorruptCheckpointError(f"{where} is not a file name")
    if os.path.isabs(rel) or ".." in Path(rel).parts or rel in (".",):
        raise CorruptCheckpointError(f"{where} leads outside the checkpoint directory {root}")
    path = root / rel
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(path.parent)]) != real_root:
        raise CorruptCheckpointError(f"{where} leads outside the checkpoint directory {root}")
    return path


# -- zip archives ----------------------------------------------------------------------------------------------
class _View(io.RawIOBase):
    """A seekable file over bytes in memory (a memory map's), without copying them."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.view)}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), len(self.view) - self.pos))
        buffer[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n


@contextlib.contextmanager
def mapped(f: BinaryIO) -> Iterator[memoryview | None]:
    """The whole open file as a read-only memoryview (its pages, no copy), or None where it cannot be mapped."""
    try:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    except (OSError, ValueError):  # an empty file, or a filesystem without mmap
        yield None
        return
    view = memoryview(mm)
    try:
        yield view
    finally:
        view.release()
        mm.close()


def scan_torch_zip(data: bytes | memoryview | BinaryIO) -> ZipCheck:
    """Reads every record of a ``torch.save`` payload (in memory, or an open file: through a memory map, else in
    chunks) from where torch's own reader finds it (the bytes ``torch.load`` uses) and checks it against the
    size and CRC32 of the archive's central directory. Raises :class:`ArchiveError` if the archive cannot be
    opened; ``OSError`` if the file cannot be read."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return _scan(_View(memoryview(data)), memoryview(data))
    with mapped(data) as view:
        return _scan(_View(view), view) if view is not None else _scan(data, None)


def _scan(f: Any, view: memoryview | None) -> ZipCheck:
    import torch

    try:
        with zipfile.ZipFile(f) as zf:
            directory = {m.filename.split("/", 1)[-1]: m for m in zf.infolist()}
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - BadZipFile, or any error of a damaged archive's fields
        raise ArchiveError(f"damaged zip directory ({first_line(e)})") from None
    try:
        f.seek(0)  # torch's reader reads the archive from where the file is
        reader = torch._C.PyTorchFileReader(f)
        names = reader.get_all_records()
    except Exception as e:  # noqa: BLE001
        raise ArchiveError(f"torch cannot open it ({first_line(e)})") from None
    if sorted(names) != sorted(directory):
        raise ArchiveError(f"torch reads the records {sorted(names)}, the zip directory lists {sorted(directory)}")
    check = ZipCheck(records=len(names))
    for name in names:
        member = directory[name]
        try:
            size, crc = _read_record(reader, f, view, name, member)
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001
            check.bad.append(f"record {name!r} cannot be read ({first_line(e)})")
            continue
        check.bytes_read += size
        if size != member.file_size:
            check.bad.append(f"record {name!r} has {size} bytes, the zip directory says {member.file_size}")
        elif member.CRC:
            check.crc_checked += 1
            if crc != member.CRC:
                check.bad.append(f"record {name!r} does not match its CRC32: its bytes changed after the save")
    return check


def _read_record(reader: Any, f: Any, view: memoryview | None, name: str, member: zipfile.ZipInfo) -> tuple[int, int]:
    """(size, CRC32) of the record ``name`` as torch reads it: a stored record (as torch writes them) from the
    offset torch's reader gives (what ``torch.load(mmap=True)`` maps), else the whole record."""
    if member.compress_type != zipfile.ZIP_STORED or not hasattr(reader, "get_record_offset"):
        record = reader.get_record(name)
        return len(record), zlib.crc32(record)
    offset = reader.get_record_offset(name)
    if view is not None:
        data = view[offset:offset + member.file_size]
        try:
            return len(data), crc32(data)
        finally:
            data.release()
    f.seek(offset)
    size, crc, left = 0, 0, member.file_size
    while left > 0:
        chunk = f.read(min(left, _CHUNK))
        if not chunk:
            break
        size, crc, left = size + len(chunk), zlib.crc32(chunk, crc), left - len(chunk)
    return size, crc


def is_torch_zip(path: Path) -> bool:
    """Whether the regular file ``path`` begins like a ``torch.save`` zip archive (False if it cannot be read)."""
    try:
        with open_regular(path) as f:
            return f.read(4) == ZIP_MAGIC
    except (OSError, CorruptCheckpointError):
        return False


def check_file(path: Path, crc: bool = True) -> ZipCheck | None:
    """(any rank, before a ``torch.save`` file is loaded) Refuses a path that is not a regular file (a FIFO would
    block the load), and with ``crc`` every zip record that does not match its size and CRC32; raises
    :class:`CorruptCheckpointError` naming the file and the record. A legacy (non-zip) file has nothing to check."""
    with open_regular(path) as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise CorruptCheckpointError(f"{path}: empty (0 bytes): truncated, or never written")
        if not crc or f.read(4) != ZIP_MAGIC:
            return None  # a legacy file or not a checkpoint at all: torch.load says which
        try:
            check = scan_torch_zip(f)
        except ArchiveError as e:
            raise CorruptCheckpointError(f"{path}: corrupt: {e}; the file ({os.fstat(f.fileno()).st_size} bytes) "
                                         "is truncated or damaged") from None
    if check.bad:
        more = f" (and {len(check.bad) - 1} more)" if len(check.bad) > 1 else ""
        raise CorruptCheckpointError(f"{path}: corrupt: {check.bad[0]}{more}")
    return check


# -- DCP directories -------------------------------------------------------------------------------------------
@dataclass
class ItemsCheck:
    """Outcome of :func:`check_items`: counters for ``verify``'s summary, and every problem found."""

    items: int = 0
    files: int = 0
    bytes_read: int = 0
    crc_checked: int = 0
    problems: list[str] = field(default_factory=list)


def decode(path: Path, info: Any, raw: bytes | memoryview) -> bytes | memoryview:
    """The item's bytes after DCP's storage transforms (none unless an extension wrote it)."""
    descriptors = getattr(info, "transform_descriptors", None)
    if not descriptors:
        return raw
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    stream = io.BytesIO(bytes(raw))
    return FileSystemReader(str(path)).transforms.transform_load_stream(None, descriptors, stream).read()


def _item_problem(path: Path, storage: Any, raw: memoryview, check: ItemsCheck, crc: bool) -> str | None:
    try:
        data = decode(path, storage, raw)
    except Exception as e:  # noqa: BLE001
        return f"cannot undo the storage transforms {storage.transform_descriptors} ({first_line(e)})"
    if bytes(data[:4]) != ZIP_MAGIC:  # DCP's planner writes tensors and objects alike with torch.save
        return "corrupt (not a torch.save payload: no zip header)"
    if not crc:
        return None
    try:
        scan = scan_torch_zip(data)
    except ArchiveError as e:
        return f"corrupt: {e}"
    check.crc_checked += scan.crc_checked > 0
    return f"corrupt: {scan.bad[0]}" if scan.bad else None


def check_items(path: Path, metadata: Any, crc: bool = True,
                on_item: Callable[[Any, Any, memoryview], str | None] | None = None) -> ItemsCheck:
    """Every item of the DCP directory ``path``: its file is a regular file inside ``path`` (:func:`shard_path`),
    its byte range lies within the file, it is a ``torch.save`` archive and (``crc``) its records match their
    CRC32; then ``on_item(index, storage, bytes)`` (``verify``'s deserialization) may name another problem.
    Problems name the file and the item."""
    check = ItemsCheck()
    by_file: dict[str, list[tuple[Any, Any]]] = {}
    for index, storage in metadata.storage_data.items():
        if not isinstance(storage.offset, int) or not isinstance(storage.length, int) or storage.offset < 0 \
                or storage.length < 0:
            check.problems.append(f"{path / commit.METADATA_FILE}: item {index.fqn!r} has the byte range "
                                  f"{storage.offset!r}+{storage.length!r}")
            continue
        by_file.setdefault(storage.relative_path, []).append((index, storage))
    for rel, entries in sorted(by_file.items(), key=lambda e: str(e[0])):
        entries.sort(key=lambda e: e[1].offset)
        _check_file_items(path, rel, entries, check, crc, on_item)
    return check


def _check_file_items(path: Path, rel: Any, entries: list, check: ItemsCheck, crc: bool, on_item: Any) -> None:
    try:
        shard = shard_path(path, rel)
        f = open_regular(shard, follow=False)
    except (OSError, CorruptCheckpointError) as e:
        names = ", ".join(repr(i.fqn) for i, _ in entries[:3]) + (", ..." if len(entries) > 3 else "")
        reason = str(e) if isinstance(e, CorruptCheckpointError) else f"{path / str(rel)}: {e.strerror or e}"
        check.problems.append(f"{reason} (it holds the items {names})")
        return
    check.files += 1
    with f, mapped(f) as view:
        size = os.fstat(f.fileno()).st_size
        for index, storage in entries:
            check.items += 1
            where = f"{shard}: item {index.fqn!r}"
            end = storage.offset + storage.length
            if end > size:
                check.problems.append(f"{where}: truncated (needs bytes {storage.offset}..{end}, the file has {size})")
                continue
            raw = view[storage.offset:end] if view is not None else memoryview(b"")
            check.bytes_read += len(raw)
            try:
                problem = _item_problem(path, storage, raw, check, crc)
                if problem is None and on_item is not None:
                    problem = on_item(index, storage, raw)
            except Exception as e:  # noqa: BLE001 - e.g. metadata fields of the wrong type
                problem = f"cannot be checked ({type(e).__name__}: {e})"
            finally:
                raw.release()
            if problem is not None:
                check.problems.append(f"{where}: {problem}")


def side_file_problems(path: Path, crc: bool = True) -> list[str]:
    """The files beside the items that a load reads: the skeleton (required where this package's
    ``.asyncckpt.json`` names a replicated layout: without it the load would give a dict of the wrong shape) and
    ``meta.pt``; each must be a regular file in ``path`` that is a sound ``torch.save`` archive."""
    problems = []
    layout = _layout(path)
    for name, required in ((commit.SKELETON_FILE, layout in _REPLICATED_LAYOUTS), (META_FILE, False)):
        file = path / name
        if not os.path.lexists(file):
            if required:
                problems.append(f"{file}: missing: this {layout} checkpoint's structure is in it, it cannot be "
                                "loaded without it")
            continue
        try:
            with open_regular(file, follow=False) as f:
                if f.read(4) != ZIP_MAGIC:
                    raise ArchiveError("not a torch.save file (no zip header)")
                if crc:
                    bad = scan_torch_zip(f).bad
                    if bad:
                        raise ArchiveError(bad[0])
        except CorruptCheckpointError as e:
            problems.append(str(e))
        except (OSError, ArchiveError) as e:
            problems.append(f"{file}: corrupt: {getattr(e, 'strerror', None) or e}")
    return problems


def _layout(path: Path) -> str | None:
    """The layout ``.asyncckpt.json`` names (read without blocking or following a link), or None."""
    info = commit.read_info(path)
    return info.get("layout") if info is not None else None


def check_directory(path: Path, metadata: Any, crc: bool = True) -> None:
    """(any rank, before a DCP directory is loaded) :func:`check_items` and :func:`side_file_problems`; raises
    :class:`CorruptCheckpointError` naming the file and the item (and how many more problems there are)."""
    problems = check_items(path, metadata, crc).problems + side_file_problems(path, crc)
    if problems:
        more = f" (and {len(problems) - 1} more problems: `lightning-asyncckpt verify {path}` lists them)" \
            if len(problems) > 1 else ""
        raise CorruptCheckpointError(f"{problems[0]}{more}")


def check_path(path: Path, crc: bool = True, allow_pickle: bool = False) -> None:
    """(any rank, before a local checkpoint that another reader will load is used) :func:`check_directory` for a
    committed DCP directory (its ``.metadata`` read as :func:`~lightning_asyncckpt.format.metadata.read_metadata`
    does), :func:`check_file` for anything else that exists; a missing path is left to the reader's error."""
    from lightning_asyncckpt.format.metadata import read_metadata

    path = Path(path)
    if path.is_dir():
        if commit.is_committed(path):
            check_directory(path, read_metadata(path, allow_pickle=allow_pickle), crc=crc)
    elif os.path.lexists(path):
        check_file(path, crc=crc)
