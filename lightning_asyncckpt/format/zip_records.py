"""The records of a ``torch.save`` zip archive checked against their sizes and CRC32, read from where torch's own
reader finds them (the bytes ``torch.load`` uses): through a memory map where the file allows it (its pages in the
page cache, no copy), else in chunks. :mod:`lightning_asyncckpt.format.integrity` runs it on files, DCP items and
the files beside them, for loads and for ``verify``.

torch is imported by the functions that need it.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from torch._C import PyTorchFileReader

_CHUNK = 16 << 20


def _crc32() -> Callable[..., int]:
    try:
        from isal import isal_zlib

        return isal_zlib.crc32
    except ImportError:
        return zlib.crc32


crc32 = _crc32()


class ArchiveError(ValueError):
    """A ``torch.save`` payload whose zip archive cannot be opened at all (no record was checked)."""


@dataclass(frozen=True)
class Record:
    """A stored record left to its reader to check: its name, where its bytes are in the payload, their size and
    the CRC32 the zip directory gives them."""

    name: str
    offset: int
    size: int
    crc: int


@dataclass
class ZipCheck:
    """Outcome of :func:`scan_torch_zip`: ``bad`` names each record that is not what the archive says;
    ``deferred``: the large records whose CRC32 the caller checks as it copies them (``defer_from``)."""

    records: int = 0
    crc_checked: int = 0  # records that carry a CRC32 (all, unless written with CRC32 turned off)
    bytes_read: int = 0
    bad: list[str] = field(default_factory=list)
    deferred: list[Record] = field(default_factory=list)


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


class MemoryFile(io.RawIOBase):
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

    def readinto(self, buffer: bytearray | memoryview) -> int:
        n = max(0, min(len(buffer), len(self.view) - self.pos))
        buffer[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n


@contextlib.contextmanager
def mapped(f: BinaryIO, copy_on_write: bool = False) -> Iterator[memoryview | None]:
    """The whole open file as a memoryview of its pages (no copy), or None where it cannot be mapped (an empty
    file, a filesystem without mmap). Read-only; with ``copy_on_write``, a private map that tensors loaded on
    it may be built over (a write would change only this process's copy), left mapped until the last such
    tensor is gone if one outlives the block."""
    try:
        if copy_on_write:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        else:
            mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        yield None
        return
    view = memoryview(mm)
    try:
        yield view
    finally:
        try:
            view.release()
            mm.close()
        except BufferError:  # a loaded storage is still alive (in an exception's frame): unmapped with it
            if not copy_on_write:
                raise


def scan_torch_zip(data: bytes | memoryview | BinaryIO, defer_from: int | None = None) -> ZipCheck:
    """Reads every record of a ``torch.save`` payload (in memory, or an open file: through a memory map, else in
    chunks) from where torch's own reader finds it (the bytes ``torch.load`` uses) and checks it against the
    size and CRC32 of the archive's central directory. With ``defer_from`` (a payload in memory only), a
    stored record of at least that many bytes is not read: its place and CRC32 are in ``deferred``, for a
    reader that checks it as it copies it (its local header and place are checked here). Raises
    :class:`ArchiveError` if the archive cannot be opened; ``OSError`` if the file cannot be read."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return _scan(MemoryFile(memoryview(data)), memoryview(data), defer_from)
    with mapped(data) as view:
        return _scan(MemoryFile(view), view) if view is not None else _scan(data, None)


def _scan(f: BinaryIO | MemoryFile, view: memoryview | None, defer_from: int | None = None) -> ZipCheck:
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
            header = _local_header_problem(reader, f, name, member)
            if header is not None:  # torch's reader checks it when it extracts the record: the load would fail
                check.bad.append(f"record {name!r}: {header}")
                continue
            if defer_from is not None and view is not None and member.file_size >= defer_from and member.CRC \
                    and member.compress_type == zipfile.ZIP_STORED and hasattr(reader, "get_record_offset"):
                offset = reader.get_record_offset(name)
                if offset + member.file_size <= len(view):  # else read below: too short, a clear problem
                    check.deferred.append(Record(name, offset, member.file_size, member.CRC))
                    check.crc_checked += 1
                    continue
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


def _local_header_problem(reader: PyTorchFileReader, f: BinaryIO | MemoryFile, name: str, member: zipfile.ZipInfo) -> str | None:
    """What is wrong with the record's local header (its signature, its name, where its data begins by it and by
    torch's reader), or None."""
    f.seek(member.header_offset)
    header = f.read(30)
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        return "its local header is damaged (no signature)"
    n, m = struct.unpack_from("<HH", header, 26)
    if f.read(n) != member.orig_filename.encode("utf-8", "surrogateescape"):
        return "its local header is damaged (another name)"
    if hasattr(reader, "get_record_offset") and reader.get_record_offset(name) != member.header_offset + 30 + n + m:
        return "its local header is damaged (its data is not where the zip directory says)"
    return None


def _read_record(reader: PyTorchFileReader, f: BinaryIO | MemoryFile, view: memoryview | None, name: str, member: zipfile.ZipInfo) -> tuple[int, int]:
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
