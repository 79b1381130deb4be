"""Verifying a checkpoint (the CLI's ``verify``). A committed checkpoint directory: every item of every shard
file is read and checked against ``.metadata`` (byte range, torch.save zip records and their CRC32, tensor
shape and dtype), and the skeleton and ``meta.pt`` beside them. A ``torch.save`` file: every zip record is read
and checked against its CRC32, and the file is loaded with ``weights_only=True``.

The checks that a load also runs (paths inside the checkpoint, regular files, sizes and CRC32, the skeleton) are
:mod:`lightning_asyncckpt.format.integrity`'s, so that ``verify`` fails what a load would refuse; this module adds
what only ``verify`` does: deserializing each item and comparing it with ``.metadata``.

torch is imported by the functions that need it, not by importing this module.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from lightning_asyncckpt.format import integrity
from lightning_asyncckpt.format.integrity import (
    ArchiveError,
    CorruptCheckpointError,
    ZipCheck,
    scan_torch_zip,
)
from lightning_asyncckpt.format.metadata import MetadataError, read_metadata
from lightning_asyncckpt.storage import commit
from lightning_asyncckpt.tools.items import (
    ItemError,
    dtype_name,
    first_line,
    is_zip_file,
    weights_only_reason,
)
from lightning_asyncckpt.units import human_bytes

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import STORAGE_TYPES, MetadataIndex

__all__ = ["ArchiveError", "VerifyReport", "ZipCheck", "check_torch_zip", "scan_torch_zip", "verify_checkpoint",
           "verify_file"]


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_checkpoint`: ``problems`` is empty for a sound checkpoint."""

    items: int = 0
    files: int = 0
    bytes_read: int = 0
    crc_checked: int = 0  # items (records of a file) that carry CRC32 and were checked against it
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # not problems: what the check could not cover

    def add_counts(self, items: int = 0, files: int = 0, bytes_read: int = 0, crc_checked: int = 0) -> None:
        """Adds what one check read to the summary's counters."""
        self.items += items
        self.files += files
        self.bytes_read += bytes_read
        self.crc_checked += crc_checked

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


def _check_item(path: Path, index: MetadataIndex, storage: _StorageInfo, md: STORAGE_TYPES, raw: memoryview) -> str | None:
    """Deserializes one item whose bytes passed :func:`integrity.check_items` and compares it with the
    metadata; returns what is wrong, or ``None``."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if md is None:
        return "is not an entry of the metadata's state_dict_metadata"
    data = integrity.decode(path, storage, raw)
    try:
        obj = torch.load(io.BytesIO(bytes(data)), map_location="cpu", weights_only=True)
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
    ``.metadata``: the checks of a load (:mod:`~lightning_asyncckpt.format.integrity`: its file lies inside the
    checkpoint and is a regular file, its byte range lies within it, its zip records match their CRC32; the
    skeleton and ``meta.pt``), then a tensor deserializes (``weights_only=True``) with the shape and dtype the
    metadata gives. A ``.metadata`` that names other types than DCP's is a problem (``hint`` appended)."""
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
        check = integrity.check_items(path, metadata, on_item=lambda index, storage, raw: _check_item(
            path, index, storage, metadata.state_dict_metadata.get(index.fqn), raw))
    except Exception as e:  # noqa: BLE001 - metadata of the right type whose fields are not
        report.problems.append(f"{path / commit.METADATA_FILE}: inconsistent ({type(e).__name__}: {e})")
        return report
    report.add_counts(check.items, check.files, check.bytes_read, check.crc_checked)
    report.problems.extend(check.problems)
    side = integrity.side_file_problems(path)
    report.problems.extend(side)
    for name in (commit.SKELETON_FILE, integrity.META_FILE):  # sound bytes: they must also unpickle, as a load does
        if (path / name).is_file() and not any(str(path / name) in p for p in side):
            _load_check(path / name, report, None, what=name)
    return report


def verify_file(path: Path) -> VerifyReport:
    """Reads every zip record of the ``torch.save`` file ``path`` and checks it against the size and CRC32 in
    the archive's central directory (``report.items`` counts records), then loads the file with
    ``weights_only=True`` (memory-mapped: the records were just read). Objects that ``weights_only`` refuses
    are a note, not a problem: their records were checked. Raises :class:`ItemError` if ``path`` is no
    ``torch.save`` file at all (neither a zip archive nor a legacy file that loads), ``OSError`` if unreadable.
    """
    report = VerifyReport(files=1)
    try:
        integrity.open_regular(path).close()  # a FIFO or device would block the reads below
    except CorruptCheckpointError as e:
        report.problems.append(str(e))
        return report
    if not is_zip_file(path):
        if path.stat().st_size == 0:
            report.problems.append(f"{path}: empty (0 bytes): truncated, or never written")
            return report
        _load_check(path, report, ItemError)
        report.add_counts(bytes_read=path.stat().st_size)
        report.notes.append("a legacy torch.save file (not a zip archive): it loads, but it records no CRC32")
        return report
    with open(path, "rb") as f:
        try:
            check = scan_torch_zip(f)
        except ArchiveError as e:
            size = path.stat().st_size
            report.problems.append(f"{path}: corrupt: {e}; the file ({size} bytes) is truncated or damaged")
            return report
    report.add_counts(items=check.records, bytes_read=check.bytes_read, crc_checked=check.crc_checked)
    report.problems.extend(f"{path}: corrupt: {bad}" for bad in check.bad)
    _load_check(path, report, None)
    return report


def _load_check(path: Path, report: VerifyReport, raise_as: type[Exception] | None, what: str = "it") -> None:
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
            report.notes.append(f"{what} does not load with weights_only=True ({weights_only_reason(e)}): torch.load "
                                "needs weights_only=False (only for checkpoints you trust)")
        elif raise_as is not None:
            raise raise_as(f"{path}: not a checkpoint (not a torch.save file: {first_line(e)})") from None
        else:
            report.problems.append(f"{path}: does not load with weights_only=True ({first_line(e)})")
