"""Verifying a committed checkpoint directory (the CLI's ``verify``): every item of every shard file is read
and checked against ``.metadata`` (byte range, torch.save zip records and their CRC32, tensor shape and dtype).

torch is imported by the functions that need it, not by importing this module.
"""

from __future__ import annotations

import io
import pickle
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_asyncckpt import commit
from lightning_asyncckpt.items import META_FILE, decode, dtype_name, first_line
from lightning_asyncckpt.metadata import MetadataError, read_metadata

_ZIP_MAGIC = b"PK\x03\x04"


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_checkpoint`: ``problems`` is empty for a sound checkpoint."""

    items: int = 0
    files: int = 0
    bytes_read: int = 0
    crc_checked: int = 0  # items whose zip records carry CRC32 and were checked against it
    problems: list[str] = field(default_factory=list)


def check_torch_zip(data: bytes) -> bool:
    """Reads every record of a ``torch.save`` payload with torch's own zip reader (the bytes ``torch.load``
    would use) and checks each against the size and CRC32 in the archive's central directory.

    ``torch.load`` checks no CRC. Returns whether any CRC was recorded
    (``torch.serialization.set_crc32_options(False)`` writes zeros); raises ``ValueError`` saying what is wrong.
    """
    import torch

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            directory = {m.filename.split("/", 1)[-1]: m for m in zf.infolist()}
    except Exception as e:  # noqa: BLE001 - BadZipFile, or any error of a damaged archive's fields
        raise ValueError(f"damaged zip directory ({first_line(e)})") from None
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        names = reader.get_all_records()
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"torch cannot open it ({first_line(e)})") from None
    if sorted(names) != sorted(directory):
        raise ValueError(f"torch reads the records {sorted(names)}, the zip directory lists {sorted(directory)}")
    checked = False
    for name in names:
        member = directory[name]
        try:
            record = reader.get_record(name)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"record {name!r} cannot be read ({first_line(e)})") from None
        if len(record) != member.file_size:
            raise ValueError(f"record {name!r} has {len(record)} bytes, the zip directory says {member.file_size}")
        if member.CRC:
            checked = True
            if zlib.crc32(record) != member.CRC:
                raise ValueError(f"record {name!r} does not match its CRC32: its bytes changed after the save")
    return checked


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
    if data[:4] != _ZIP_MAGIC:  # DCP's planner writes tensors and objects alike with torch.save
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
            if data[:4] != _ZIP_MAGIC:  # written with torch.save
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
