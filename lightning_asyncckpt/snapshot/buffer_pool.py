"""The reused host buffers of snapshots: sets of buffers, who holds them, and when a set is free again.

Each save in flight holds one :class:`BufferSet` (one host copy of the state) through a :class:`Lease`,
from its snapshot until its write has ended (the worker no longer reads it). A later save reuses a free
set, or makes a new one.

A lazy save (:mod:`lightning_asyncckpt.snapshot.lazy`) does not need its buffers at save time: its copy runs in
the background anyway. So when every set is busy it *follows* the newest write instead of making a
second copy of the state: it leases that set now, and its background copy starts once the write before
it has released the set (:attr:`Lease.ready`). Training waits for that only where a lazy copy is waited
for (before the optimizer step), and only when saves come faster than writes: staging stays at one copy.

All calls are made on the training thread of the saving rank; :attr:`Lease.ready` is the one thing
another thread (the lazy copy) waits on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class BufferSet:
    """Host buffers (by tensor name) for one save's snapshot, reused by later saves."""

    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    holders: list[Lease] = field(default_factory=list)  # oldest first: the first one's write uses it now

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


@dataclass(eq=False)
class Lease:
    """One save's hold on a :class:`BufferSet`. ``ready`` is set once no earlier save's write uses the
    set (at once for a free set); releasing twice is harmless."""

    buffer_set: BufferSet
    ready: threading.Event = field(default_factory=threading.Event)
    released: bool = False

    def release(self) -> bool:
        """Marks the lease released; returns ``False`` if it already was (releasing twice is harmless)."""
        if self.released:
            return False
        self.released = True
        return True

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        return self.buffer_set.buffers


class BufferPool:
    """The sets of one run (a Trainer's ``fit``, one Fabric run), handed out by :meth:`acquire`."""

    def __init__(self) -> None:
        self._sets: list[BufferSet] = []

    def acquire(self, after: Lease | None = None) -> Lease:
        """A lease on a free set (a new set when none is free). ``after`` (a lazy save): the lease of the
        newest write in flight; when no set is free and ``after`` holds its set alone, the new lease
        follows it there, ready once ``after`` is released."""
        free = next((s for s in self._sets if not s.holders), None)
        if free is None and after is not None and not after.released and after.buffer_set.holders == [after]:
            free = after.buffer_set
        if free is None:
            free = BufferSet()
            self._sets.append(free)
        lease = Lease(free)
        free.holders.append(lease)
        if len(free.holders) == 1:
            lease.ready.set()
        return lease

    def release(self, lease: Lease | None) -> None:
        """The save holding ``lease`` no longer needs its buffers (its write ended, or it was dropped): the
        save following it may copy into them, or a later save reuse them."""
        if lease is None or not lease.release():
            return
        holders = lease.buffer_set.holders
        holders.remove(lease)
        if holders:
            holders[0].ready.set()

    def clear(self) -> None:
        """Forgets the sets nobody holds (the end of a run)."""
        self._sets = [s for s in self._sets if s.holders]

    def buffers(self) -> list[torch.Tensor]:
        """Every host buffer held for reuse, busy or not (what staging costs in host memory)."""
        return [b for s in self._sets for b in s.buffers.values()]
