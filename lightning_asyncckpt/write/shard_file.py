"""A DCP shard file whose records' CRC32 are computed by ``zip_crc`` instead of inside ``torch.save``.

A shard of torch DCP's ``FileSystemWriter`` is its items one after the other; each tensor item is a
whole ``torch.save`` zip archive, written by the engine's ``_write_item`` with torch's own CRC32 (2.4
GB/s: about 0.4 CPU-seconds per GiB, the largest CPU cost of a shard write once its bytes go around the
page cache). The worker runs the engine's writer with CRC32 off (:func:`crc32_off_for`) into a
:class:`ShardFile`, which holds the bytes, and at the end fills each archive's CRC32 with ISA-L
(``zip_crc.fill``) before its bytes are released to the disk: the shard is byte for byte the one the
engine writes with CRC32 on (``tests/test_direct_io.py`` compares them), and ``verify`` checks it as before.

Where each item starts is where ``_write_item`` asks ``tell()`` (once before an item, once after it).
Every region between two such offsets that begins with a zip local header is an archive; items that
were serialized elsewhere with CRC32 on (DCP's byte items) get the same CRC32 written again. A region
that begins like an archive but is not one fails the write: a shard is never published with a CRC32 of
zero.

Runs in the writer process (imports no Lightning).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator

from lightning_asyncckpt.write import zip_crc
from lightning_asyncckpt.write.direct_io import DirectFile, Recorded

_ZIP_START = struct.pack("<I", 0x04034B50)


class ShardFile(DirectFile):
    """A :class:`DirectFile` that holds its bytes until each archive in it has its CRC32 (on exit)."""

    def __init__(self, path: str, regions: list[tuple[int, int]]):
        super().__init__(path, regions, hold=True)
        self._item_starts = {0}

    def tell(self) -> int:
        at = super().tell()
        self._item_starts.add(at)
        return at

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            try:
                self._fill_archives()
            except BaseException as e:  # the file is closed as failed (its writer threads stop), then raised
                self.release(self.recorded.size)
                super().__exit__(type(e), e, e.__traceback__)
                raise
        self.release(self.recorded.size)
        super().__exit__(exc_type, exc, tb)

    def _fill_archives(self) -> None:
        recorded = self.recorded
        bounds = sorted(s for s in self._item_starts if s < recorded.size) + [recorded.size]
        for start, end in zip(bounds, bounds[1:]):
            if recorded.read(start, 4) == _ZIP_START:
                try:
                    zip_crc.fill(Window(recorded, start, end))
                except ValueError as e:
                    raise ValueError(f"{self.path}: bytes {start} to {end} are not one torch.save archive ({e})") from e
            self.release(end)


class Window(Recorded):
    """Bytes ``[start, end)`` of a recorded file, as a recorded file of their own (offsets from ``start``)."""

    def __init__(self, recorded: Recorded, start: int, end: int):
        super().__init__(size=end - start)
        self._base, self._start = recorded, start

    def spans(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        return self._base.spans(self._start + start, self._start + end)

    def read(self, start: int, n: int) -> bytes:
        return self._base.read(self._start + start, max(0, min(n, self.size - start)))

    def patch(self, offset: int, data: bytes) -> None:
        self._base.patch(self._start + offset, data)


def crc32_off_for(transforms: list) -> contextlib.AbstractContextManager:
    """CRC32 off inside ``torch.save`` on this thread, for the engine's shard writes, unless a storage
    extension (e.g. compression) transforms the items: ours would then not see the archives to fill them.

    torch keeps the setting per thread (2.13); where a torch keeps it per process, a shard writer thread
    that finishes first turns it back on for the others, which then compute torch's CRC32 again: slower,
    never wrong, since :class:`ShardFile` writes every archive's CRC32 itself."""
    if any(getattr(t, "extensions", None) for t in transforms):
        return contextlib.nullcontext()
    return zip_crc.crc32_off_here()
