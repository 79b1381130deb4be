"""The hand-back: a write tells the lazy copy behind it which staged tensors it will not read again.

When saves come faster than the disk takes them, a lazy save follows the write in flight into the one
staging copy (:mod:`lightning_asyncckpt.snapshot.buffer_pool`). If its copy could start only once that whole write
had reported, the disk would sit idle while the copy ran, and training would wait for the write *and*
the copy before its optimizer step. Instead the writer hands each staged tensor back as soon as its
bytes are in a write buffer, and the follower's copy overwrites that tensor then: the copy runs right
behind the write, tensor by tensor, and ends about when the write does.

The channel is a small append-only file in the run's private results directory, beside the write's
report (never on the checkpoint's filesystem). The writer appends the index of each tensor it hands back
(its place in the job's tensors, 4 bytes little-endian) once nothing of the write reads it again. The
report still means "every tensor is free". A write that hands nothing back (a DCP directory, a remote
file) is followed to its report, as before.

- Writer (:class:`Releases`): fed by :class:`lightning_asyncckpt.write.direct_io.DirectFile`'s consumed prefix.
- Trainer: :class:`Written` (what the write was handed, kept with its pending save) and :class:`Follow`
  (what the follower's copy thread waits on, tensor by tensor).

Lightning-free and torch-free: the worker imports it.
"""

from __future__ import annotations

import bisect
import os
import struct
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POLL_S = 0.005  # how often a follower's copy looks for tensors handed back (one small read)
_INDEX = struct.Struct("<I")


def _span(t: Any) -> tuple[int, int] | None:
    """The host bytes of a staged tensor, as a file write references them (``torch_file._exact``)."""
    if t.device.type != "cpu" or t.numel() == 0:
        return None
    return t.data_ptr(), t.numel() * t.element_size()


class Releases:
    """(writer, one file write) Hands the job's staged ``tensors`` (in the trainer's order) back through
    the file at ``path`` as the write consumes them.

    :meth:`recorded` is called once the file is recorded and before its first chunk is copied;
    :meth:`consumed` by the writer threads as the consumed prefix of the file grows. A tensor is handed
    back once every byte of the file that lies in it is consumed; a tensor the file holds no reference
    into (small ones are copied into their record, views were copied before recording) at once.
    """

    def __init__(self, path: str, tensors: Sequence[Any]):
        self.path = path
        spans = [(_span(t), i) for i, t in enumerate(tensors)]
        self._spans = sorted((s[0], s[0] + s[1], i) for s, i in spans if s is not None)
        self._starts = [s for s, _, _ in self._spans]
        self._longest = max((e - s for s, e, _ in self._spans), default=0)
        self._count = len(spans)
        self._lock = threading.Lock()
        self._order: list[tuple[int, int]] | None = None  # (last file byte read from it, index), ascending
        self._next = 0  # how many of ``_order`` are handed back
        self._upto = 0  # the consumed prefix of the file
        self._fd: int | None = None
        self._broken = False  # the file could not be written: nothing more is handed back

    def recorded(self, starts: Sequence[int], parts: Sequence[Any]) -> None:
        """Where each staged tensor's bytes lie in the recorded file (``direct_io.Recorded``'s parts:
        ``bytes`` copied into the file, or ``(address, nbytes)`` references)."""
        last: dict[int, int] = {}
        for start, part in zip(starts, parts):
            if isinstance(part, bytes):
                continue
            address, nbytes = part
            for i in self._containing(address, nbytes):
                last[i] = max(last.get(i, 0), start + nbytes)
        with self._lock:
            self._order = sorted((last.get(i, 0), i) for i in range(self._count))
            self._emit()

    def consumed(self, upto: int) -> None:
        """(writer threads) No byte of the file before ``upto`` is read from memory again."""
        with self._lock:
            self._upto = max(self._upto, upto)
            if self._order is not None:
                self._emit()

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _containing(self, address: int, nbytes: int) -> Iterable[int]:
        # tensors whose bytes hold [address, address + nbytes): such a tensor starts at or before
        # ``address``, and no further back than the longest tensor reaches
        at = bisect.bisect_right(self._starts, address)
        while at > 0 and self._spans[at - 1][0] >= address + nbytes - self._longest:
            at -= 1
            start, end, i = self._spans[at]
            if end >= address + nbytes:
                yield i

    def _emit(self) -> None:
        assert self._order is not None
        done = []
        while self._next < len(self._order) and self._order[self._next][0] <= self._upto:
            done.append(self._order[self._next][1])
            self._next += 1
        if not done or self._broken:
            return
        try:
            if self._fd is None:
                flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
                self._fd = os.open(self.path, flags, 0o600)
            # one write() per batch: appends are whole records, and the syscall orders the writer threads'
            # reads of the handed-back bytes before the trainer can see the indices
            os.write(self._fd, b"".join(_INDEX.pack(i) for i in done))
        except OSError:
            # the hand-back is an optimization: without it the follower waits for the report, so a
            # failure here must never fail the checkpoint's write
            self._broken = True


@dataclass(frozen=True)
class Written:
    """(trainer) What a file write was handed: where it hands tensors back, and each index's buffer."""

    path: Path
    names: tuple[str, ...]
    addresses: tuple[int, ...]

    @classmethod
    def of(cls, path: Path, tensors: dict[str, Any]) -> Written:
        return cls(path, tuple(tensors), tuple(t.data_ptr() for t in tensors.values()))

    def remove(self) -> None:
        """(trainer, once the write reported or was given up) The file is no longer read."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class FollowFailed(Exception):
    """The write before a lazy save never freed its buffers in time, or the save was dropped meanwhile."""


class Follow:
    """(made on the training thread at save time; waited on by the lazy copy's thread) The write whose
    buffers a lazy save's copy reuses. ``ready`` is set once that write's lease is released (on the
    training thread); ``report`` exists once it reported; ``written`` (None: it hands nothing back) says
    which of ``buffers`` (the follower's, by name) it reads. Bounded by ``timeout_s`` from now."""

    def __init__(self, ready: threading.Event, report: Path, written: Written | None, buffers: dict[str, Any],
                 timeout_s: float):
        self._ready, self._report, self._written, self._timeout_s = ready, report, written, timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._ended = False
        self._read = 0  # bytes of the hand-back file already read
        # the indices that name one of the follower's buffers; a buffer made anew since is not read
        self._held: dict[int, str] = {}
        if written is not None:
            for i, (name, address) in enumerate(zip(written.names, written.addresses)):
                buf = buffers.get(name)
                if buf is not None and buf.data_ptr() == address:
                    self._held[i] = name
        self._unread: set[str] | None = None if written is None else set(self._held.values())

    def free(self, names: Collection[str], cancelled: threading.Event) -> list[str]:
        """Blocks until at least one of ``names`` may be overwritten, and returns those that became free since
        the last call (all of them once the write has ended): each call costs what it returns, not what is
        left. Raises :class:`FollowFailed` when ``cancelled`` is set or the write has not ended within
        ``timeout_s``."""
        while True:
            if not self._ended:
                self._ended = self._ready.is_set() or self._report.exists()
            if self._ended:
                return list(names)
            out = []
            if self._unread is not None:  # the first call: what the write never reads is free at once
                out, self._unread = [n for n in names if n not in self._unread], None
            out += [n for n in self._take_handed_back() if n in names]
            if out:
                return out
            if cancelled.is_set():
                raise FollowFailed("the save was dropped while its lazy snapshot waited for the write before it")
            if time.monotonic() > self._deadline:
                raise FollowFailed(f"the write before this save did not end within timeout_s={self._timeout_s:g}s")
            self._ready.wait(POLL_S)

    def _take_handed_back(self) -> list[str]:
        """The names handed back since the last look."""
        if self._written is None:
            return []
        try:
            with open(self._written.path, "rb") as f:
                f.seek(self._read)
                data = f.read()
        except FileNotFoundError:
            return []
        whole = len(data) - len(data) % _INDEX.size  # a record being appended is read next time
        self._read += whole
        return [name for (i,) in _INDEX.iter_unpack(data[:whole]) if (name := self._held.pop(i, None)) is not None]
