"""The ``lightning-asyncckpt`` command: inspect, verify, convert and clean checkpoint directories.

Exit status: 0 success; 1 the checkpoint failed verification, or a conversion or removal failed; 2 bad
input (a missing path, a path that is not a checkpoint, an unreadable ``.metadata``, a usage error).
A user error is one line on stderr, never a traceback.

torch is imported by the commands that need it, and Lightning only by ``convert FILE DIR`` (which saves
with :class:`~lightning_asyncckpt.AsyncCheckpointIO`), so that ``--help`` and ``clean`` start fast.
Unpickling is restricted unless ``--allow-pickle`` is given: ``.metadata`` may only name DCP's metadata
types, and the non-tensor state is read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import re
import shutil
import sys
import time
import warnings
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_asyncckpt import commit

PROG = "lightning-asyncckpt"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
SKELETON_KEY = "lightning_asyncckpt.skeleton"  # staging.SKELETON_KEY, without importing torch for it
META_FILE = "meta.pt"  # dcp_format.META_FILE
_SHARD_RE = re.compile(r"^__(\d+)_\d+")  # DCP's shard files: __<rank>_<n>.distcp
_ZIP_MAGIC = b"PK\x03\x04"
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
_ALLOW_PICKLE_HINT = "pass --allow-pickle if you trust this checkpoint"


class CliError(Exception):
    """A user error: printed as one line on stderr, and the command exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


# -------------------------------------------------------------------------------------------------
# Reading a checkpoint directory


def _torch() -> Any:
    import torch

    return torch


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` allowing only the types it is made of (no code from the file runs)."""

    _GLOBALS = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        # stock DCP records the checkpoint's path in ``storage_meta``
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
    _MODULES = ("torch.distributed.checkpoint.metadata",)

    def find_class(self, module: str, name: str) -> Any:
        torch = _torch()
        if (module, name) in self._GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in self._MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        raise pickle.UnpicklingError(f"it references {module}.{name}, which is not a type of DCP metadata")


def read_metadata(path: Path, allow_pickle: bool = False) -> Any:
    """Reads DCP's ``.metadata`` of the checkpoint directory ``path``; raises :class:`CliError` if it is
    not readable DCP metadata."""
    from torch.distributed.checkpoint.metadata import Metadata

    meta_path = path / commit.METADATA_FILE
    try:
        with open(meta_path, "rb") as f:
            metadata = pickle.load(f) if allow_pickle else _MetadataUnpickler(f).load()
    except OSError as e:
        raise CliError(f"cannot read {meta_path}: {e.strerror or e}") from None
    except pickle.UnpicklingError as e:
        hint = f"; {_ALLOW_PICKLE_HINT}" if "not a type of DCP metadata" in str(e) else ""
        raise CliError(f"cannot read {meta_path}: {e}{hint}") from None
    except Exception as e:  # noqa: BLE001 - garbage: any error of the unpickler
        raise CliError(f"cannot read {meta_path}: not DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise CliError(f"cannot read {meta_path}: not DCP metadata (a {type(metadata).__name__})")
    return metadata


def _existing(path_arg: str) -> Path:
    path = Path(path_arg)
    if not os.path.lexists(path):
        raise CliError(f"{path}: no such file or directory")
    return path


def _checkpoint_dir(path_arg: str) -> Path:
    """``path_arg`` as an existing directory that looks like a checkpoint (committed or not)."""
    path = _existing(path_arg)
    if not path.is_dir():
        raise CliError(f"{path}: not a checkpoint directory (a regular file; `convert` reads torch.save files)")
    if not (path / commit.METADATA_FILE).exists() and not commit.is_leftover(path.name) and not _shard_files(path):
        raise CliError(f"{path}: not a checkpoint directory (no {commit.METADATA_FILE} and no shard files)")
    return path


def _shard_files(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.name.endswith(".distcp"))
    except OSError:
        return []


def _incomplete_reason(path: Path) -> str | None:
    """Why the checkpoint directory ``path`` is not a committed checkpoint; ``None`` if it is one."""
    if commit.is_leftover(path.name):
        return "the leftover of an interrupted save (it was never committed)"
    if not commit.is_committed(path):
        return f"no {commit.METADATA_FILE}: the save did not finish"
    return None


def _read_range(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _decode(path: Path, info: Any, raw: bytes) -> bytes:
    """The item's bytes after DCP's storage transforms (none unless an extension wrote it)."""
    descriptors = getattr(info, "transform_descriptors", None)
    if not descriptors:
        return raw
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return FileSystemReader(str(path)).transforms.transform_load_stream(None, descriptors, io.BytesIO(raw)).read()


def _torch_load(data: bytes | Path, allow_pickle: bool, what: str) -> Any:
    torch = _torch()
    source = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        return torch.load(source, map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as e:
        if allow_pickle:
            raise CliError(f"cannot read {what}: {_first_line(e)}") from None
        raise CliError(f"cannot read {what} with weights_only=True ({_weights_only_reason(e)}); "
                       f"{_ALLOW_PICKLE_HINT}") from None
    except Exception as e:  # noqa: BLE001 - a corrupt file: any error of torch.load
        raise CliError(f"cannot read {what}: {_first_line(e)}") from None


def _weights_only_reason(e: BaseException) -> str:
    """The cause in torch's long ``weights_only`` message (``Unsupported global: GLOBAL m.C ...``)."""
    text = _ANSI_RE.sub("", str(e))
    m = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    return m.group(1).split(". ")[0].rstrip(".") if m else _first_line(e)


def _first_line(e: BaseException) -> str:
    lines = _ANSI_RE.sub("", str(e)).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _tree_size(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed)."""
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


# -------------------------------------------------------------------------------------------------
# inspect


def describe(path: Path, allow_pickle: bool = False) -> dict[str, Any]:
    """What ``inspect`` reports about the checkpoint directory ``path``, as a JSON-able dict.

    The writing engine, worker and world size at save come from ``.asyncckpt.json``, which this library
    writes into every checkpoint; other writers' checkpoints show ``"unknown"``. ``writer_ranks`` counts
    the ranks that wrote shard files (``__<rank>_<n>.distcp``).
    """
    reason = _incomplete_reason(path)
    files = [p for p in sorted(path.iterdir()) if p.is_file()]
    info: dict[str, Any] = {
        "path": str(path),
        "status": "incomplete" if reason else "committed",
        "reason": reason,
        "layout": None,
        "global_step": None,
        "epoch": None,
        "engine": "unknown",
        "engine_version": None,
        "worker": None,
        "world_size": "unknown",
        "written_by": None,
        "writer_ranks": len({m.group(1) for p in files if (m := _SHARD_RE.match(p.name))}) or None,
        "files": len(files),
        "file_bytes": sum(p.stat().st_size for p in files),
        "num_tensors": None,
        "tensor_bytes": None,
        "largest_tensors": None,
        "non_tensor_keys": None,
        "notes": [],
    }
    writer = commit.read_info(path)
    if writer is not None:
        info["engine"] = writer.get("engine") or "unknown"
        info["engine_version"] = writer.get("engine_version")
        info["worker"] = writer.get("worker")
        info["world_size"] = writer.get("world_size") or "unknown"
        info["written_by"] = writer.get("writer")
    if not (path / commit.METADATA_FILE).is_file():
        return info
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(path, allow_pickle)
    ranks = {m.group(1) for s in metadata.storage_data.values() if (m := _SHARD_RE.match(s.relative_path))}
    info["writer_ranks"] = len(ranks) or None
    tensors = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            numel = 1
            for d in md.size:
                numel *= d
            tensors.append((numel * md.properties.dtype.itemsize, fqn, list(md.size), _dtype_name(md.properties.dtype)))
    tensors.sort(key=lambda t: (-t[0], t[1]))
    info["num_tensors"] = len(tensors)
    info["tensor_bytes"] = sum(t[0] for t in tensors)
    info["largest_tensors"] = [{"name": n, "shape": s, "dtype": d, "bytes": b} for b, n, s, d in tensors[:5]]

    state, layout = None, "dcp"
    try:
        if SKELETON_KEY in metadata.state_dict_metadata:
            layout = "single-writer"
            state = _read_object(path, metadata, SKELETON_KEY, allow_pickle)
        elif (path / META_FILE).is_file():
            layout = "sharded"
            state = _torch_load(path / META_FILE, allow_pickle, str(path / META_FILE))
    except CliError as e:
        info["notes"].append(f"non-tensor state not read: {e}")
    info["layout"] = layout
    if isinstance(state, dict):
        info["non_tensor_keys"] = [str(k) for k in state]
        info["global_step"] = _plain(state.get("global_step"))
        info["epoch"] = _plain(state.get("epoch"))
    elif layout == "dcp":  # a stock DCP checkpoint: its non-tensor items are stored one by one
        keys = [k for k, md in metadata.state_dict_metadata.items() if not isinstance(md, TensorStorageMetadata)]
        info["non_tensor_keys"] = keys
        for key in ("global_step", "epoch"):
            if key in keys:
                try:
                    info[key] = _plain(_read_object(path, metadata, key, allow_pickle))
                except CliError as e:
                    info["notes"].append(f"{key} not read: {e}")
    return info


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):  # a 0-d tensor or numpy scalar
        value = value.item()
    return value if value is None or isinstance(value, (int, float, str, bool)) else str(value)


def _read_object(path: Path, metadata: Any, fqn: str, allow_pickle: bool) -> Any:
    """Unpickles the bytes item ``fqn`` (an object that DCP's planner stored with ``torch.save``)."""
    for index, storage in metadata.storage_data.items():
        if index.fqn == fqn:
            try:
                raw = _read_range(path / storage.relative_path, storage.offset, storage.length)
            except OSError as e:
                raise CliError(f"cannot read {path / storage.relative_path}: {e.strerror or e}") from None
            return _torch_load(_decode(path, storage, raw), allow_pickle, f"{fqn!r} in {path}")
    raise CliError(f"{path}: {fqn!r} has no storage entry in {commit.METADATA_FILE}")


def _print_description(info: dict[str, Any]) -> None:
    def line(label: str, value: Any) -> None:
        print(f"{label + ':':<18}{value}")

    line("path", info["path"])
    line("status", info["status"] + (f" ({info['reason']})" if info["reason"] else ""))
    if info["layout"]:
        line("layout", info["layout"])
    line("global step", "unknown" if info["global_step"] is None else info["global_step"])
    line("epoch", "unknown" if info["epoch"] is None else info["epoch"])
    if info["engine"] == "unknown":
        line("engine", "unknown (not written by lightning-asyncckpt)")
    else:
        version = f" {info['engine_version']}" if info["engine_version"] else ""
        line("engine", f"{info['engine']}{version}, {info['worker']} worker ({info['written_by']})")
    writers = info["writer_ranks"]
    line("world size", f"{info['world_size']}" + (f"; {writers} rank(s) wrote shard files" if writers else ""))
    line("files", f"{info['files']} ({_human(info['file_bytes'])})")
    if info["num_tensors"] is not None:
        line("tensors", f"{info['num_tensors']} ({_human(info['tensor_bytes'])}, {info['tensor_bytes']} bytes)")
        if info["largest_tensors"]:
            print("largest tensors:")
            width = max(len(t["name"]) for t in info["largest_tensors"])
            for t in info["largest_tensors"]:
                shape = "[" + ", ".join(str(d) for d in t["shape"]) + "]"
                print(f"  {t['name']:<{width}}  {shape:<14} {t['dtype']:<9} {_human(t['bytes'])}")
    if info["non_tensor_keys"] is not None:
        line("non-tensor keys", ", ".join(info["non_tensor_keys"]) or "(none)")
    for note in info["notes"]:
        line("note", note)


def cmd_inspect(args: argparse.Namespace) -> int:
    """``inspect PATH [--json]``: status, step and epoch, sizes, largest tensors, non-tensor keys."""
    path = _checkpoint_dir(args.path)
    info = describe(path, args.allow_pickle)
    if args.json:
        print(json.dumps(info))
    else:
        _print_description(info)
    return EXIT_OK


# -------------------------------------------------------------------------------------------------
# verify


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
    torch = _torch()
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            directory = {m.filename.split("/", 1)[-1]: m for m in zf.infolist()}
    except Exception as e:  # noqa: BLE001 - BadZipFile, or any error of a damaged archive's fields
        raise ValueError(f"damaged zip directory ({_first_line(e)})") from None
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        names = reader.get_all_records()
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"torch cannot open it ({_first_line(e)})") from None
    if sorted(names) != sorted(directory):
        raise ValueError(f"torch reads the records {sorted(names)}, the zip directory lists {sorted(directory)}")
    checked = False
    for name in names:
        member = directory[name]
        try:
            record = reader.get_record(name)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"record {name!r} cannot be read ({_first_line(e)})") from None
        if len(record) != member.file_size:
            raise ValueError(f"record {name!r} has {len(record)} bytes, the zip directory says {member.file_size}")
        if member.CRC:
            checked = True
            if zlib.crc32(record) != member.CRC:
                raise ValueError(f"record {name!r} does not match its CRC32: its bytes changed after the save")
    return checked


def _check_item(path: Path, index: Any, storage: Any, md: Any, raw: bytes, report: VerifyReport) -> str | None:
    """Checks one item's bytes; returns what is wrong, or ``None``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    torch = _torch()
    try:
        data = _decode(path, storage, raw)
    except Exception as e:  # noqa: BLE001
        return f"cannot undo the storage transforms {storage.transform_descriptors} ({_first_line(e)})"
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
        return f"does not deserialize ({_first_line(e)})"
    except Exception as e:  # noqa: BLE001 - any error of torch.load is a corrupt item
        return f"does not deserialize ({_first_line(e)})"
    if not isinstance(md, TensorStorageMetadata):
        return None
    if not isinstance(obj, torch.Tensor):
        return f"holds a {type(obj).__name__}, not a tensor"
    chunk = next((c for c in md.chunks if list(c.offsets) == list(index.offset or [])), None)
    if chunk is None:
        return f"is stored at offsets {list(index.offset or [])}, which are no chunk of the tensor"
    shape = list(chunk.sizes)
    if list(obj.shape) != shape or obj.dtype != md.properties.dtype:
        return (f"holds {_dtype_name(obj.dtype)}{list(obj.shape)}, the metadata says "
                f"{_dtype_name(md.properties.dtype)}{shape}")
    return None


def verify_checkpoint(path: Path) -> VerifyReport:
    """Reads every item of every shard file of the committed checkpoint ``path`` and checks it against
    ``.metadata``: its byte range lies within the file, its zip records match their CRC32, and a tensor
    deserializes (``weights_only=True``) with the shape and dtype the metadata gives."""
    report = VerifyReport()
    try:
        metadata = read_metadata(path)
    except CliError as e:
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


def cmd_verify(args: argparse.Namespace) -> int:
    """``verify PATH``: exit 0 with a one-line summary, or 1 naming each bad file and item."""
    path = _checkpoint_dir(args.path)
    reason = _incomplete_reason(path)
    if reason is not None:
        raise CliError(f"{path}: incomplete checkpoint: {reason}", EXIT_FAILED)
    report = verify_checkpoint(path)
    if report.problems:
        for problem in report.problems:
            print(f"FAIL {problem}", file=sys.stderr)
        raise CliError(f"{path}: verification failed: {len(report.problems)} problem(s)", EXIT_FAILED)
    crc = (f"{report.crc_checked} of {report.items} items checked against CRC32"
           if report.crc_checked else "no CRC32 recorded: corrupted tensor data would go unnoticed")
    files = f"{report.files} shard file{'' if report.files == 1 else 's'}"
    print(f"OK {path}: {report.items} items in {files}, "
          f"{report.bytes_read} bytes read; {crc}")
    return EXIT_OK


# -------------------------------------------------------------------------------------------------
# convert


def _check_output(out: Path, force: bool, want_dir: bool) -> None:
    if not os.path.lexists(out):
        return
    if not force:
        raise CliError(f"{out} exists; pass --force to replace it")
    if want_dir and not commit.is_committed(out):
        raise CliError(f"{out} exists and is not a checkpoint directory; --force replaces only a checkpoint directory")
    if not want_dir and (out.is_dir() or out.is_symlink()):
        raise CliError(f"{out} exists and is not a regular file; --force replaces only a file")


def cmd_convert(args: argparse.Namespace) -> int:
    """``convert SRC DST``: a checkpoint directory into one ``torch.save`` file, or the reverse."""
    src, dst = _existing(args.src), Path(args.dst)
    if src.is_dir():
        src = _checkpoint_dir(args.src)
        reason = _incomplete_reason(src)
        if reason is not None:
            raise CliError(f"{src}: incomplete checkpoint: {reason}")
        _check_output(dst, args.force, want_dir=False)
        checkpoint = _load_dir(src, args.allow_pickle)
        _save_file(checkpoint, dst)
        print(f"converted {src} -> {dst} ({_human(dst.stat().st_size)}, torch.save)")
    else:
        _check_output(dst, args.force, want_dir=True)
        checkpoint = _torch_load(src, args.allow_pickle, str(src))
        if not isinstance(checkpoint, dict):
            raise CliError(f"{src}: not a checkpoint (a {type(checkpoint).__name__}, not a dict)")
        _save_dir(checkpoint, dst)
        print(f"converted {src} -> {dst} ({_human(_tree_size(dst))}, checkpoint directory)")
    return EXIT_OK


def _load_dir(path: Path, allow_pickle: bool) -> dict[str, Any]:
    from lightning_asyncckpt import dcp_format

    read_metadata(path, allow_pickle)  # DCP's reader unpickles it without restrictions: check it first
    try:
        return dcp_format.load(path, weights_only=not allow_pickle)
    except pickle.UnpicklingError as e:
        raise CliError(f"cannot read {path} with weights_only=True ({_weights_only_reason(e)}); "
                       f"{_ALLOW_PICKLE_HINT}") from None
    except BaseException as e:  # noqa: BLE001 - a damaged checkpoint: any error of DCP's reader
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CliError(f"cannot read {path} ({_first_line(e)}); run `{PROG} verify {path}`") from None


def _save_file(checkpoint: dict[str, Any], out: Path) -> None:
    """``torch.save`` into a temporary sibling, then one rename: ``out`` is never half-written."""
    torch = _torch()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        torch.save(checkpoint, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except OSError as e:
        raise CliError(f"cannot write {out}: {e.strerror or e}", EXIT_FAILED) from None
    finally:
        tmp.unlink(missing_ok=True)


def _save_dir(checkpoint: dict[str, Any], out: Path) -> None:
    """Saves with ``AsyncCheckpointIO`` into a private staging directory, then commits it at ``out``.

    A save removes the leftovers of interrupted saves in its target's directory, which, in a directory
    that a training job is saving into, may be that job's save in progress; the staging directory is
    empty. It carries the leftover prefix, so that ``clean`` finds it if the conversion is killed.
    """
    from lightning_asyncckpt.errors import CheckpointWriteError
    from lightning_asyncckpt.io import AsyncCheckpointIO

    staging_dir = commit.tmp_for(out, f"convert-{os.getpid()}")
    tmp = staging_dir / out.name
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging_dir.mkdir()
        ckpt_io = AsyncCheckpointIO(worker="fork")
        try:
            ckpt_io.save_checkpoint(checkpoint, tmp)
            ckpt_io.finalize(blocking=True)
        finally:
            ckpt_io.teardown()
        commit.publish(tmp, out)  # an existing checkpoint at ``out`` (--force) is exchanged atomically
    except (CheckpointWriteError, OSError) as e:
        raise CliError(f"cannot write {out}: {str(e).splitlines()[0]}", EXIT_FAILED) from None
    finally:
        commit.remove_path(staging_dir)


# -------------------------------------------------------------------------------------------------
# clean


def cmd_clean(args: argparse.Namespace) -> int:
    """``clean DIR [--yes]``: lists the leftovers of interrupted saves in ``DIR``; removes them with ``--yes``."""
    dirpath = _existing(args.dir)
    if not dirpath.is_dir():
        raise CliError(f"{dirpath}: not a directory")
    try:
        leftovers = sorted(p for p in dirpath.iterdir() if commit.is_leftover(p.name))
    except OSError as e:
        raise CliError(f"cannot list {dirpath}: {e.strerror or e}") from None
    if not leftovers:
        print(f"no leftovers of interrupted saves in {dirpath}")
        return EXIT_OK
    now = time.time()
    sizes = {p: _tree_size(p) for p in leftovers}
    failed = 0
    for p in leftovers:
        age = max(0.0, now - p.lstat().st_mtime)
        what = f"{p} ({_human(sizes[p])}, modified {_age(age)} ago)"
        if not args.yes:
            print(f"would remove {what}")
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            print(f"removed {what}")
        except OSError as e:
            failed += 1
            print(f"cannot remove {p}: {e.strerror or e}", file=sys.stderr)
    total = _human(sum(sizes.values()))
    if not args.yes:
        print(f"{len(leftovers)} leftover(s), {total}; run again with --yes to remove them"
              " (only while no job is saving checkpoints into this directory)")
        return EXIT_OK
    if failed:
        raise CliError(f"{failed} of {len(leftovers)} leftover(s) could not be removed", EXIT_FAILED)
    print(f"removed {len(leftovers)} leftover(s), {total}")
    return EXIT_OK


def _age(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= n:
            return f"{seconds / n:.0f} {unit}"
    return f"{seconds:.0f} s"


# -------------------------------------------------------------------------------------------------
# Entry point


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``lightning-asyncckpt`` command."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Inspect, verify, convert and clean lightning-asyncckpt checkpoint directories."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    allow = dict(action="store_true", help="unpickle arbitrary objects (runs code from the checkpoint: only for"
                                           " checkpoints you trust)")

    p = sub.add_parser("inspect", help="show what a checkpoint directory holds")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--allow-pickle", **allow)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="read every shard file and check it against the metadata")
    p.add_argument("path", metavar="PATH")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("convert", help="checkpoint directory -> one torch.save file, or the reverse",
                       description="A directory SRC becomes one torch.save file DST (loadable by stock Lightning);"
                                   " a torch.save file SRC becomes a checkpoint directory DST.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--force", action="store_true", help="replace an existing DST of the same kind")
    p.add_argument("--allow-pickle", **allow)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("clean", help="list (and with --yes remove) leftovers of interrupted saves in DIR")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--yes", action="store_true", help="remove them (without it, only list them)")
    p.set_defaults(func=cmd_clean)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line ``argv`` (default ``sys.argv[1:]``) and returns the exit status."""
    # torch's import warns about pynvml on some installs: noise on a tool's stderr
    warnings.filterwarnings("ignore", message=".*pynvml package is deprecated", category=FutureWarning)
    # DCP's reader, used without a process group on purpose
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors and --help; argparse has printed its message
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return args.func(args)
    except CliError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
