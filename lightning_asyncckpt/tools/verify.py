"""Verifying a checkpoint (the CLI's ``verify``). A committed checkpoint directory: every item of every shard
file is read and checked against ``.metadata`` (byte range, torch.save zip records and their CRC32, tensor
shape and dtype). A ``torch.save`` file: every zip record is read and checked against its CRC32, and the file
is loaded with ``weights_only=True``.

torch is imported by the functions that need it, not by importing this module.
"""

from __future__ import annotations

import io
import pickle
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from lightning_asyncckpt.format import commit
from lightning_asyncckpt.format.metadata import MetadataError, read_metadata
from lightning_asyncckpt.tools.items import (
    META_FILE,
    ZIP_MAGIC,
    ItemError,
    decode,
    dtype_name,
    first_line,
    is_zip_file,
    weights_only_reason,
)
from lightning_asyncckpt.units import human_bytes

_CHUNK = 16 << 20


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_checkpoint`: ``problems`` is empty for a sound checkpoint."""

    items: int = 0
    files: int = 0
    bytes_read: int = 0
    crc_checked: int = 0  # items (records of a file) that carry CRC32 and were checked against it
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # not problems: what the check could not cover

    def summary(self, single_file: bool) -> str:
        """What was checked, in one line (after ``OK <path>: ``) for a sound checkpoint."""
        unit = "records" if single_file else "items"
        crc = (f"{self.crc_checked} of {self.items} {unit} checked against CRC32"
               if self.crc_checked else "no CRC32 recorded: corrupted tensor data would go unnoticed")
        if not single_file:
            files = f"{self.files} shard file{'' if self.files == 1 else 's'}"
            return f"{self.items} items in {files}, {self.bytes_read} bytes read; {crc}"
        if not self.items:  # a legacy torch.save file: no zip records (its note says so)
            return f"torch.save file, {self.bytes_read} bytes read; loads with weights_only=True"
        loads = "" if self.notes else "; loads with weights_only=True"
        return (f"torch.save file, {self.items} zip records, {self.bytes_read} bytes read "
                f"({human_bytes(self.bytes_read)}); {crc}{loads}")


class ArchiveError(ValueError):
    """A ``torch.save`` payload whose zip archive cannot be opened at all (no record was checked)."""


@dataclass
class ZipCheck:
    """Outcome of :func:`scan_torch_zip`: ``bad`` names each record that is not what the archive says."""

    records: int = 0
    crc_checked: int = 0  # records that carry a CRC32 (all, unless written with CRC32 turned off)
    bytes_read: int = 0
    bad: list[str] = field(default_factory=list)


def check_torch_zip(data: bytes | BinaryIO) -> bool:
    """Reads every record of a ``torch.save`` payload with torch's own zip reader (the bytes ``torch.load``
    would use) and checks each against the size and CRC32 in the archive's central directory.

    ``torch.load`` checks no CRC. Returns whether any CRC was recorded
    (``torch.serialization.set_crc32_options(False)`` writes zeros); raises ``ValueError`` saying what is wrong.
    """
    check = scan_torch_zip(data)
    if check.bad:
        raise ValueError(check.bad[0])
    return check.crc_checked > 0


def scan_torch_zip(data: bytes | BinaryIO) -> ZipCheck:
    """:func:`check_torch_zip` of a payload in memory or of an open file (read record by record, in chunks,
    from where torch's reader finds it: a file of any size), reporting every bad record. Raises
    :class:`ArchiveError` if the archive cannot be opened; ``OSError`` if the file cannot be read."""
    import torch

    f = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
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
            size, crc = _read_record(reader, f, name, member)
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


def _read_record(reader: Any, f: BinaryIO, name: str, member: zipfile.ZipInfo) -> tuple[int, int]:
    """(size, CRC32) of the record ``name`` as torch reads it: a stored record (as torch writes them) streamed
    from the offset torch's reader gives (what ``torch.load(mmap=True)`` maps), else the whole record."""
    if member.compress_type != zipfile.ZIP_STORED or not hasattr(reader, "get_record_offset"):
        record = reader.get_record(name)
        return len(record), zlib.crc32(record)
    f.seek(reader.get_record_offset(name))
    size, crc, left = 0, 0, member.file_size
    while left > 0:
        chunk = f.read(min(left, _CHUNK))
        if not chunk:
            break
        size, crc, left = size + len(chunk), zlib.crc32(chunk, crc), left - len(chunk)
    return size, crc


def _check_item(path: Path, index: Any, storage: Any, md: Any, raw: bytes, report: VerifyReport) -> str | None:
    """Checks one item's bytes; returns what is wrong, or ``None``."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        data = decode(path, storage, raw)
    except Exception as e:  # noqa: BLE001
        return f"cannot undo the storage transforms {storage.transform_descriptors} ({first_line(e)})"
    if md is None:
        return "is not an entry of the metadata's state_dict_metadata"
    if data[:4] != ZIP_MAGIC:  # DCP's planner writes tensors and objects alike with torch.save
        return "corrupt (not a torch.save payload: no zip header)"
    try:
        report.crc_checked += check_torch_zip(data)
    except ValueError as e:
        return f"corrupt: {e}"
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not isinstance(md, TensorStorageMetadata) and "Unsupported global" in str(e):
            return None  # an object weights_only may not rebuild: its records were read and checked above
        return f"does not deserialize ({first_line(e)})"
    except Exception as e:  # noqa: BLE001 - any error of torch.load is a corrupt item
        return f"does not deserialize ({first_line(e)})"
    if not isinstance(md, TensorStorageMetadata):
        return None
    if not isinstance(obj, torch.Tensor):
        return f"holds a {type(obj).__name__}, not a tensor"
    chunk = next((c for c in md.chunks if list(c.offsets) == list(index.offset or [])), None)
    if chunk is None:
        return f"is stored at offsets {list(index.offset or [])}, which are no chunk of the tensor"
    shape = list(chunk.sizes)
    if list(obj.shape) != shape or obj.dtype != md.properties.dtype:
        return (f"holds {dtype_name(obj.dtype)}{list(obj.shape)}, the metadata says "
                f"{dtype_name(md.properties.dtype)}{shape}")
    return None


def verify_checkpoint(path: Path, hint: str = "") -> VerifyReport:
    """Reads every item of every shard file of the committed checkpoint ``path`` and checks it against
    ``.metadata``: its byte range lies within the file, its zip records match their CRC32, and a tensor
    deserializes (``weights_only=True``) with the shape and dtype the metadata gives. A ``.metadata`` that
    names other types than DCP's is a problem (``hint`` appended)."""
    report = VerifyReport()
    try:
        metadata = read_metadata(path, hint=hint)
    except OSError as e:
        report.problems.append(f"cannot read {path / commit.METADATA_FILE}: {e.strerror or e}")
        return report
    except MetadataError as e:
        report.problems.append(str(e))
        return report
    try:
        by_file = _items_by_file(path, metadata, report)
    except Exception as e:  # noqa: BLE001 - metadata of the right type whose fields are not
        report.problems.append(f"{path / commit.METADATA_FILE}: inconsistent ({type(e).__name__}: {e})")
        return report
    for rel, entries in sorted(by_file.items()):
        _verify_file(path, rel, entries, metadata, report)
    meta = path / META_FILE
    if meta.is_file():
        try:
            data = meta.read_bytes()
            report.bytes_read += len(data)
            if data[:4] != ZIP_MAGIC:  # written with torch.save
                raise ValueError("not a torch.save file (no zip header)")
            check_torch_zip(data)
        except (OSError, ValueError) as e:
            report.problems.append(f"{meta}: corrupt: {e}")
    return report


def _items_by_file(path: Path, metadata: Any, report: VerifyReport) -> dict[str, list[tuple[Any, Any]]]:
    """The storage items grouped by shard file, in file order; records entries that have no stored item."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    by_file: dict[str, list[tuple[Any, Any]]] = {}
    for index, storage in metadata.storage_data.items():
        if not isinstance(storage.offset, int) or not isinstance(storage.length, int) or storage.offset < 0:
            raise ValueError(f"item {index.fqn!r} has the byte range {storage.offset!r}+{storage.length!r}")
        by_file.setdefault(storage.relative_path, []).append((index, storage))
    for entries in by_file.values():
        entries.sort(key=lambda e: e[1].offset)
    for fqn, md in metadata.state_dict_metadata.items():  # every chunk of every entry must be stored
        # what DCP's reader looks up (a MetadataIndex compares by fqn and chunk offsets)
        if isinstance(md, TensorStorageMetadata):
            wanted = [(MetadataIndex(fqn, c.offsets, i), f" chunk at {list(c.offsets)}") for i, c in enumerate(md.chunks)]
        else:
            wanted = [(MetadataIndex(fqn), "")]
        if isinstance(md, TensorStorageMetadata) and not _chunks_tile(md):
            report.problems.append(f"{path}: item {fqn!r}: its chunks {[list(c.sizes) for c in md.chunks]} at "
                                   f"{[list(c.offsets) for c in md.chunks]} do not fill its size {list(md.size)}")
        for key, chunk in wanted:
            if key not in metadata.storage_data:
                report.problems.append(f"{path}: item {fqn!r}{chunk} has no storage entry in {commit.METADATA_FILE}")
    return by_file


def _chunks_tile(md: Any) -> bool:
    """Whether a tensor's chunks lie within its size and add up to it (DCP stores no overlapping chunks)."""
    total = 0
    for c in md.chunks:
        if len(c.offsets) != len(md.size) or len(c.sizes) != len(md.size):
            return False
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(c.offsets, c.sizes, md.size)):
            return False
        numel = 1
        for n in c.sizes:
            numel *= n
        total += numel
    size = 1
    for d in md.size:
        size *= d
    return total == size


def _verify_file(path: Path, rel: str, entries: list[tuple[Any, Any]], metadata: Any, report: VerifyReport) -> None:
    shard = path / rel
    try:
        size = shard.stat().st_size
        f = open(shard, "rb")  # noqa: SIM115 - closed below
    except OSError as e:
        names = ", ".join(repr(i.fqn) for i, _ in entries[:3]) + (", ..." if len(entries) > 3 else "")
        report.problems.append(f"{shard}: {e.strerror or e} (it holds the items {names})")
        return
    report.files += 1
    with f:
        for index, storage in entries:
            report.items += 1
            where = f"{shard}: item {index.fqn!r}"
            end = storage.offset + storage.length
            if end > size:
                report.problems.append(f"{where}: truncated (needs bytes {storage.offset}..{end}, the file has {size})")
                continue
            f.seek(storage.offset)
            raw = f.read(storage.length)
            report.bytes_read += len(raw)
            if len(raw) != storage.length:
                report.problems.append(f"{where}: short read ({len(raw)} of {storage.length} bytes)")
                continue
            try:
                problem = _check_item(path, index, storage, metadata.state_dict_metadata.get(index.fqn), raw, report)
            except Exception as e:  # noqa: BLE001 - e.g. metadata fields of the wrong type
                problem = f"cannot be checked ({type(e).__name__}: {e})"
            if problem is not None:
                report.problems.append(f"{where}: {problem}")


def verify_file(path: Path) -> VerifyReport:
    """Reads every zip record of the ``torch.save`` file ``path`` and checks it against the size and CRC32 in
    the archive's central directory (``report.items`` counts records), then loads the file with
    ``weights_only=True`` (memory-mapped: the records were just read). Objects that ``weights_only`` refuses
    are a note, not a problem: their records were checked. Raises :class:`ItemError` if ``path`` is no
    ``torch.save`` file at all (neither a zip archive nor a legacy file that loads), ``OSError`` if unreadable.
    """
    report = VerifyReport(files=1)
    if not is_zip_file(path):
        if path.stat().st_size == 0:
            report.problems.append(f"{path}: empty (0 bytes): truncated, or never written")
            return report
        _load_check(path, report, ItemError)
        report.bytes_read = path.stat().st_size
        report.notes.append("a legacy torch.save file (not a zip archive): it loads, but it records no CRC32")
        return report
    with open(path, "rb") as f:
        try:
            check = scan_torch_zip(f)
        except ArchiveError as e:
            size = path.stat().st_size
            report.problems.append(f"{path}: corrupt: {e}; the file ({size} bytes) is truncated or damaged")
            return report
    report.items, report.crc_checked, report.bytes_read = check.records, check.crc_checked, check.bytes_read
    report.problems.extend(f"{path}: corrupt: {bad}" for bad in check.bad)
    _load_check(path, report, None)
    return report


def _load_check(path: Path, report: VerifyReport, raise_as: type[Exception] | None) -> None:
    """Loads ``path`` with ``weights_only=True`` (memory-mapped for a zip file, retried without mmap if that
    fails otherwise than unpickling); a failure is a problem of ``report`` (or raised as ``raise_as``)."""
    import torch

    try:
        try:
            torch.load(str(path), map_location="cpu", weights_only=True, mmap=raise_as is None)
        except pickle.UnpicklingError:
            raise
        except Exception:  # noqa: BLE001 - e.g. no mmap on this filesystem: a corrupt file fails below too
            if raise_as is not None:
                raise
            torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any error of torch.load is a corrupt file
        if isinstance(e, pickle.UnpicklingError) and "Unsupported global" in str(e):
            report.notes.append(f"it does not load with weights_only=True ({weights_only_reason(e)}): torch.load "
                                "needs weights_only=False (only for checkpoints you trust)")
        elif raise_as is not None:
            raise raise_as(f"{path}: not a checkpoint (not a torch.save file: {first_line(e)})") from None
        else:
            report.problems.append(f"{path}: does not load with weights_only=True ({first_line(e)})")
