"""What a checkpoint holds, as a JSON-able dict (the CLI's ``inspect``): status, step and epoch, writer,
sizes, largest tensors, non-tensor keys, and those dicts as text (:func:`format_description`).

A checkpoint directory (:func:`describe`): reads ``.metadata`` and the non-tensor state only. A ``torch.save``
file (:func:`describe_file`, the single-file format stock Lightning writes): loaded memory-mapped, so that
tensor data is not read.

torch is imported by the functions that read a checkpoint, not by importing this module.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Any

from lightning_asyncckpt.format.metadata import MetadataError, read_metadata
from lightning_asyncckpt.storage import commit
from lightning_asyncckpt.storage.commit import SKELETON_FILE, read_info
from lightning_asyncckpt.tools.items import (
    META_FILE,
    PICKLE_HINT,
    ItemError,
    dtype_name,
    first_line,
    is_zip_file,
    load_file,
    read_object,
    torch_load,
)
from lightning_asyncckpt.units import human_bytes

SKELETON_KEY = "lightning_asyncckpt.skeleton"  # staging.SKELETON_KEY, without importing torch for it
SHARD_RE = re.compile(r"^__(\d+)_\d+")  # DCP's shard files: __<rank>_<n>.distcp
DIR_FORMAT = "DCP directory"
FILE_FORMAT = "torch.save file"


def incomplete_reason(path: Path) -> str | None:
    """Why the checkpoint directory ``path`` is not a committed checkpoint; ``None`` if it is one."""
    if commit.is_leftover(path.name):
        return "the leftover of an interrupted save (it was never committed)"
    if not commit.is_committed(path):
        return f"no {commit.METADATA_FILE}: the save did not finish"
    return None


def describe(path: Path, allow_pickle: bool = False, hint: str = PICKLE_HINT) -> dict[str, Any]:
    """What ``inspect`` reports about the checkpoint directory ``path``, as a JSON-able dict.

    The writing engine, worker and world size at save come from ``.asyncckpt.json``, which this library
    writes into every checkpoint; other writers' checkpoints show ``"unknown"``. ``writer_ranks`` counts
    the ranks that wrote shard files (``__<rank>_<n>.distcp``). Non-tensor state that cannot be read
    (e.g. objects ``weights_only`` refuses; ``hint`` says how to allow them) becomes a note.
    Raises ``OSError`` or :class:`~lightning_asyncckpt.format.metadata.MetadataError` if ``.metadata`` is unreadable.
    """
    reason = incomplete_reason(path)
    files = [p for p in sorted(path.iterdir()) if p.is_file()]
    info: dict[str, Any] = {
        "path": str(path),
        "format": DIR_FORMAT,
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
        "writer_ranks": len({m.group(1) for p in files if (m := SHARD_RE.match(p.name))}) or None,
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
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    metadata = read_metadata(path, allow_pickle, hint)
    ranks = {m.group(1) for s in metadata.storage_data.values() if (m := SHARD_RE.match(s.relative_path))}
    info["writer_ranks"] = len(ranks) or None
    tensors = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            if not isinstance(getattr(md, "size", None), tuple) or not isinstance(getattr(md, "properties", None),
                                                                                   TensorProperties):
                raise MetadataError(f"cannot read {path / commit.METADATA_FILE}: not DCP metadata (the entry {fqn!r} "
                                    "has no size or properties)")
            numel = 1
            for d in md.size:
                numel *= d
            tensors.append((numel * md.properties.dtype.itemsize, fqn, list(md.size), dtype_name(md.properties.dtype)))
    tensors.sort(key=lambda t: (-t[0], t[1]))
    info["num_tensors"] = len(tensors)
    info["tensor_bytes"] = sum(t[0] for t in tensors)
    info["largest_tensors"] = [{"name": n, "shape": s, "dtype": d, "bytes": b} for b, n, s, d in tensors[:5]]

    state, layout = None, "dcp"
    try:
        if (path / SKELETON_FILE).is_file():  # replicated layouts: the skeleton beside the items
            info_file = read_info(path) or {}
            layout = info_file.get("layout") or "single-writer"
            state = torch_load(path / SKELETON_FILE, allow_pickle, str(path / SKELETON_FILE), hint)
        elif SKELETON_KEY in metadata.state_dict_metadata:  # 0.1's layout: the skeleton as an item
            layout = "single-writer"
            state = read_object(path, metadata, SKELETON_KEY, allow_pickle, hint)
        elif (path / META_FILE).is_file():
            layout = "sharded"
            state = torch_load(path / META_FILE, allow_pickle, str(path / META_FILE), hint)
    except ItemError as e:
        info["notes"].append(f"non-tensor state not read: {e}")
    info["layout"] = layout
    if isinstance(state, dict):
        info["non_tensor_keys"] = [str(k) for k in state]
        info["global_step"] = _plain(state.get("global_step"))
        info["epoch"] = _plain(state.get("epoch"))
    elif layout != "sharded" and SKELETON_KEY not in metadata.state_dict_metadata:
        # a stock DCP checkpoint, or ours whose skeleton could not be read: non-tensor items one by one
        keys = [k for k, md in metadata.state_dict_metadata.items() if not isinstance(md, TensorStorageMetadata)]
        info["non_tensor_keys"] = keys
        for key in ("global_step", "epoch"):
            if key in keys:
                try:
                    info[key] = _plain(read_object(path, metadata, key, allow_pickle, hint))
                except ItemError as e:
                    info["notes"].append(f"{key} not read: {e}")
    return info


def _plain(value: object) -> int | float | str | bool | None:
    if hasattr(value, "item") and callable(value.item):  # a 0-d tensor or numpy scalar
        value = value.item()
    return value if value is None or isinstance(value, (int, float, str, bool)) else str(value)


def describe_file(path: Path, allow_pickle: bool = False, hint: str = PICKLE_HINT) -> dict[str, Any]:
    """What ``inspect`` reports about the ``torch.save`` file ``path`` (stock Lightning's single-file format),
    with the keys of :func:`describe`. ``status`` is ``"complete"``, or ``"incomplete"`` for the hidden file
    of an interrupted save (``.asyncckpt-incomplete-...``). Tensors are named by their dotted path into the
    nested dicts and lists (``state_dict.layer.weight``, ``optimizer_states.0.state.0.exp_avg``).
    Raises :class:`ItemError` if ``path`` is no checkpoint (neither a zip archive nor a legacy ``torch.save``
    file, or not a dict) or a complete file cannot be read; for an incomplete one that becomes a note.
    """
    reason = incomplete_reason_file(path)
    info: dict[str, Any] = {
        "path": str(path), "format": FILE_FORMAT, "status": "incomplete" if reason else "complete",
        "reason": reason, "layout": None, "global_step": None, "epoch": None, "engine": None,
        "engine_version": None, "worker": None, "world_size": None, "written_by": None, "writer_ranks": None,
        "files": 1, "file_bytes": path.stat().st_size, "num_tensors": None, "tensor_bytes": None,
        "largest_tensors": None, "non_tensor_keys": None, "notes": [],
    }
    zipped = is_zip_file(path)
    try:
        state = load_file(path, allow_pickle, str(path), hint)
    except ItemError as e:
        if reason is not None:
            info["notes"].append(f"not read: {e}")
            return info
        if not zipped:
            raise ItemError(f"{path}: not a checkpoint (neither a checkpoint directory nor a torch.save file)") from None
        if "Unsupported global" in str(e):  # the contents are one pickle: nothing is read without it
            info["notes"].append(f"contents not read: {e}")
            return info
        try:
            zipfile.ZipFile(path).close()
        except zipfile.BadZipFile as ze:
            raise ItemError(f"cannot read {path}: a damaged or truncated torch.save file ({first_line(ze)})") from None
        raise
    if not isinstance(state, dict):
        raise ItemError(f"{path}: not a checkpoint (a torch.save file of a {type(state).__name__}, not a dict)")
    tensors = sorted(_tensors(state, ""), key=lambda t: (-t[0], t[1]))
    info["num_tensors"] = len(tensors)
    info["tensor_bytes"] = sum(t[0] for t in tensors)
    info["largest_tensors"] = [{"name": n, "shape": s, "dtype": d, "bytes": b} for b, n, s, d in tensors[:5]]
    info["non_tensor_keys"] = [str(k) for k, v in state.items() if not _is_tensor(v)]
    info["global_step"] = _plain(state.get("global_step"))
    info["epoch"] = _plain(state.get("epoch"))
    return info


def incomplete_reason_file(path: Path) -> str | None:
    """Why the file ``path`` is not a complete checkpoint (the hidden file of an interrupted save); else ``None``."""
    if commit.is_leftover(path.name):
        return "the leftover of an interrupted save (it was never committed)"
    return None


def _is_tensor(value: object) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _tensors(obj: object, prefix: str) -> list[tuple[int, str, list[int], str]]:
    """(bytes, dotted name, shape, dtype) of every tensor in the nested dicts, lists and tuples ``obj``."""
    if _is_tensor(obj):
        return [(obj.numel() * obj.element_size(), prefix, list(obj.shape), dtype_name(obj.dtype))]
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return []
    found = []
    for key, value in items:
        found.extend(_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def format_description(info: dict[str, Any]) -> list[str]:
    """The lines ``inspect`` prints for ``info`` (:func:`describe` or :func:`describe_file`)."""
    lines = []

    def line(label: str, value: object) -> None:
        lines.append(f"{label + ':':<18}{value}")

    is_file = info.get("format") == FILE_FORMAT
    line("path", info["path"])
    if is_file:
        line("format", f"{FILE_FORMAT} (a single file, as stock Lightning writes)")
    line("status", info["status"] + (f" ({info['reason']})" if info["reason"] else ""))
    if info["layout"]:
        line("layout", info["layout"])
    line("global step", "unknown" if info["global_step"] is None else info["global_step"])
    line("epoch", "unknown" if info["epoch"] is None else info["epoch"])
    if is_file:
        line("size", f"{human_bytes(info['file_bytes'])} ({info['file_bytes']} bytes)")
    else:
        if info["engine"] == "unknown":
            line("engine", "unknown (not written by lightning-asyncckpt)")
        else:
            version = f" {info['engine_version']}" if info["engine_version"] else ""
            line("engine", f"{info['engine']}{version}, {info['worker']} worker ({info['written_by']})")
        writers = info["writer_ranks"]
        line("world size", f"{info['world_size']}" + (f"; {writers} rank(s) wrote shard files" if writers else ""))
        line("files", f"{info['files']} ({human_bytes(info['file_bytes'])})")
    if info["num_tensors"] is not None:
        line("tensors", f"{info['num_tensors']} ({human_bytes(info['tensor_bytes'])}, {info['tensor_bytes']} bytes)")
        if info["largest_tensors"]:
            lines.append("largest tensors:")
            width = max(len(t["name"]) for t in info["largest_tensors"])
            for t in info["largest_tensors"]:
                shape = "[" + ", ".join(str(d) for d in t["shape"]) + "]"
                lines.append(f"  {t['name']:<{width}}  {shape:<14} {t['dtype']:<9} {human_bytes(t['bytes'])}")
    if info["non_tensor_keys"] is not None:
        line("non-tensor keys", ", ".join(info["non_tensor_keys"]) or "(none)")
    for note in info["notes"]:
        line("note", note)
    return lines
