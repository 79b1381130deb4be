"""Reading a DCP directory's items once, checking each as it is read: :class:`CheckedReader`, DCP's
``FileSystemReader`` for every load of a DCP directory through this package (``format="dcp"`` checkpoints,
sharded ones on every rank, Lightning's and Fabric's).

Each rank reads the items its load plan names, and only those: through a memory map of their file (opened as a
regular file inside the checkpoint, no link followed: :func:`~lightning_asyncckpt.format.integrity.shard_path`),
it checks the item's small zip records against their CRC32 in the mapped bytes, and loads the tensor from those
same bytes (``torch.load``'s own ``mmap`` path: the storages are views of the map). A tensor's bytes (records of
1 MiB and more) are then copied into the state's tensor 1 MiB at a time, each chunk's CRC32 taken right after
its copy, while it is in the CPU's cache (:class:`_Fused`): the bytes come from memory once, where checking them
in place before the copy read them twice (16-35% more CPU than no check). Measured here (2 cores, 0.5 GiB):
the CRC32 of a chunk in cache adds 15% to the chunk's memcpy, and the checked load takes less CPU than the
unchecked one, whose single ``copy_`` wakes torch's thread pool (``benchmarks/bench_verify_load.py``). A target
the chunked copy cannot take (not contiguous, another dtype, a part of the item) is checked in place first.
No rank reads another rank's items: a sharded load on W ranks reads the shared storage once, not W times.
A bad item raises :class:`CorruptCheckpointError` naming the file and the item on the rank that read it; DCP's
``load`` gathers every rank's failure, so every rank raises (see :func:`failure`).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import os
import pickle
import warnings
from pathlib import Path
from typing import BinaryIO

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_asyncckpt.format import integrity
from lightning_asyncckpt.format.zip_records import MemoryFile, Record, crc32, first_line, mapped
from lightning_asyncckpt.storage.regular_files import CorruptCheckpointError, open_regular

# Records of at least 1 MiB (a tensor's bytes) are checked as they are copied, 1 MiB at a time (in the L2 cache)
_FUSE_FROM = 1 << 20
_CHUNK = 1 << 20


class CheckedReader(FileSystemReader):
    """DCP's reader for the checkpoint directory ``path``, given its ``metadata`` (read with the restricted
    unpickler of :mod:`~lightning_asyncckpt.format.metadata`: DCP's own reader would unpickle ``.metadata``
    without restriction), checking each item's CRC32 (``verify``) in the bytes it then loads."""

    def __init__(self, path: Path, metadata: Metadata, verify: bool = True) -> None:
        super().__init__(str(path))
        self.root, self.verify = Path(path), verify
        self._metadata = metadata

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        if hasattr(self._metadata, "storage_meta") and hasattr(self, "load_id"):  # as FileSystemReader does
            from torch.distributed.checkpoint.metadata import StorageMeta

            # new values, not DCP's objects changed in place: the caller's metadata stays as it was read
            storage_meta = dataclasses.replace(self._metadata.storage_meta or StorageMeta(), load_id=self.load_id)
            self._metadata = dataclasses.replace(self._metadata, storage_meta=storage_meta)
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """(each rank, inside DCP's ``load``) Reads, checks and loads the items of this rank's ``plan``, file by
        file in the order of their offsets."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, items in per_file.items():
            self._read_file(rel, sorted(items, key=lambda i: self.storage_data[i.storage_index].offset), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, rel: str, items: list[ReadItem], planner: LoadPlanner) -> None:
        shard = integrity.shard_path(self.root, rel)
        checked: set[MetadataIndex] = set()  # an item that several requests narrow is checked once
        with open_regular(shard, follow=False) as f, mapped(f, copy_on_write=True) as view:
            size = os.fstat(f.fileno()).st_size
            for item in items:
                storage = self.storage_data[item.storage_index]
                where = f"{shard}: item {item.storage_index.fqn!r}"
                end = storage.offset + storage.length
                if end > size:
                    raise CorruptCheckpointError(f"{where}: truncated (needs bytes {storage.offset}..{end}, "
                                                 f"the file has {size})")
                raw = view[storage.offset:end] if view is not None else _pread(f, storage.offset, storage.length)
                try:
                    data = integrity.decode(self.root, storage, raw)
                except Exception as e:  # noqa: BLE001 - any error of a damaged transform's input
                    raise CorruptCheckpointError(f"{where}: cannot undo the storage transforms "
                                                 f"{storage.transform_descriptors} ({first_line(e)})") from None
                deferred: list[Record] = []
                if self.verify and item.storage_index not in checked:
                    # a tensor's large records are checked as they are copied (_Fused): their bytes read once
                    fuse = _FUSE_FROM if item.type != LoadItemType.BYTE_IO and isinstance(data, memoryview) else None
                    problem, scan = integrity.payload_scan(data, defer_from=fuse)
                    if problem is not None:
                        raise CorruptCheckpointError(f"{where}: {problem}")
                    deferred = scan.deferred if scan is not None else []
                    checked.add(item.storage_index)
                try:
                    self._load_item(item, data, planner, _Fused(data, deferred, where))
                except (CorruptCheckpointError, pickle.UnpicklingError):
                    raise
                except Exception as e:  # torch's errors do not say which file
                    raise CorruptCheckpointError(f"{where}: cannot be read ({first_line(e)})") from e
                del raw, data

    @staticmethod
    def _load_item(item: ReadItem, data: memoryview | bytes, planner: LoadPlanner, fused: _Fused) -> None:
        if item.type == LoadItemType.BYTE_IO:
            fused.check_rest(None)
            planner.load_bytes(item, io.BytesIO(bytes(data)))
            return
        whole = _load_tensor(data)
        keep = getattr(planner, "keep_whole", None)  # a wrapper subclass (torchao's states) kept as it was saved
        if type(whole) is not torch.Tensor and keep is not None and not any(item.storage_offsets) \
                and list(item.lengths) == list(whole.size()):
            fused.check_rest(None)
            keep(item, torch.load(MemoryFile(memoryview(data)), map_location="cpu", weights_only=True))  # owned
            return
        tensor = narrow_tensor_by_index(whole, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        record = fused.record_of(whole, tensor, target)
        fused.check_rest(record)  # every other record before a byte reaches the state
        if record is None:
            target.copy_(tensor)  # the loaded tensor, a view of the map, does not outlive this call
        else:
            fused.copy_checked(record, target)
        planner.commit_tensor(item, target)


class _Fused:
    """The records of one item whose CRC32 is checked as they are copied into the state (``deferred``): the
    tensor's bytes are read from the map once, in chunks that are checked right after the copy wrote them,
    while they are still in the CPU's cache (the check in place, then the copy, read them from memory twice).
    Any other deferred record is checked in place first (:meth:`check_rest`)."""

    def __init__(self, data: memoryview | bytes, deferred: list[Record], where: str) -> None:
        self.data, self.deferred, self.where = data, deferred, where

    def record_of(self, whole: torch.Tensor, tensor: torch.Tensor, target: torch.Tensor) -> Record | None:
        """The deferred record that ``tensor`` (``whole`` not narrowed, its storage a view of the item's bytes)
        is all of, where it goes to ``target`` (in host memory) byte for byte; else None (then the record is
        checked in place and the copy is torch's: a GPU's target gets one copy, not one per chunk)."""
        if not self.deferred or type(whole) is not torch.Tensor or tensor.shape != whole.shape \
                or not (whole.is_contiguous() and target.is_contiguous() and whole.storage_offset() == 0) \
                or target.dtype != whole.dtype or target.device.type != "cpu":  # a device's copy: in one piece
            return None
        storage = whole.untyped_storage()
        base = _address(self.data)
        return next((r for r in self.deferred if storage.data_ptr() == base + r.offset
                     and storage.nbytes() == r.size == whole.numel() * whole.element_size()), None)

    def check_rest(self, fused: Record | None) -> None:
        """Checks every deferred record but ``fused`` in place; raises naming the first that does not match."""
        view = memoryview(self.data)
        for r in self.deferred:
            if r is not fused and crc32(view[r.offset:r.offset + r.size]) & 0xFFFFFFFF != r.crc:
                raise self._mismatch(r)

    def copy_checked(self, record: Record, target: torch.Tensor) -> None:
        """Copies ``record`` (a contiguous tensor's bytes) into ``target`` in chunks, each checked right after
        it is copied, from the target (in host memory: :meth:`record_of`); raises
        naming the record where the CRC32 does not match (the target then holds those damaged bytes: the load
        fails, as a failed DCP load does, with the state partly loaded)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer: nothing here writes to it
            src = torch.frombuffer(self.data, dtype=torch.uint8)[record.offset:record.offset + record.size]
        # a memcpy per chunk: torch's copy_ of 1 MiB wakes its thread pool each time (10x the CPU time here)
        into, out, crc = memoryview(target.view(-1).view(torch.uint8).numpy()), memoryview(src.numpy()), 0
        for a in range(0, record.size, _CHUNK):
            into[a:a + _CHUNK] = out[a:a + _CHUNK]
            crc = crc32(into[a:a + _CHUNK], crc)
        if crc & 0xFFFFFFFF != record.crc:
            raise self._mismatch(record)

    def _mismatch(self, r: Record) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: corrupt: record {r.name!r} does not match its CRC32: its bytes"
                                      " changed after the save")


def _address(data: memoryview | bytes) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(data, dtype=torch.uint8).data_ptr() if len(data) else -1


def failure(e: CheckpointException) -> BaseException:
    """The first rank's error inside DCP's ``CheckpointException`` (which every rank raises when any rank's
    read failed): a :class:`CorruptCheckpointError` naming the file and item, when that is what it was."""
    failures = getattr(e, "failures", None) or {}
    for rank in sorted(failures):
        cause = failures[rank]
        cause = cause[0] if isinstance(cause, tuple) and cause else cause
        if isinstance(cause, BaseException):
            return cause
    return e


# torch.load's path for mmap=True: the storages are slices of one storage over the bytes, not copies. Private
# to torch, so used only where its signature is as expected (else torch.load copies the records).
_load_zip = getattr(torch.serialization, "_load", None)
_ZERO_COPY = _load_zip is not None and "overall_storage" in inspect.signature(_load_zip).parameters


def _load_tensor(data: memoryview | bytes) -> torch.Tensor:
    """``torch.load(weights_only=True)`` of one item's bytes (as DCP's reader loads it), its storages views of
    ``data`` where torch allows it."""
    from torch.utils.serialization import config

    if not (_ZERO_COPY and isinstance(data, memoryview) and not data.readonly and len(data)
            and not config.load.calculate_storage_offsets):  # storages where the zip directory says they are
        return torch.load(MemoryFile(memoryview(data)), map_location="cpu", weights_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        overall = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
    reader = torch._C.PyTorchFileReader(MemoryFile(data))
    try:
        return _load_zip(reader, "cpu", torch._weights_only_unpickler, overall_storage=overall)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(torch.serialization._get_wo_message(str(e))) from None


def _pread(f: BinaryIO, offset: int, length: int) -> memoryview:
    f.seek(offset)
    return memoryview(bytearray(f.read(length)))
