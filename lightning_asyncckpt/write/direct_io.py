"""Writing a file whose bytes are already in host memory: aligned ``O_DIRECT`` writes, several in flight.

A buffered write copies every byte into the page cache (kernel CPU), and the fsync then waits for the
kernel's writeback of those pages. On the machines measured (``benchmarks/profile_write.py``) that copy
and its writeback cost more CPU than everything else a checkpoint write does, and a writer sharing the
CPU with training falls far behind the disk. Here the file is first *recorded* (:class:`Recorder`: the
serializer writes into it; bytes inside the staged tensors are kept as references, never copied),
and written (:class:`DirectFile`) in aligned chunks straight to the disk as soon as each chunk is final:
each chunk is assembled in a small reused aligned buffer (one ``memmove`` from the staged tensors) and
written with ``O_DIRECT`` by one of a few threads (the disk sees several requests in flight, and
finishing the file, e.g. computing its CRC32 with ``zip_crc``, overlaps the writes); then the file is
fsync'd.

Where the filesystem refuses ``O_DIRECT`` (tmpfs, some network or FUSE filesystems), the same chunks
are written through the page cache: the bytes of the file are the same either way.

Runs in the writer process (imports no Lightning).
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import mmap
import os
import threading
from dataclasses import dataclass, field

_ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and memory (the largest logical block size in use)
CHUNK = 8 << 20  # bytes per write request
THREADS = 4  # write requests in flight
_REF_MIN = 64 << 10  # writes at least this large are kept as references when they lie in known memory


@dataclass
class Recorded:
    """A file's bytes in order: ``starts[i]`` is the offset of ``parts[i]``, either ``bytes`` (copied) or
    ``(address, nbytes)`` inside memory the caller keeps alive until the file is written."""

    starts: list[int] = field(default_factory=list)
    parts: list = field(default_factory=list)
    size: int = 0

    def append(self, part: bytes | tuple[int, int], nbytes: int) -> None:
        """The next ``nbytes`` of the file: ``part`` copied, or ``(address, nbytes)`` of memory kept alive."""
        self.starts.append(self.size)
        self.parts.append(part)
        self.size += nbytes

    def spans(self, start: int, end: int):
        """``(address, nbytes)`` pieces of memory holding bytes ``[start, end)`` of the file, in order."""
        i = bisect.bisect_right(self.starts, start) - 1
        pos = start
        while pos < end:
            part_start, part = self.starts[i], self.parts[i]
            src, nbytes = (_bytes_address(part), len(part)) if isinstance(part, bytes) else part
            take = min(end, part_start + nbytes) - pos
            yield src + (pos - part_start), take
            pos += take
            i += 1

    def read(self, start: int, n: int) -> bytes:
        """A copy of bytes ``[start, start + n)`` of the file (clipped to its size)."""
        return b"".join(ctypes.string_at(a, k) for a, k in self.spans(start, min(start + n, self.size)))

    def patch(self, offset: int, data: bytes) -> None:
        """Overwrites bytes of the file at ``offset`` that the serializer wrote as small copied writes (zip
        headers); bytes inside a reference (the caller's tensors) are never changed and raise."""
        pos, data = offset, bytes(data)
        while data:
            i = bisect.bisect_right(self.starts, pos) - 1
            part = self.parts[i]
            if not isinstance(part, bytes):
                raise ValueError(f"byte {pos} of the recorded file lies in a staged tensor, not in a header")
            at = pos - self.starts[i]
            take = min(len(data), len(part) - at)
            self.parts[i] = part[:at] + data[:take] + part[at + take:]
            pos, data = pos + take, data[take:]


class Recorder:
    """A write-only, sequential file object for a serializer (``torch.save``) that records the file.

    ``regions``: ``(address, nbytes)`` of host memory that stays unchanged and alive until the
    recorded file is written (the staged tensors); a large write from inside one is kept as a reference.
    """

    def __init__(self, regions: list[tuple[int, int]]):
        self._regions = sorted((a, a + n) for a, n in regions if n > 0)
        self._starts = [a for a, _ in self._regions]
        self.recorded = Recorded()

    def write(self, data: object) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n == 0:
            return 0
        ref = self._reference(view) if n >= _REF_MIN else None
        self.recorded.append(ref if ref is not None else bytes(view), n)
        return n

    def _reference(self, view: memoryview) -> tuple[int, int] | None:
        addr = _address(view)
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr + view.nbytes <= self._regions[i][1]:
            return addr, view.nbytes
        return None

    def tell(self) -> int:
        return self.recorded.size

    def flush(self) -> None:
        return None

    def writable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        raise OSError(errno.ESPIPE, "the recorded checkpoint file is written in one pass; seeking is not supported")


def _address(view: memoryview) -> int:
    """Where a (read-only) buffer's bytes are, without copying them."""
    try:
        import numpy as np
    except ImportError:  # torch warns once that the buffer is read-only; nothing writes through it
        import torch

        return torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def storage_regions(tensors: object) -> list[tuple[int, int]]:
    """``(address, nbytes)`` of the host storages of ``tensors`` (an iterable of torch tensors; other devices
    and empty storages left out): the regions a :class:`Recorder` may keep references into. A wrapper subclass
    (torchao's optimizer states, in a sharded save's items) owns no storage: its inner tensors' are its regions."""
    # imported here: this module imports no torch at import time
    from lightning_asyncckpt.snapshot.subclasses import inner_names, is_wrapper

    def plain(ts: object) -> object:
        for t in ts:
            yield from plain(getattr(t, n) for n in inner_names(t)) if is_wrapper(t) else (t,)

    out = []
    for t in plain(tensors):
        storage = t.untyped_storage()
        if t.device.type == "cpu" and storage.nbytes() > 0:
            out.append((storage.data_ptr(), storage.nbytes()))
    return out


def _bytes_address(part: bytes) -> int:
    return ctypes.cast(ctypes.c_char_p(part), ctypes.c_void_p).value


def _fill(buf_addr: int, recorded: Recorded, start: int, end: int) -> None:
    """Copies bytes ``[start, end)`` of the recorded file to ``buf_addr``."""
    at = buf_addr
    for src, n in recorded.spans(start, end):
        ctypes.memmove(at, src, n)  # releases the GIL
        at += n


def _open(path: str, direct: bool) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)


def _open_direct(path: str) -> tuple[int, bool]:
    """``path`` opened for ``O_DIRECT`` writes if its filesystem takes them (one aligned block is written
    to find out: some accept the flag at open and refuse the write), else for buffered writes."""
    if not hasattr(os, "O_DIRECT"):
        return _open(path, False), False
    try:
        fd = _open(path, True)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return _open(path, False), False
    block = mmap.mmap(-1, _ALIGN)
    try:
        os.pwrite(fd, block, 0)
        return fd, True
    except OSError as e:
        os.close(fd)
        if e.errno != errno.EINVAL:
            raise
        return _open(path, False), False
    finally:
        block.close()


class DirectFile(Recorder):
    """A file object for ``torch.save`` that writes ``path`` while the serializer runs: each ``chunk`` is
    written (``O_DIRECT`` where the filesystem takes it) by one of ``threads`` threads as soon as its bytes
    are final, so producing the file and writing it overlap.

    Bytes are final as soon as the serializer has written them; with ``hold=True`` only once the caller
    says so with :meth:`release` (it patches headers first, e.g. ``zip_crc.fill``), or on exit.

    Use as a context manager: on a clean exit the file is complete, truncated to its size and fsync'd;
    an error of any write is raised there with its errno. ``regions``: see :class:`Recorder`.
    """

    def __init__(self, path: str, regions: list[tuple[int, int]], threads: int = THREADS, chunk: int = CHUNK,
                 direct: bool = True, hold: bool = False):
        super().__init__(regions)
        if chunk % _ALIGN:
            raise ValueError(f"DirectFile(chunk={chunk}) must be a multiple of {_ALIGN}")
        self.path, self._chunk, self._threads, self._hold = path, chunk, max(1, threads), hold
        self.fd, self.direct = _open_direct(path) if direct else (_open(path, False), False)
        self._cond = threading.Condition()
        self._done = False  # the file is complete: every byte is final
        self._ready = 0  # bytes before this offset are final
        self._next = 0  # the next chunk a thread takes
        self._errors: list[BaseException] = []
        self._workers = [threading.Thread(target=self._run, daemon=True) for _ in range(self._threads)]
        for t in self._workers:
            t.start()

    def write(self, data: object) -> int:
        n = super().write(data)
        if not self._hold:
            self.release(self.recorded.size)
        return n  # a failed write is raised on exit, with its errno (not through the serializer's C++ caller)

    def release(self, upto: int) -> None:
        """Bytes before ``upto`` are final: the writer threads may write them."""
        self._ready = max(self._ready, upto)
        if self._ready >= (self._next + 1) * self._chunk:
            with self._cond:
                self._cond.notify_all()

    def fileno(self) -> int:
        """The file's descriptor (an ``os.fsync`` of it before the exit is harmless: the exit fsyncs again
        once every chunk is written)."""
        return self.fd

    def _take(self) -> tuple[int, int] | None:
        """The next chunk to write, once its bytes are final; None when there are no more."""
        with self._cond:
            while True:
                if self._errors:
                    return None
                start = self._next * self._chunk
                end = start + self._chunk
                if self._done and start >= self.recorded.size:
                    return None
                if self._done or self._ready >= end:
                    self._next += 1
                    return start, min(end, self.recorded.size)
                self._cond.wait()

    def _run(self) -> None:
        buf = mmap.mmap(-1, self._chunk)  # page-aligned, reused for every chunk of this thread
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        view = memoryview(buf)
        try:
            while (span := self._take()) is not None:
                start, end = span
                _fill(addr, self.recorded, start, end)
                n = end - start
                if self.direct and n % _ALIGN:  # the file's tail: padded, truncated at close
                    padded = -(-n // _ALIGN) * _ALIGN
                    ctypes.memset(addr + n, 0, padded - n)
                    n = padded
                written = 0
                while written < n:
                    written += os.pwrite(self.fd, view[written:n], start + written)
        except BaseException as e:  # noqa: BLE001 - raised in the serializer's thread
            with self._cond:
                self._errors.append(e)
                self._cond.notify_all()
        finally:
            view.release()
            buf.close()

    def _finish(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()
        for t in self._workers:
            t.join()

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if exc_type is not None:
                with self._cond:
                    self._errors.append(RuntimeError("the serializer failed"))
            self._finish()
            if exc_type is None:
                if self._errors:
                    error = self._errors[0]
                    if isinstance(error, OSError) and error.filename is None:  # name the file, as open() does
                        raise OSError(error.errno, error.strerror, self.path) from error
                    raise error
                os.ftruncate(self.fd, self.recorded.size)
                os.fsync(self.fd)
        finally:
            os.close(self.fd)


class Opener:
    """An ``open`` for a writer that writes files whose tensor bytes lie in known memory (a DCP shard's
    staged tensors): ``opener(path, "wb")`` for a path in ``regions_by_path`` is a :class:`DirectFile` with
    those regions; any other call is the builtin ``open``. The engines' ``write_preloaded_data`` takes one
    as its ``open_file`` (nvidia-resiliency-ext 0.5+), or finds it as its module's ``open``."""

    def __init__(self, regions_by_path: dict[str, list[tuple[int, int]]], file_cls: type | None = None):
        self._regions = {os.path.abspath(p): r for p, r in regions_by_path.items()}
        self._file_cls = file_cls or DirectFile  # made as file_cls(path, regions), e.g. shard_file.ShardFile

    def __call__(self, path: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        regions = self._regions.get(os.path.abspath(os.fspath(path))) if isinstance(path, (str, os.PathLike)) else None
        if regions is None or mode != "wb" or args or kwargs:
            return open(path, mode, *args, **kwargs)  # noqa: SIM115 - the caller's with closes it
        return self._file_cls(os.fspath(path), regions)
