"""Planning a DCP save: DCP's own protocol (planner -> storage writer -> plan -> metadata), without
collectives when one rank writes the whole checkpoint, and with the plan reused while every rank's
structure holds (``plan_cache``).

Runs on the training thread of each saving rank, at save time (collectively when all ranks write).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter

from lightning_asyncckpt.collectives import Agreement
from lightning_asyncckpt.collectives.planning import PlanRound
from lightning_asyncckpt.pipeline import plan_cache
from lightning_asyncckpt.snapshot import staging, subclasses, tree


def replicated_items(skeleton: object, tensors: dict[str, torch.Tensor], everything: bool) -> tuple[dict, dict]:
    """The flat DCP items of a replicated save and where each sits in the checkpoint dict (``planner_data``,
    which plain DCP readers such as ``dcp_to_torch_save`` use to rebuild the nesting).

    Tensors keep the names ``staging.split`` gives them. With ``everything`` (the coordinator), the rest of
    the dict is items too, so that the plain DCP view is the checkpoint dict and nothing else; each part
    without tensors (``loops``, ``callbacks``, hyper-parameters, ``param_groups``) is one item, not one per
    leaf, since every item costs a ``torch.save`` frame and a ``.metadata`` entry. The paths cover every
    rank's tensors. A wrapper subclass (torchao's optimizer states) is one item, as in stock's DCP save: the
    wrapper rebuilt around its staged inner tensors; the reader splits it for the skeleton beside them."""
    items: dict[str, object] = dict(tensors)
    paths: dict[str, tuple] = {}
    names = tree.FqnNamer()

    def has_tensor(obj: object) -> bool:
        if isinstance(obj, torch.Tensor):  # a sparse or nested one stays in the skeleton: a leaf
            return tree.stageable(obj) or subclasses.is_wrapper(obj)
        values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
        return any(has_tensor(v) for v in values)

    def visit(obj: object, path: tuple) -> None:
        if subclasses.is_wrapper(obj):  # one item, as stock's DCP save writes it, around the staged inner tensors
            whole, inner = names(path), {n: names((*path, n)) for n in subclasses.inner_names(obj)}
            if all(name in tensors for name in inner.values()):  # this rank's (tree.share keeps them together)
                items[whole] = subclasses.rebuild(obj, {n: items.pop(name) for n, name in inner.items()})
            paths[whole] = path
        elif isinstance(obj, torch.Tensor) and tree.stageable(obj):
            paths[names(path)] = path
        elif isinstance(obj, (dict, list, tuple)) and has_tensor(obj):
            for k, v in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
                visit(v, (*path, k))
        elif everything:
            leaves.append((path, obj))

    leaves: list[tuple[tuple, object]] = []
    visit(skeleton, ())
    for path, obj in leaves:  # named after every tensor, so that tensor names stay those of staging.split
        name = names(path)
        items[name], paths[name] = obj, path
    return items, paths


# (shard path, shard file name, (bytes items, tensor items)): the engines' unit of work for one file.
WriteBucket = tuple


@dataclass
class WritePlan:
    """What one rank writes for one save, and what the coordinator needs to commit it."""

    writer: StorageWriter  # the engine's FileSystemWriterAsync, kept in the trainer for ``finish``
    metadata: Metadata | None
    buckets: list[WriteBucket]
    transforms: list  # DCP storage transforms the engine's ``write_preloaded_data`` expects


T = TypeVar("T")


def _call_with_known_kwargs(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    params = inspect.signature(fn).parameters
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


def plan_save(
    state: dict[str, object],
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
    was the same on every rank (:mod:`lightning_asyncckpt.pipeline.plan_cache`), instead of gathering and scattering.
    """
    planner = DefaultSavePlanner(flatten_state_dict=flatten, flatten_sharded_tensors=flatten)
    writer = writer_cls(str(tmp), thread_count=thread_count)
    wrapper = PlanRound(distributed)  # its collectives: the owner's (lightning_asyncckpt.collectives)
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
            metadata = replace(metadata, planner_data=planner_data)  # a new value, as DCP's planner makes
        return writer.prepare_global_plan(all_plans)

    if distributed and cache is not None:  # every rank plans locally; one all-reduce decides on reuse
        local_plan, digest, local_error = None, "", None
        try:
            local_plan = local_step()
            digest = plan_cache.structure_digest(
                local_plan, world_size=wrapper.world_size, rank=wrapper.rank, flatten=flatten,
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

            central_plan = planner.finish_plan(wrapper.reduce_scatter(replay_local_step, global_step))
            cache.store(digest, decision.round_id, central_plan, metadata)
    else:
        central_plan = planner.finish_plan(wrapper.reduce_scatter(local_step, global_step))
    buckets = make_buckets(central_plan, planner, tmp, thread_count, split_by_size)
    transforms = [writer.transforms] if hasattr(writer, "transforms") else []
    return WritePlan(writer=writer, metadata=metadata, buckets=buckets, transforms=transforms)


def plan_local_save(snapshot: staging.Snapshot, tmp: Path, writer_cls: type, thread_count: int,
                    split_by_size: Callable[[int, list], list]) -> WritePlan:
    """Plans a save that this rank writes alone (no collectives)."""
    state: dict[str, object] = dict(snapshot.tensors)
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


@dataclass
class DcpPlan:
    """This rank's part of a DCP save, planned (collectively when all ranks write): what the worker gets."""

    plan: WritePlan
    extra: list[tuple[str, bytes]]  # small files beside the shards (skeleton, provenance, extra_files)
