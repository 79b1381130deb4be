"""Share files mapped into memory and reused from save to save.

A local save's copy goes straight into the file: the file is mapped (``MAP_SHARED``), so copying the
share into the mapping *is* writing it to node-local storage (``/dev/shm``: the page cache is the storage;
a local NVMe: the kernel writes the pages back). There is no separate write, and no buffer in between.

Why reuse: the first copy into a new mapping faults in every page (0.39 GB/s measured here), a copy into
one already touched runs at memory speed (7.8 GB/s). So a file whose step is no longer needed is not
removed but renamed into the pool's free list, still mapped, and the next save of that size takes it.

Space is reserved with ``posix_fallocate`` before the mapping is used: a full filesystem then fails with a
clean ``OSError`` (ENOSPC) at that call, never with a ``SIGBUS`` in the middle of a copy.

Only a spare made ahead (:meth:`FilePool.prepare`, the writer thread) has its pages faulted in when it is
made, so that the save call that takes it does not; a file written as soon as it is made (a recovery's
received share, a save call with no spare) is faulted in by that write: faulting first gains nothing when
the write follows at once (64 MiB on /dev/shm here: 0.018 s by the write alone, against 0.020 s with
``MAP_POPULATE`` or 0.013 s with ``MADV_POPULATE_WRITE``, then 0.004 s for the write).

For a GPU state the pool registers its files with CUDA (:mod:`lightning_asyncckpt.tiers.pinning`) in
:meth:`FilePool.prepare` (the writer thread): never in the save call, where registering costs as much as the
copy it speeds up, and where a refusal would leave its CUDA error on the training thread. It unregisters each
before letting go of its mapping, and stops trying once CUDA refuses (a file system it cannot pin).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_asyncckpt.tiers import pinning, trusted_dirs

FREE_PREFIX = ".free-"  # the pool's spare files: not a share (no .pt suffix), removed at start


@dataclass
class MappedFile:
    """A file of ``nbytes`` at ``path`` and a writable ``uint8`` tensor over its mapping."""

    path: Path | None  # None: memory only (a file that could not be reserved)
    nbytes: int
    tensor: torch.Tensor
    pinned: bool = False  # registered with CUDA (pinning.pin): unregistered before the mapping goes

    def moved_to(self, path: Path) -> None:
        """The file was renamed to ``path`` (its mapping stays)."""
        self.path = Path(path)

    def pin(self, device: torch.device) -> bool:
        """Registers the mapping with CUDA for ``device`` (once); returns whether it is registered: ``False``
        where CUDA refused (:func:`pinning.pin` said why)."""
        if not self.pinned:
            self.pinned = pinning.pin(self.tensor, device)
        return self.pinned

    def release(self) -> None:
        """The pool lets go of this file: unregistered from CUDA first, if it was registered."""
        if self.pinned:
            pinning.unpin(self.tensor)
            self.pinned = False


class FilePool:
    """(one rank, any thread) The mapped files of one holder directory, and its spare ones.

    ``keep_free`` spare files are kept for reuse; more are removed. Thread-safe: the training thread takes
    files at a save, the writer thread for received replicas, and the training thread returns old ones.
    """

    def __init__(self, directory: Path, keep_free: int) -> None:
        self.dir = Path(directory)
        self.keep_free = max(keep_free, 0)
        self._lock = threading.Lock()
        self._mapped: dict[Path, MappedFile] = {}  # in use, by path
        self._free: list[MappedFile] = []
        self._names = itertools.count()
        self.pin_device: torch.device | None = None  # set by pin_for: files made from then on are pinned
        self._pin_refused = False  # CUDA refused a registration: never asked again
        if self.dir.is_dir():  # a previous process's spares: their sizes may not fit; start clean
            for p in self.dir.glob(FREE_PREFIX + "*"):
                p.unlink(missing_ok=True)

    def take(self, path: Path, nbytes: int) -> MappedFile:
        """A mapped file of ``nbytes`` at ``path``: a spare of that size renamed there, else the spare closest
        in size renamed and resized (its pages, already allocated, are mapped again: no new file to fault in),
        else a new one. The space is reserved first: raises ``OSError`` (e.g. ENOSPC) before anything is
        written."""
        path = Path(path)
        with self._lock:
            spare = min(self._free, key=lambda f: abs(f.nbytes - nbytes), default=None)
            if spare is not None:
                self._free.remove(spare)
        mapped = None
        if spare is not None:
            with contextlib.suppress(FileNotFoundError):  # removed by another run of this rank: make a new one
                os.replace(spare.path, path)
                if spare.nbytes == nbytes:
                    mapped = spare
                else:
                    spare.release()
                    mapped = _create(path, nbytes, keep=True)
                mapped.moved_to(path)
        if mapped is None:
            mapped = _create(path, nbytes)
        with self._lock:
            self._mapped[path] = mapped
        return mapped

    def rename(self, old: Path, new: Path) -> None:
        """Renames a file in use (its mapping stays)."""
        os.replace(old, new)
        with self._lock:
            mapped = self._mapped.pop(Path(old), None)
            if mapped is not None:
                mapped.moved_to(Path(new))
                self._mapped[Path(new)] = mapped

    def give_back(self, path: Path) -> None:
        """The file at ``path`` is no longer needed: kept as a spare (mapped) while there is room, else
        removed. A file this process never mapped (a previous run's) is removed."""
        path = Path(path)
        with self._lock:
            mapped = self._mapped.pop(path, None)
            keep = mapped is not None and mapped.nbytes > 0 and len(self._free) < self.keep_free
            if keep:
                spare = self.dir / f"{FREE_PREFIX}{os.getpid()}-{next(self._names)}"
        if not keep:
            if mapped is not None:
                mapped.release()
            path.unlink(missing_ok=True)
            return
        try:
            os.replace(path, spare)
        except FileNotFoundError:
            return
        mapped.moved_to(spare)
        with self._lock:
            self._free.append(mapped)

    def forget(self, path: Path) -> None:
        """The file at ``path`` is never to be reused (a restored checkpoint's tensors map it): once given
        back it is removed, like a file this process never mapped."""
        with self._lock:
            mapped = self._mapped.pop(Path(path), None)
        if mapped is not None:
            mapped.release()

    def pin_for(self, device: torch.device) -> None:
        """(the training thread, at a save or its prepare) The state is on ``device`` (CUDA): from the next
        :meth:`prepare` on, the spares are registered with CUDA (unless CUDA refused one already)."""
        if not self._pin_refused:
            self.pin_device = device

    def _pin(self, mapped: MappedFile) -> None:
        device = self.pin_device
        if device is not None and not mapped.pinned and mapped.path is not None:
            if not mapped.pin(device):  # refused (pinning.pin said why, once): the files stay pageable
                self.pin_device, self._pin_refused = None, True

    def prepare(self, sizes: list[int], uses: int = 2) -> int:
        """(the writer thread) Makes spare files, faulted in, until each size in ``sizes`` has ``uses`` files
        per use, at most ``keep_free`` spares. After a save, two (the save just made and the next one): the
        second save then reuses files as every later one does; before the first save, one. Either way no
        save call creates and faults in its own files. For a GPU state (:meth:`pin_for`) it also registers
        every spare with CUDA, those made in a save call included. Returns how many it made; a full
        filesystem makes fewer (the save reports it)."""
        with self._lock:
            spares = list(self._free)
        for spare in spares:  # made unregistered (in a save call, or resized): registered here, off the stall
            self._pin(spare)
        made = 0
        for size in sorted(set(sizes)):
            with self._lock:
                have = sum(f.nbytes == size for f in (*self._mapped.values(), *self._free))
                room = self.keep_free - len(self._free)
                path = self.dir / f"{FREE_PREFIX}{os.getpid()}-{next(self._names)}"
            for _ in range(min(uses * sizes.count(size) - have, room)):
                try:
                    spare = _create(path, size, prefault=True)
                except OSError:
                    return made
                self._pin(spare)  # here, in the writer thread: registering takes 0.15 s per 2 GiB
                with self._lock:
                    self._free.append(spare)
                    path = self.dir / f"{FREE_PREFIX}{os.getpid()}-{next(self._names)}"
                made += 1
        return made

    def close(self) -> None:
        """Removes the spare files; mappings are released with their last tensor."""
        with self._lock:
            free, self._free = self._free, []
            used = list(self._mapped.values())
            self._mapped.clear()
        for f in (*free, *used):
            f.release()
        for f in free:
            f.path.unlink(missing_ok=True)


def _create(path: Path, nbytes: int, keep: bool = False, prefault: bool = False) -> MappedFile:
    """A file of ``nbytes`` at ``path``, its space reserved and mapped; with ``prefault``, its pages faulted
    in now. ``keep``: an existing file (a spare of another size), cut or grown to ``nbytes``, its pages kept."""
    # its directory is the store's (made 0700, never through a link); the file is never opened through one
    fd = trusted_dirs.open_file(path, os.O_RDWR | os.O_CREAT | (0 if keep else os.O_TRUNC))
    try:
        if keep:
            os.ftruncate(fd, nbytes)
        if nbytes:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise OSError(e.errno, f"{e.strerror or e}: reserving {nbytes} bytes for {path.name} in"
                              f" {path.parent}") from e
            tensor = torch.frombuffer(_map(fd, nbytes, prefault), dtype=torch.uint8)
        else:
            tensor = torch.empty(0, dtype=torch.uint8)
    finally:
        os.close(fd)
    return MappedFile(path, nbytes, tensor)


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.11 lacks the name


def _map(fd: int, nbytes: int, prefault: bool) -> mmap.mmap:
    """A shared writable mapping of the file; ``prefault``: its page tables filled now, by
    ``MADV_POPULATE_WRITE`` (one call, as if every page were written), else ``MAP_POPULATE`` on an older
    kernel."""
    if not prefault:
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    view = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    try:
        view.madvise(MADV_POPULATE_WRITE)
        return view
    except (OSError, ValueError):  # EINVAL before Linux 5.14
        view.close()
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
