"""The DCP directory on disk: its file names, and reading one back into the dict that was saved.

Reading uses DCP's ``FileSystemReader``, handed the ``.metadata`` that
:func:`lightning_asyncckpt.format.metadata.read_metadata` unpickled (restricted to DCP's types unless
``weights_only=False``), and :func:`staging.join` to rebuild the nested dict. Planning a save is
:mod:`lightning_asyncckpt.pipeline.dcp_plan`.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_asyncckpt.format import commit, integrity
from lightning_asyncckpt.format.metadata import read_metadata
from lightning_asyncckpt.snapshot import staging

META_FILE = "meta.pt"  # Lightning's name for the non-tensor state of a sharded checkpoint
SKELETON_FILE = commit.SKELETON_FILE
_PICKLE_HINT = "load it with weights_only=False if you trust this checkpoint"


class _RawBytesLoadPlanner(DefaultLoadPlanner):
    """Keeps byte items as raw bytes, so that the caller decides how to unpickle (``weights_only``)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.raw: dict[str, bytes] = {}

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.raw[read_item.dest_index.fqn] = value.read()


class _Reader(FileSystemReader):
    """DCP's reader, returning the metadata it is given instead of unpickling ``.metadata`` itself
    (without restrictions)."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if hasattr(self._metadata, "storage_meta") and hasattr(self, "load_id"):  # as FileSystemReader does
            from torch.distributed.checkpoint.metadata import StorageMeta

            if self._metadata.storage_meta is None:
                self._metadata.storage_meta = StorageMeta()
            self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def load(path: Path, map_location: Any = None, weights_only: bool | None = None, verify: bool = True) -> dict[str, Any]:
    """Reads a checkpoint directory back into the dict that was saved (local, no collectives).

    Unless ``weights_only`` is ``False``, ``.metadata`` may name only DCP's metadata types (else
    :class:`~lightning_asyncckpt.format.metadata.MetadataError`, an ``UnpicklingError`` naming the file), as the
    objects are read with ``torch.load(weights_only=...)``. Before any item is read, every item's file must lie
    inside ``path`` and be a regular file, and (``verify``) every item must match its CRC32
    (:func:`~lightning_asyncckpt.format.integrity.check_directory`: else
    :class:`~lightning_asyncckpt.format.integrity.CorruptCheckpointError`, naming the file and the item).
    """
    metadata = read_metadata(path, allow_pickle=weights_only is False, hint=_PICKLE_HINT)
    integrity.check_directory(path, metadata, crc=False)  # paths and sizes, before anything is read
    if not verify:
        return _load(path, metadata, map_location, weights_only)
    return integrity.while_loading(lambda: integrity.check_directory(path, metadata),
                                   lambda: _load(path, metadata, map_location, weights_only))


def _load(path: Path, metadata: Metadata, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
    reader = _Reader(path, metadata)
    state: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            state[fqn] = None
    planner = _RawBytesLoadPlanner()
    try:
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as e:  # a BaseException, which would pass by `except Exception`
        failures = getattr(e, "failures", {}) or {}
        cause = next(iter(failures.values()), e)
        raise integrity.CorruptCheckpointError(f"{path}: cannot be read ({integrity.first_line(cause)})") from None
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if map_location is not None and not callable(map_location) and not isinstance(map_location, dict):
        tensors = {k: v.to(map_location) for k, v in tensors.items()}
    objects = {
        k: _load_file(io.BytesIO(v), weights_only, f"item {k!r} of {path}") for k, v in planner.raw.items()
    }
    skeleton = objects.pop(staging.SKELETON_KEY, None)  # 0.1's layout kept it as an item
    if (path / SKELETON_FILE).is_file():
        skeleton = _load_file(path / SKELETON_FILE, weights_only)
    if skeleton is not None:
        return staging.join(skeleton, tensors)
    # a sharded checkpoint (ModelParallelStrategy's layout) or another DCP checkpoint: its nested contents,
    # with the non-tensor state of ``meta.pt`` beside them
    flat = {**tensors, **objects}
    mappings = metadata.planner_data
    if isinstance(mappings, dict) and set(flat) <= set(mappings):
        from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

        flat = unflatten_state_dict(flat, mappings)
    meta = path / META_FILE
    if meta.is_file():
        flat.update(_load_file(meta, weights_only))
    return flat


def _load_file(source: Any, weights_only: bool | None, what: str = "") -> Any:
    """``torch.load`` of a file of the checkpoint; an object ``weights_only`` refuses is an ``UnpicklingError``
    naming the file."""
    import pickle

    try:
        return torch.load(source, weights_only=weights_only) if weights_only is not None else torch.load(source)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(f"{what or source}: {e}") from None
    except Exception as e:  # torch's errors do not say which file: the checkpoint cannot be used
        raise integrity.CorruptCheckpointError(f"{what or source}: cannot be read ({integrity.first_line(e)})") from e
