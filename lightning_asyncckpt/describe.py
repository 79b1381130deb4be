"""What a checkpoint directory holds, as a JSON-able dict (the CLI's ``inspect``): status, step and epoch,
writer, sizes, largest tensors, non-tensor keys. Reads ``.metadata`` and the non-tensor state only.

torch is imported by :func:`describe` when it reads ``.metadata``, not by importing this module.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from lightning_asyncckpt import commit
from lightning_asyncckpt.items import META_FILE, PICKLE_HINT, ItemError, dtype_name, read_object, torch_load
from lightning_asyncckpt.metadata import read_metadata

SKELETON_KEY = "lightning_asyncckpt.skeleton"  # staging.SKELETON_KEY, without importing torch for it
SHARD_RE = re.compile(r"^__(\d+)_\d+")  # DCP's shard files: __<rank>_<n>.distcp


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
    Raises ``OSError`` or :class:`~lightning_asyncckpt.metadata.MetadataError` if ``.metadata`` is unreadable.
    """
    reason = incomplete_reason(path)
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
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(path, allow_pickle, hint)
    ranks = {m.group(1) for s in metadata.storage_data.values() if (m := SHARD_RE.match(s.relative_path))}
    info["writer_ranks"] = len(ranks) or None
    tensors = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
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
        if SKELETON_KEY in metadata.state_dict_metadata:
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
    elif layout == "dcp":  # a stock DCP checkpoint: its non-tensor items are stored one by one
        keys = [k for k, md in metadata.state_dict_metadata.items() if not isinstance(md, TensorStorageMetadata)]
        info["non_tensor_keys"] = keys
        for key in ("global_step", "epoch"):
            if key in keys:
                try:
                    info[key] = _plain(read_object(path, metadata, key, allow_pickle, hint))
                except ItemError as e:
                    info["notes"].append(f"{key} not read: {e}")
    return info


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):  # a 0-d tensor or numpy scalar
        value = value.item()
    return value if value is None or isinstance(value, (int, float, str, bool)) else str(value)
