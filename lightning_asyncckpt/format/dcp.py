"""The DCP directory on disk: its file names, and reading one back into the dict that was saved.

Reading uses :class:`~lightning_asyncckpt.format.dcp_reader.CheckedReader` (DCP's ``FileSystemReader``, checking
each item's CRC32 in the bytes it loads), handed the ``.metadata`` that
:func:`lightning_asyncckpt.format.metadata.read_metadata` unpickled (restricted to DCP's types unless
``weights_only=False``), and :func:`staging.join` to rebuild the nested dict. Planning a save is
:mod:`lightning_asyncckpt.pipeline.dcp_plan`.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_asyncckpt.format import integrity
from lightning_asyncckpt.format.dcp_reader import CheckedReader, failure
from lightning_asyncckpt.format.metadata import read_metadata
from lightning_asyncckpt.snapshot import staging, subclasses
from lightning_asyncckpt.storage import commit

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import ReadItem
    from torch.serialization import MAP_LOCATION

META_FILE = "meta.pt"  # Lightning's name for the non-tensor state of a sharded checkpoint
SKELETON_FILE = commit.SKELETON_FILE
PICKLE_HINT = "load it with weights_only=False if you trust this checkpoint"


class _RawBytesLoadPlanner(DefaultLoadPlanner):
    """Keeps byte items as raw bytes, so that the caller decides how to unpickle (``weights_only``)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.raw: dict[str, bytes] = {}
        self.whole: dict[str, torch.Tensor] = {}

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.raw[read_item.dest_index.fqn] = value.read()

    def keep_whole(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """A tensor subclass item (torchao's optimizer states), kept as saved rather than copied into the plain
        placeholder (which would dequantize it)."""
        self.whole[read_item.dest_index.fqn] = tensor


def load(path: Path, map_location: MAP_LOCATION = None, weights_only: bool | None = None, verify: bool = True) -> dict[str, Any]:
    """Reads a checkpoint directory back into the dict that was saved (local, no collectives).

    Unless ``weights_only`` is ``False``, ``.metadata`` may name only DCP's metadata types (else
    :class:`~lightning_asyncckpt.format.metadata.MetadataError`, an ``UnpicklingError`` naming the file), as the
    objects are read with ``torch.load(weights_only=...)``. Before any item is read, every item's file must lie
    inside ``path`` and be a regular file (:func:`~lightning_asyncckpt.format.integrity.check_directory`); with
    ``verify`` the skeleton and ``meta.pt`` must match their CRC32 then, and each item as it is read
    (:class:`~lightning_asyncckpt.format.dcp_reader.CheckedReader`). Else
    :class:`~lightning_asyncckpt.format.integrity.CorruptCheckpointError`, naming the file and the item.
    """
    metadata = read_metadata(path, allow_pickle=weights_only is False, hint=PICKLE_HINT)
    integrity.check_directory(path, metadata, crc=verify, item_crc=False)  # paths and sizes, before any read
    return _load(path, metadata, map_location, weights_only, verify)


def _load(path: Path, metadata: Metadata, map_location: MAP_LOCATION, weights_only: bool | None,
          verify: bool) -> dict[str, Any]:
    reader = CheckedReader(path, metadata, verify=verify)
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
        cause = failure(e)
        if isinstance(cause, (integrity.CorruptCheckpointError, pickle.UnpicklingError)):  # names file and item
            raise cause from None
        raise integrity.CorruptCheckpointError(f"{path}: cannot be read ({integrity.first_line(cause)})") from None
    state.update(planner.whole)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if map_location is not None and not callable(map_location) and not isinstance(map_location, dict):
        tensors = {k: v.to(map_location) for k, v in tensors.items()}
    objects = {
        k: _load_file(io.BytesIO(v), weights_only, f"item {k!r} of {path}") for k, v in planner.raw.items()
    }
    skeleton = objects.pop(staging.SKELETON_KEY, None)  # 0.1's layout kept it as an item
    if (path / SKELETON_FILE).is_file():
        skeleton = _load_file(path / SKELETON_FILE, weights_only)
    if skeleton is not None:  # a wrapper subclass's item gives the skeleton its inner tensors
        for fqn, whole in planner.whole.items():
            if subclasses.is_wrapper(whole) and tensors.get(fqn) is whole:
                del tensors[fqn]
                tensors.update({f"{fqn}.{n}": getattr(whole, n) for n in subclasses.inner_names(whole)})
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


def _load_file(source: Path | io.BytesIO, weights_only: bool | None, what: str = "") -> object:
    """``torch.load`` of a file of the checkpoint; an object ``weights_only`` refuses is an ``UnpicklingError``
    naming the file."""
    try:
        return torch.load(source, weights_only=weights_only) if weights_only is not None else torch.load(source)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(f"{what or source}: {e}") from None
    except Exception as e:  # torch's errors do not say which file: the checkpoint cannot be used
        raise integrity.CorruptCheckpointError(f"{what or source}: cannot be read ({integrity.first_line(e)})") from e


def read_into(path: Path, metadata: Metadata, state: dict[str, Any], verify: bool = True) -> None:
    """(all ranks of the default group, together, or the one process without one) DCP's ``load`` of ``state``
    from the directory ``path`` through :class:`~lightning_asyncckpt.format.dcp_reader.CheckedReader`. An item
    that any rank found damaged raises on every rank: its :class:`~lightning_asyncckpt.format.integrity.
    CorruptCheckpointError` naming the file and item (DCP gathers each rank's failure)."""
    try:
        dcp.load(state, storage_reader=CheckedReader(path, metadata, verify=verify))
    except CheckpointException as e:
        cause = failure(e)
        if isinstance(cause, (integrity.CorruptCheckpointError, pickle.UnpicklingError)):
            raise type(cause)(str(cause)) from None  # a fresh one: the rank's traceback is not this rank's
        raise
