"""The on-disk format: torch.distributed.checkpoint (DCP), one shard file per writing rank.

Planning follows DCP's own protocol (planner -> storage writer -> plan -> metadata), without
collectives when one rank writes the whole checkpoint. Reading uses DCP's ``FileSystemReader``, handed
the ``.metadata`` that :func:`lightning_asyncckpt.metadata.read_metadata` unpickled (restricted to DCP's
types unless ``weights_only=False``), and :func:`staging.join` to rebuild the nested dict.
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.utils import _DistWrapper

from lightning_asyncckpt import commit, plan_cache, staging, tree
from lightning_asyncckpt.agreement import Agreement
from lightning_asyncckpt.metadata import read_metadata

META_FILE = "meta.pt"  # Lightning's name for the non-tensor state of a sharded checkpoint
SKELETON_FILE = commit.SKELETON_FILE


def replicated_items(skeleton: Any, tensors: dict[str, torch.Tensor], everything: bool) -> tuple[dict, dict]:
    """The flat DCP items of a replicated save and where each sits in the checkpoint dict (``planner_data``,
    which plain DCP readers such as ``dcp_to_torch_save`` use to rebuild the nesting).

    Tensors keep the names ``staging.split`` gives them. With ``everything`` (the coordinator), the rest of
    the dict is items too, so that the plain DCP view is the checkpoint dict and nothing else; each part
    without tensors (``loops``, ``callbacks``, hyper-parameters, ``param_groups``) is one item, not one per
    leaf, since every item costs a ``torch.save`` frame and a ``.metadata`` entry. The paths cover every
    rank's tensors."""
    items: dict[str, Any] = dict(tensors)
    paths: dict[str, tuple] = {}
    names = tree.FqnNamer()

    def has_tensor(obj: Any) -> bool:
        if isinstance(obj, torch.Tensor):
            return True
        values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
        return any(has_tensor(v) for v in values)

    def visit(obj: Any, path: tuple) -> None:
        if isinstance(obj, torch.Tensor):
            paths[names(path)] = path
        elif isinstance(obj, (dict, list, tuple)) and has_tensor(obj):
            for k, v in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
                visit(v, (*path, k))
        elif everything:
            leaves.append((path, obj))

    leaves: list[tuple[tuple, Any]] = []
    visit(skeleton, ())
    for path, obj in leaves:  # named after every tensor, so that tensor names stay those of staging.split
        name = names(path)
        items[name], paths[name] = obj, path
    return items, paths
_PICKLE_HINT = "load it with weights_only=False if you trust this checkpoint"

# (shard path, shard file name, (bytes items, tensor items)): the engines' unit of work for one file.
WriteBucket = tuple


@dataclass
class WritePlan:
    """What one rank writes for one save, and what the coordinator needs to commit it."""

    writer: Any  # the engine's FileSystemWriterAsync, kept in the trainer for ``finish``
    metadata: Metadata | None
    buckets: list[WriteBucket]
    transforms: list  # DCP storage transforms the engine's ``write_preloaded_data`` expects


def _call_with_known_kwargs(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    params = inspect.signature(fn).parameters
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


def plan_save(
    state: dict[str, Any],
    tmp: Path,
    writer_cls: type,
    thread_count: int,
    split_by_size: Callable[[int, list], list],
    distributed: bool,
    flatten: bool = False,
    planner_data: dict[str, tuple] | None = None,
    cache: plan_cache.PlanCache | None = None,
) -> WritePlan:
    """Plans this rank's part of a save with DCP's planner and the engine's storage writer.

    ``distributed=False``: this rank writes the whole checkpoint; no collectives.
    ``distributed=True``: (all ranks of the default group) each rank passes the items it writes; the
    coordinator (rank 0) merges the plans into one metadata for the whole checkpoint; DCP's planner
    writes each replicated item once.
    ``flatten=True``: plan as ``torch.distributed.checkpoint.save`` does by default (nested keys flattened
    to dotted names, the mapping stored in the metadata), so the result matches a stock DCP save.
    ``cache`` (collective saves): reuses the global plan and metadata of an earlier save whose structure
    was the same on every rank (:mod:`lightning_asyncckpt.plan_cache`), instead of gathering and scattering.
    """
    planner = DefaultSavePlanner(flatten_state_dict=flatten, flatten_sharded_tensors=flatten)
    writer = writer_cls(str(tmp), thread_count=thread_count)
    wrapper = _DistWrapper(None, distributed, 0)
    storage_meta = writer.storage_meta() if hasattr(writer, "storage_meta") else None
    metadata: Metadata | None = None

    def local_step():
        _call_with_known_kwargs(
            planner.set_up_planner, state, storage_meta=storage_meta, is_coordinator=wrapper.is_coordinator
        )
        _call_with_known_kwargs(
            writer.set_up_storage_writer, wrapper.is_coordinator, rank=wrapper.rank, use_collectives=distributed
        )
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_step(all_plans):
        nonlocal metadata
        all_plans, metadata = planner.create_global_plan(all_plans)
        if planner_data is not None:  # where each flat item sits in the nested dict (DCP's own unflattening)
            metadata.planner_data = planner_data
        return writer.prepare_global_plan(all_plans)

    if distributed and cache is not None:  # every rank plans locally; one all-reduce decides on reuse
        local_plan, digest, local_error = None, "", None
        try:
            local_plan = local_step()
            digest = plan_cache.structure_digest(
                local_plan, world_size=wrapper.get_world_size(), rank=wrapper.rank, flatten=flatten,
                writer=f"{writer_cls.__module__}.{writer_cls.__qualname__}", metadata_extra=planner_data,
            )
        except Exception as e:  # noqa: BLE001 - no digest matches: every rank plans in full, and DCP's
            local_error = e  # collective planning below raises it on every rank (none is left waiting)
        decision = cache.agree(digest, Agreement().all_max)
        if decision.hit is not None:
            central_plan, metadata = planner.finish_plan(decision.hit.central_plan), decision.hit.metadata_for_save()
        else:
            def replay_local_step():
                if local_error is not None:
                    raise local_error
                return local_plan

            central_plan = planner.finish_plan(wrapper.reduce_scatter("plan", replay_local_step, global_step))
            cache.store(digest, decision.round_id, central_plan, metadata)
    else:
        central_plan = planner.finish_plan(wrapper.reduce_scatter("plan", local_step, global_step))
    buckets = make_buckets(central_plan, planner, tmp, thread_count, split_by_size)
    transforms = [writer.transforms] if hasattr(writer, "transforms") else []
    return WritePlan(writer=writer, metadata=metadata, buckets=buckets, transforms=transforms)


def plan_local_save(snapshot: staging.Snapshot, tmp: Path, writer_cls: type, thread_count: int,
                    split_by_size: Callable[[int, list], list]) -> WritePlan:
    """Plans a save that this rank writes alone (no collectives)."""
    state: dict[str, Any] = dict(snapshot.tensors)
    state[staging.SKELETON_KEY] = snapshot.skeleton
    return plan_save(state, tmp, writer_cls, thread_count, split_by_size, distributed=False)


def make_buckets(plan, planner, tmp: Path, bins: int, split_by_size: Callable) -> list[WriteBucket]:
    """Splits a plan into at most ``bins`` shard files of similar size; resolves the data now.

    Byte items (the pickled skeleton) are serialized here, in the trainer, so they are a snapshot too.
    """
    prefix = plan.storage_data.prefix
    buckets: list[WriteBucket] = []
    for items in split_by_size(max(1, bins), plan.items):
        if not items:
            continue
        bytes_data = [(it, planner.resolve_data(it)) for it in items if it.type == WriteItemType.BYTE_IO]
        tensor_data = [
            (it, planner.resolve_data(it).detach()) for it in items if it.type != WriteItemType.BYTE_IO
        ]
        name = f"{prefix}{len(buckets)}{DEFAULT_SUFFIX}"
        buckets.append((str(tmp / name), name, (bytes_data, tensor_data)))
    return buckets


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


def load(path: Path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
    """Reads a checkpoint directory back into the dict that was saved (local, no collectives).

    Unless ``weights_only`` is ``False``, ``.metadata`` may name only DCP's metadata types (else
    :class:`~lightning_asyncckpt.metadata.MetadataError`, an ``UnpicklingError`` naming the file), as the
    objects are read with ``torch.load(weights_only=...)``.
    """
    metadata = read_metadata(path, allow_pickle=weights_only is False, hint=_PICKLE_HINT)
    reader = _Reader(path, metadata)
    state: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            state[fqn] = None
    planner = _RawBytesLoadPlanner()
    dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if map_location is not None and not callable(map_location) and not isinstance(map_location, dict):
        tensors = {k: v.to(map_location) for k, v in tensors.items()}
    objects = {
        k: torch.load(io.BytesIO(v), weights_only=weights_only) if weights_only is not None
        else torch.load(io.BytesIO(v))
        for k, v in planner.raw.items()
    }
    skeleton = objects.pop(staging.SKELETON_KEY, None)  # 0.1's layout kept it as an item
    if (path / SKELETON_FILE).is_file():
        skeleton = torch.load(path / SKELETON_FILE, weights_only=weights_only) if weights_only is not None \
            else torch.load(path / SKELETON_FILE)
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
        extra = torch.load(meta, weights_only=weights_only) if weights_only is not None else torch.load(meta)
        flat.update(extra)
    return flat
