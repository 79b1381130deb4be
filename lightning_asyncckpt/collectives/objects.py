"""Gathering small Python objects from every rank of a group.

:func:`gather_objects` (the local tier's) runs one collective for small objects: ``torch.distributed``'s
``all_gather_object`` always runs two, the sizes of the pickled objects, then the objects padded to the
largest. The tier's gathers carry a few hundred bytes (which copies a rank holds, its CRC32s, its problems),
so here the first collective carries each object itself in a fixed-size slot beside its size, and only an
object too large for its slot costs the second collective. On this project's 2 cores, 4 gloo ranks took
4.4 ms per gather of a small object this way against 8.6 ms with ``all_gather_object`` (medians of 200:
``benchmarks/probe_gather.py``, and ``benchmarks/results/findings-probe-gather.md``).

:func:`all_gather_object` is ``torch.distributed``'s, for the persistent pipeline's gathers and NVRx's
replication, which run it as they always have.

Each wait is bounded by the group's timeout (the tier's gloo groups: ``LocalTier.timeout_s``).
"""

from __future__ import annotations

import pickle
from typing import TypeVar

import torch
import torch.distributed as dist

from lightning_asyncckpt.collectives.groups import ProcessGroup

T = TypeVar("T")  # a picklable value each rank contributes

SLOT = 4096  # bytes per rank in the first collective: 8 for the size, the rest for a small object
_SIZE = 8
_FIRST_MAX = 4 << 20  # bytes every rank receives in the first collective, at most (large worlds: smaller slots)


def slot_for(world: int) -> int:
    """The slot size for a group of ``world`` ranks: :data:`SLOT`, smaller from 1024 ranks on (at least 512
    bytes, where a restore's row still fits), so that up to 8192 ranks the first collective stays within 4 MiB
    per rank."""
    return min(SLOT, max(512, _FIRST_MAX // world))


def gather_objects(obj: T, group: ProcessGroup | None = None) -> list[T]:
    """(all ranks of ``group``, same order) Every rank's ``obj``, in group-rank order. Each rank decides
    whether a second collective is needed from the sizes every rank gathered in the first, so all ranks
    run the same collectives whatever their objects' sizes."""
    world = dist.get_world_size(group)
    size = slot_for(world)  # the same on every rank: it depends on the world size only
    data = pickle.dumps(obj)
    slot = bytearray(size)
    slot[:_SIZE] = len(data).to_bytes(_SIZE, "little")
    if len(data) <= size - _SIZE:
        slot[_SIZE:_SIZE + len(data)] = data
    slots = [torch.empty(size, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(slots, torch.frombuffer(slot, dtype=torch.uint8), group=group)
    raw = [s.numpy().tobytes() for s in slots]
    sizes = [int.from_bytes(r[:_SIZE], "little") for r in raw]
    if max(sizes) <= size - _SIZE:
        return [pickle.loads(r[_SIZE:_SIZE + n]) for r, n in zip(raw, sizes)]
    # one object did not fit: all of them again, padded to the largest (as all_gather_object does)
    padded = bytearray(max(sizes))
    padded[:len(data)] = data
    whole = [torch.empty(len(padded), dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(whole, torch.frombuffer(padded, dtype=torch.uint8), group=group)
    return [pickle.loads(w.numpy().tobytes()[:n]) for w, n in zip(whole, sizes)]


def all_gather_object(obj: T, group: ProcessGroup | None = None) -> list[T]:
    """(all ranks of ``group``, same order) Every rank's ``obj``, in group-rank order, as
    ``torch.distributed.all_gather_object`` gathers it (two collectives, on the device of ``group``'s
    backend)."""
    out: list[T] = [None] * dist.get_world_size(group)  # type: ignore[list-item]  # filled in by the gather
    dist.all_gather_object(out, obj, group=group)
    return out
