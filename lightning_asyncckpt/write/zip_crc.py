"""The CRC32 of each record of a ``torch.save`` zip, computed after the file was recorded with CRC32 off.

``torch.save`` computes each record's CRC32 with miniz's table-driven CRC: 2.4 GB/s on the machine
measured, about 0.4 CPU-seconds per GiB, the largest CPU cost of a file write left once the bytes go to
the disk with ``O_DIRECT`` (``benchmarks/profile_write.py``). On a machine whose cores all train, that CPU
is taken from training. A carry-less-multiply CRC32 (ISA-L through ``isal``, or ``zlib-ng``) computes the
same value at about 12 GB/s. So the writer records the file with ``torch.serialization.set_crc32_options(
False)`` (records carry a CRC32 of 0) and :func:`fill` then writes each record's CRC32 into its data
descriptor and its central directory entry: the file is byte for byte what ``torch.save`` writes with CRC32 on, and
``verify`` and ``zipfile`` check it as before. Without either library, ``zlib.crc32`` is used (about as
fast as torch's own).

Runs in the writer process (imports no Lightning).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import struct
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lightning_asyncckpt.write.direct_io import Recorded

_LOCAL_SIG, _CENTRAL_SIG, _DESCRIPTOR_SIG = 0x04034B50, 0x02014B50, 0x08074B50
_LOCAL_CRC, _DESCRIPTOR_CRC, _CENTRAL_CRC = 14, 4, 16  # CRC32 fields: local header, data descriptor, central entry
_PIECE = 1 << 30  # bytes per CRC call: every implementation takes a buffer this large
_ID_RECORD, _ID_SIZE = ".data/serialization_id", 40
_MASK64 = (1 << 64) - 1


def _implementation() -> tuple[Callable[..., int], str]:
    try:
        from isal import isal_zlib

        return isal_zlib.crc32, "isal"
    except ImportError:
        pass
    try:
        from zlib_ng import zlib_ng

        return zlib_ng.crc32, "zlib-ng"
    except ImportError:
        return zlib.crc32, "zlib"


crc32, IMPLEMENTATION = _implementation()


_off_lock = threading.Lock()


@contextlib.contextmanager
def crc32_off() -> Iterator[None]:
    """``torch.save`` without CRC32 inside this block. Where torch keeps the setting per process, the lock
    keeps this library's own file writes from overlapping (the writer process runs one write at a time)."""
    with _off_lock, crc32_off_here():
        yield


@contextlib.contextmanager
def crc32_off_here() -> Iterator[None]:
    """``torch.save`` without CRC32 inside this block, with no lock (torch 2.13 keeps the setting per thread)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


@dataclass(frozen=True)
class Record:
    """Where one zip record lies in the file (``header``: its local header), its data, and where its CRC32
    is written (``crc_at``): the central directory entry, and the data descriptor right after the data
    where there is one (torch's writer adds one to every non-empty record; the local header's is then 0),
    else the local header."""

    name: str
    header: int
    data: int
    size: int
    crc_at: tuple[int, int]
    descriptor: bool


class _Reader(io.RawIOBase):
    """The recorded file, read-only and seekable, for ``zipfile`` to read its central directory."""

    def __init__(self, recorded: Recorded):
        self._recorded, self._pos = recorded, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._recorded.size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        data = self._recorded.read(self._pos, len(buffer))
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


def records(recorded: Recorded) -> list[Record]:
    """The records of the recorded zip, in file order; raises ``ValueError`` for an archive that is not
    the stored (uncompressed) zip ``torch.save`` writes."""
    try:
        with zipfile.ZipFile(_Reader(recorded)) as zf:
            infos, central = zf.infolist(), zf.start_dir
    except zipfile.BadZipFile as e:
        raise ValueError(f"the recorded file is not a zip archive: {e}") from e
    out = []
    for info in infos:
        entry = recorded.read(central, 46)
        if len(entry) < 46 or struct.unpack_from("<I", entry)[0] != _CENTRAL_SIG:
            raise ValueError(f"no central directory entry for {info.filename!r} at byte {central}")
        n, e, c = struct.unpack_from("<HHH", entry, 28)
        local = recorded.read(info.header_offset, 30)
        if len(local) < 30 or struct.unpack_from("<I", local)[0] != _LOCAL_SIG:
            raise ValueError(f"no local header for {info.filename!r} at byte {info.header_offset}")
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"record {info.filename!r} is compressed: not written by torch.save")
        ln, le = struct.unpack_from("<HH", local, 26)
        data = info.header_offset + 30 + ln + le
        crc_at, descriptor = info.header_offset + _LOCAL_CRC, bool(info.flag_bits & 0x08)
        if descriptor:
            descriptor = recorded.read(data + info.compress_size, 4)
            if len(descriptor) < 4 or struct.unpack_from("<I", descriptor)[0] != _DESCRIPTOR_SIG:
                raise ValueError(f"no data descriptor after record {info.filename!r}")
            crc_at = data + info.compress_size + _DESCRIPTOR_CRC
        out.append(Record(info.filename, info.header_offset, data, info.compress_size, (crc_at, central + _CENTRAL_CRC), descriptor))
        central += 46 + n + e + c
    out.sort(key=lambda r: r.header)
    if out and out[0].header != 0:  # e.g. two archives with no boundary between them: the first's CRC32s unseen
        raise ValueError(f"{out[0].header} bytes before the archive's first record: not one torch.save archive")
    return out


def _combine(crcs: list[int]) -> int:
    """torch's ``combined_uncomp_crc32_``: ``c10::hash_combine`` (64-bit) folded over the data descriptors'
    CRC32s in the order written."""
    seed = 0
    for value in crcs:
        seed = (seed ^ (value + 0x9E3779B9 + (seed << 6) + (seed >> 2))) & _MASK64
    return seed


def _fix_serialization_id(recorded: Recorded, record: Record, crcs: list[int]) -> None:
    """torch.save's last record, ``.data/serialization_id``, is 20 digits of a hash of the record names and
    20 digits of the records' combined CRC32 (:func:`_combine`): recorded with CRC32 off, the latter
    combines zeros. Rewritten from the real CRC32s, the id (and so the file) is the one torch.save writes
    with CRC32 on. An id in any other form (another torch) is left as it is: it is not read when loading."""
    digits = recorded.read(record.data, record.size)
    if digits[20:] == b"%020d" % _combine([0] * len(crcs)):
        recorded.patch(record.data + 20, b"%020d" % _combine(crcs))


def checksum(recorded: Recorded, start: int, end: int) -> int:
    """CRC32 of bytes ``[start, end)`` of the recorded file, read in place (no copy)."""
    crc = 0
    for addr, n in recorded.spans(start, end):
        for at in range(0, n, _PIECE):
            crc = crc32((ctypes.c_char * min(_PIECE, n - at)).from_address(addr + at), crc)
    return crc


def fill(recorded: Recorded, release: Callable[[int], None] | None = None) -> int:
    """Writes each record's CRC32 where the zip keeps it (``Record.crc_at``), in file order, and
    calls ``release(offset)`` once the bytes before ``offset`` are final (a writer may start on them; the
    central directory, at the end, is final when this returns). Returns the number of records."""
    found = records(recorded)
    described: list[int] = []  # CRC32s of the records with a data descriptor, in order
    for i, record in enumerate(found):
        if record.name.endswith(_ID_RECORD) and record.size == _ID_SIZE:
            _fix_serialization_id(recorded, record, described)
        crc = checksum(recorded, record.data, record.data + record.size)
        if record.descriptor:
            described.append(crc)
        packed = struct.pack("<I", crc)
        for at in record.crc_at:
            recorded.patch(at, packed)
        if release is not None and i + 1 < len(found):
            release(found[i + 1].header)  # the next record's header still waits for its CRC32
    return len(found)
