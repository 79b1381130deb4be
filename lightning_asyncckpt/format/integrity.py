"""Integrity of a checkpoint before it is used: the one set of checks that both the loads (``ckpt_path=``,
``AsyncCheckpointIO.load_checkpoint``, ``fabric.load`` through the package's strategies) and the CLI's ``verify``
run, so that the two cannot disagree.

- A ``torch.save`` file (and each DCP item, and the skeleton and ``meta.pt`` beside them) is a zip archive whose
  central directory holds each record's size and CRC32. ``torch.load`` checks none of them: a flipped bit in a
  weight loads silently. :func:`~lightning_asyncckpt.format.zip_records.scan_torch_zip` reads every record where
  torch's own reader finds it and checks it against its CRC32 (ISA-L where installed, through a memory map of the
  page cache: no copy).
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

import io
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypeVar

from lightning_asyncckpt.format.entries import BITS_PER_BYTE, chunk_elements, entry_problems
from lightning_asyncckpt.format.zip_records import (
    ArchiveError,
    ZipCheck,
    crc32,
    first_line,
    mapped,
    scan_torch_zip,
)
from lightning_asyncckpt.storage import commit
from lightning_asyncckpt.storage.regular_files import CorruptCheckpointError, open_regular

__all__ = ["ArchiveError", "CorruptCheckpointError", "ZipCheck", "check_bytes", "check_directory", "check_file",
           "check_items", "check_path", "crc32", "decode", "first_line", "open_regular", "payload_problem",
           "payload_scan", "scan_torch_zip",
           "shard_path", "side_file_problems"]

META_FILE = "meta.pt"
ZIP_MAGIC = b"PK\x03\x04"
if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    OnItem = Callable[[MetadataIndex, _StorageInfo, memoryview], str | None]

_REPLICATED_LAYOUTS = ("single-writer", "distributed")  # layouts whose structure is the skeleton file
T = TypeVar("T")


def shard_path(root: Path, rel: object) -> Path:
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


def check_bytes(path: Path | str, data: memoryview, crc: bool = True) -> ZipCheck | None:
    """(any rank) :func:`check_file` for a ``torch.save`` file's bytes already in memory (a read-once resume:
    :mod:`~lightning_asyncckpt.storage.read_once`): the same refusals and messages, naming ``path``, on the bytes
    that the load will use."""
    if len(data) == 0:
        raise CorruptCheckpointError(f"{path}: empty (0 bytes): truncated, or never written")
    if not crc or bytes(data[:4]) != ZIP_MAGIC:
        return None
    try:
        check = scan_torch_zip(data)
    except ArchiveError as e:
        raise CorruptCheckpointError(f"{path}: corrupt: {e}; the file ({len(data)} bytes) is truncated or "
                                     "damaged") from None
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

    def add_file(self) -> None:
        """One more shard file opened."""
        self.files += 1

    def add_item(self) -> None:
        """One more item seen (its byte range may still be refused before it is read)."""
        self.items += 1

    def add_read(self, nbytes: int) -> None:
        """``nbytes`` of an item's bytes read."""
        self.bytes_read += nbytes

    def add_crc(self, checked: bool) -> None:
        """An item's bytes were checked against their CRC32s (``checked``), or carried none."""
        self.crc_checked += checked


def decode(path: Path, info: _StorageInfo, raw: bytes | memoryview) -> bytes | memoryview:
    """The item's bytes after DCP's storage transforms (none unless an extension wrote it)."""
    descriptors = getattr(info, "transform_descriptors", None)
    if not descriptors:
        return raw
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    stream = io.BytesIO(bytes(raw))
    return FileSystemReader(str(path)).transforms.transform_load_stream(None, descriptors, stream).read()


def _item_problem(path: Path, storage: _StorageInfo, raw: memoryview, check: ItemsCheck, crc: bool, need: int) -> str | None:
    try:
        data = decode(path, storage, raw)
    except Exception as e:  # noqa: BLE001
        return f"cannot undo the storage transforms {storage.transform_descriptors} ({first_line(e)})"
    if getattr(storage, "transform_descriptors", None) and need > BITS_PER_BYTE * len(data):  # others: `length`
        return (f"holds {len(data)} bytes, fewer than its tensor chunk's {need} elements at one bit each: refused "
                "before anything is allocated")
    problem, checked = payload_problem(data, crc)
    check.add_crc(checked)
    return problem


def payload_problem(data: bytes | memoryview, crc: bool = True) -> tuple[str | None, bool]:
    """(what is wrong with one DCP item's bytes, after its storage transforms, or None; whether a CRC32 was
    checked): it must be a ``torch.save`` archive (DCP's planner writes tensors and objects alike with
    ``torch.save``) and, with ``crc``, its records must match their sizes and CRC32."""
    problem, scan = payload_scan(data, crc)
    return problem, scan is not None and scan.crc_checked > 0


def payload_scan(data: bytes | memoryview, crc: bool = True,
                 defer_from: int | None = None) -> tuple[str | None, ZipCheck | None]:
    """:func:`payload_problem`, with the scan itself (None where the archive could not be opened, or without
    ``crc``); ``defer_from``: records of that size and more are left to the caller, in ``deferred``
    (:func:`~lightning_asyncckpt.format.zip_records.scan_torch_zip`)."""
    if bytes(data[:4]) != ZIP_MAGIC:
        return "corrupt (not a torch.save payload: no zip header)", None
    if not crc:
        return None, None
    try:
        scan = scan_torch_zip(data, defer_from)
    except ArchiveError as e:
        return f"corrupt: {e}", None
    return (f"corrupt: {scan.bad[0]}" if scan.bad else None), scan


def check_items(path: Path, metadata: Metadata, crc: bool = True,
                on_item: OnItem | None = None) -> ItemsCheck:
    """Every item of the DCP directory ``path``: its file is a regular file inside ``path`` (:func:`shard_path`),
    its byte range lies within the file, it is a ``torch.save`` archive and (``crc``) its records match their
    CRC32; then ``on_item(index, storage, bytes)`` (``verify``'s deserialization) may name another problem.
    Problems name the file and the item."""
    check = ItemsCheck()
    # the entries first: a tensor declared larger than its stored bytes is refused before a load allocates it
    check.problems.extend(entry_problems(path / commit.METADATA_FILE, metadata))
    if check.problems and not isinstance(getattr(metadata, "storage_data", None), dict):
        return check
    need, seen = chunk_elements(metadata), {}
    by_file: dict[str, list[tuple[MetadataIndex, _StorageInfo]]] = {}
    for index, storage in metadata.storage_data.items():
        if not isinstance(storage.offset, int) or not isinstance(storage.length, int) or storage.offset < 0 \
                or storage.length < 0:
            check.problems.append(f"{path / commit.METADATA_FILE}: item {index.fqn!r} has the byte range "
                                  f"{storage.offset!r}+{storage.length!r}")
            continue
        by_file.setdefault(storage.relative_path, []).append((index, storage))
    for rel, entries in sorted(by_file.items(), key=lambda e: str(e[0])):
        entries.sort(key=lambda e: e[1].offset)
        _check_file_items(path, rel, entries, check, crc, on_item, need, seen)
    return check


def _check_file_items(path: Path, rel: object, entries: list, check: ItemsCheck, crc: bool, on_item: OnItem | None,
                      need: dict[MetadataIndex, int], seen: dict[tuple[int, int], Path]) -> None:
    """The items of one file, in the order of their offsets. Their byte ranges must not overlap, and no file may
    be read under two names (a hard link): else one stored chunk could back any number of declared tensors."""
    try:
        shard = shard_path(path, rel)
        f = open_regular(shard, follow=False)
    except (OSError, CorruptCheckpointError) as e:
        names = ", ".join(repr(i.fqn) for i, _ in entries[:3]) + (", ..." if len(entries) > 3 else "")
        reason = str(e) if isinstance(e, CorruptCheckpointError) else f"{path / str(rel)}: {e.strerror or e}"
        check.problems.append(f"{reason} (it holds the items {names})")
        return
    check.add_file()
    with f, mapped(f) as view:
        st = os.fstat(f.fileno())
        size, other = st.st_size, seen.setdefault((st.st_dev, st.st_ino), shard)
        if other != shard:
            check.problems.append(f"{shard}: the same file as {other} (a hard link): each item's bytes are stored once")
            return
        previous_end = 0
        for index, storage in entries:
            check.add_item()
            where = f"{shard}: item {index.fqn!r}"
            end = storage.offset + storage.length
            if end > size:
                check.problems.append(f"{where}: truncated (needs bytes {storage.offset}..{end}, the file has {size})")
                continue
            if storage.offset < previous_end:
                check.problems.append(f"{where}: its bytes {storage.offset}..{end} overlap the item before it "
                                      f"(which ends at {previous_end}): each item's bytes are stored once")
                continue
            previous_end = end
            raw = view[storage.offset:end] if view is not None else memoryview(_pread(f, storage.offset, storage.length))
            check.add_read(len(raw))
            try:
                problem = _item_problem(path, storage, raw, check, crc, need.get(index, 0))
                if problem is None and on_item is not None:
                    problem = on_item(index, storage, raw)
            except Exception as e:  # noqa: BLE001 - e.g. metadata fields of the wrong type
                problem = f"cannot be checked ({type(e).__name__}: {e})"
            finally:
                raw.release()
            if problem is not None:
                check.problems.append(f"{where}: {problem}")


def _pread(f: BinaryIO, offset: int, length: int) -> bytes:
    """Bytes of a file that cannot be memory-mapped (some network filesystems)."""
    f.seek(offset)
    return f.read(length)


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


def check_directory(path: Path, metadata: Metadata, crc: bool = True, item_crc: bool | None = None) -> None:
    """(any rank, before a DCP directory is loaded) :func:`check_items` and :func:`side_file_problems`; raises
    :class:`CorruptCheckpointError` naming the file and the item (and how many more problems there are).
    ``item_crc`` (default: ``crc``) False leaves the items' CRC32 to the reader that loads them
    (:class:`~lightning_asyncckpt.format.dcp_reader.CheckedReader`: each rank checks the bytes it reads, once);
    the paths, sizes and headers of every item are checked here all the same, before anything is read."""
    item_crc = crc if item_crc is None else item_crc
    problems = check_items(path, metadata, item_crc).problems + side_file_problems(path, crc)
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


def while_loading(check: Callable[[], object], load: Callable[[], T]) -> T:
    """(any rank) ``load()``, with the CRC32 pass ``check()`` run beside it in a thread (ISA-L's CRC32 releases the
    GIL: on a machine with a core to spare the check costs no time), and its result returned only once ``check``
    passed: nothing loaded is used before it is verified. A problem ``check`` found is raised rather than the
    error it caused in ``load`` (a truncated file fails both). Run the path checks (``crc=False``) before: they
    keep ``load`` from blocking on a FIFO or reading outside the checkpoint."""
    found: list[BaseException] = []

    def run() -> None:
        try:
            check()
        except BaseException as e:  # noqa: BLE001 - handed to the loading thread
            found.append(e)

    thread = threading.Thread(target=run, name="asyncckpt-verify-on-load", daemon=True)
    thread.start()
    try:
        result = load()
    except BaseException:
        thread.join()
        if found:
            raise found[0] from None
        raise
    thread.join()
    if found:
        raise found[0]
    return result
