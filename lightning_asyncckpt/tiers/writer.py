"""The background thread that finishes a local save: checksums, replicas, manifests.

The save call has already copied the shares into their mapped files (:class:`Copied`); the thread makes
the replicas hold their owners' bytes and commits every share under its name. A replicated (DDP) state's
replicas were copied from this rank's own memory (:mod:`lightning_asyncckpt.tiers.local_replicas`: only
checksums cross the network); a sharded state's own share is replicated over the clique with NVRx's
:mod:`lightning_asyncckpt.tiers.replication`, and what arrives lands in mapped files reserved here.

One save at a time: the next local save first waits for this one (:meth:`ShareWriter.wait`). The thread
talks only over the clique's own gloo group, never the training's, so it runs beside training steps.
A failure is kept as text and raised on every rank at the next step boundary, never in this thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_asyncckpt.collectives import ProcessGroup
from lightning_asyncckpt.snapshot.lazy import BackgroundCopy
from lightning_asyncckpt.tiers import local_replicas, shares
from lightning_asyncckpt.tiers.mapped import MappedFile
from lightning_asyncckpt.tiers.packing import crc32
from lightning_asyncckpt.tiers.store import Held, LocalStore

TORN = (-1, -1)  # the CRC32s a sharded share is sent with when its lazy copy failed: never committed


@dataclass
class Copied:
    """One share copied at the save call: its owner, its header (this rank's) and its reserved file."""

    owner: int
    head: bytes
    file: MappedFile


class ShareWriter:
    """(one rank) Finishes its own share and, with replication, its clique peers' replicas."""

    def __init__(self, store: LocalStore, rank: int, group: ProcessGroup | None, topology: tuple,
                 timeout_s: float = 600.0) -> None:
        self.store, self.rank, self.group, self.topology = store, rank, group, topology
        self.timeout_s = timeout_s  # for a lazy save's background copy
        self.run = ""  # the run id its manifests name (named by begin_run before the first save)
        self.newest_done = -1  # the newest step whose shares this rank holds in full
        self.error: str | None = None
        self.last_write_s: float | None = None
        self.repaired = 0  # replicas of a replicated state sent by their owner (not bitwise replicated)
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: float) -> bool:
        """Waits for the save being finished; False if it is still running after ``timeout_s``."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return not self.busy

    def submit(self, step: int, mode: str, copied: list[Copied], failure: str | None = None,
               copy: BackgroundCopy | None = None) -> None:
        """Starts the thread. ``failure``: a file could not be reserved (``copied`` then holds memory for it);
        the thread still takes part in the clique's exchange, commits nothing and reports ``failure``.
        ``copy``: a lazy save's background copy into ``copied``'s files, waited for first; if it fails (a
        tensor changed before its copy), so does the save, in the same way."""
        assert not self.busy, "a share is still being written"
        self._thread = threading.Thread(target=self._job, args=(step, mode, copied, failure, copy),
                                        name=f"asyncckpt-local-{step}", daemon=True)
        self._thread.start()

    def make_ahead(self, sizes: list[int]) -> None:
        """Starts the thread making spare files of ``sizes`` (faulted in) for the first save; the save waits
        for it as for a save in flight. A full directory makes fewer: the save then reports it."""
        self.background(lambda: self.store.pool.prepare(sizes, 1), "asyncckpt-local-files")

    def background(self, job: Callable[[], object], name: str) -> None:
        """Runs ``job`` in the writer's thread (which owns the clique's group); the next save waits for it
        as for a save in flight. ``job`` handles its own errors."""
        assert not self.busy, "a share is still being written"
        self._thread = threading.Thread(target=job, name=name, daemon=True)
        self._thread.start()

    def begin_run(self, run: str) -> None:
        """(the training thread, once, before the first save) The run id every manifest written from now names."""
        self.run = run

    def clear_error(self) -> None:
        """(the training thread, once every rank has raised it) Forgets the failed save's error: reported once."""
        self.error = None

    def _job(self, step: int, mode: str, copied: list[Copied], failure: str | None,
             copy: BackgroundCopy | None) -> None:
        start = time.perf_counter()
        committed: set[int] = set()  # id() of each file committed under its name
        try:
            problem = copy.wait(self.timeout_s) if copy is not None else None
            if problem is not None:  # its bytes are torn or missing: exchanged (the peers wait), never committed
                failure = failure or f"local save of step {step}: {copy.problem_type}: {problem}"
            if mode == shares.REPLICATED or self.group is None:  # every clique owner's share copied here
                own = next(c for c in copied if c.owner == self.rank)
                settled, repaired, torn = local_replicas.settle(
                    self.rank, own.head, {c.owner: c.file.tensor for c in copied}, self.group, ok=problem is None)
                self.repaired += repaired
                if torn and failure is None:
                    failure = (f"local save of step {step}: the lazy copy of rank(s) {torn} of this clique failed (a"
                               " tensor changed in place before it was copied); nothing of the step was committed")
                commits = [(c.owner, c.file, settled[c.owner].head, settled[c.owner].head_crc32,
                            settled[c.owner].crc32) for c in copied if c.owner in settled]
            else:
                commits = self._replicate(step, copied[0], torn=problem is not None)
            if failure is not None:
                self.error = failure
                self._release(copied, committed)
                return
            for owner, file, head, head_crc, flat_crc in commits:
                self._commit(step, mode, owner, file, head, head_crc, flat_crc)
                committed.add(id(file))
            self.newest_done = step
            self.store.pool.prepare([c.file.nbytes for c in copied])  # the next save's files, off its stall
        except BaseException as e:  # noqa: BLE001 - kept, and raised on every rank at the next boundary
            self.error = f"local save of step {step}: {type(e).__name__}: {e}"
            self._release(copied, committed)
        finally:
            self.last_write_s = time.perf_counter() - start

    def _release(self, copied: list[Copied], committed: set[int]) -> None:
        """A failed save's files that were not committed: back to the pool (spares), none left half-named."""
        for c in copied:
            if id(c.file) not in committed:
                self.store.release(c.file)

    def _replicate(self, step: int, own: Copied, torn: bool = False) -> list[tuple]:
        """A sharded share: NVRx's clique replication sends the own share; each peer's arrives straight in a
        file reserved for it. Returns what to commit. ``torn``: this rank's lazy copy failed; it still sends
        (the peers wait for it), marked :data:`TORN` so that no peer commits it."""
        from lightning_asyncckpt.tiers.replication import (  # nvidia-resiliency-ext
            ShareStateDict,
            head_tensor,
            replicate,
        )

        landed: dict[int, MappedFile] = {}
        refused: list[str] = []

        def land(owner: int, index: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
            if index == 1 and dtype == torch.uint8 and len(shape) == 1 and shape[0]:  # the flat buffer
                try:
                    landed[owner] = self.store.reserve(step, owner, shape[0])
                    return landed[owner].tensor
                except OSError as e:  # received into memory all the same: the peers are in the broadcast
                    refused.append(f"rank {owner}'s replica: {e}")
            return torch.empty(shape, dtype=dtype)

        head_crc, flat_crc = TORN if torn else (crc32(own.head), crc32(own.file.tensor))
        sd = ShareStateDict(step, self.rank, (head_crc, flat_crc), [head_tensor(own.head), own.file.tensor])
        got_all = replicate(sd, self.group, land)
        if refused:
            raise OSError(f"no room for the replicas of step {step}: " + "; ".join(refused))
        commits = []
        for got in got_all:
            head_t, flat = got.tensors
            if got.owner == self.rank:
                commits.append((self.rank, own.file, own.head, head_crc, flat_crc))
            elif tuple(got.crc32) != TORN:  # else its owner reports the failure; its file is never named
                # an empty share lands nowhere: its file, of no bytes, is made here
                mapped = landed[got.owner] if got.owner in landed else self.store.reserve(step, got.owner, 0)
                # a replica keeps its owner's CRC32s, checked before any use (recovery): not computed again here
                commits.append((got.owner, mapped, bytes(head_t.numpy()), *got.crc32))
        return commits

    def _commit(self, step: int, mode: str, owner: int, file: MappedFile, head: bytes, head_crc: int,
                flat_crc: int) -> None:
        held = Held(step, owner, file.nbytes, flat_crc, tuple(self.topology), mode, len(head), head_crc, self.run)
        self.store.commit(held, file, head)
