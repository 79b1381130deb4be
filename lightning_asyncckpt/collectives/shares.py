"""A file's bytes read once across the ranks: each rank reads a contiguous share, and the ranks exchange the
shares in fixed-size chunks (``all_gather``), so that every rank ends with every byte while the shared storage
served each byte once (:mod:`~lightning_asyncckpt.storage.read_once` reads the shares).

The layout is fixed by the file's size and the world size alone, so every rank computes the same one:
rank ``r`` owns bytes ``[r * share, (r + 1) * share)`` of a buffer of ``world * share`` bytes (``share`` =
the size divided by the world, rounded up: the buffer's tail past the file, under ``world`` bytes, stays
zero). Round ``k`` gathers the ``k``-th chunk of every rank's share, straight into the final buffer: each
rank holds the file's bytes and, per round, the backend's flat buffer of ``world`` chunks (gloo's; on NCCL
also a staging copy on the device), at most :func:`chunk_for`'s ``world * chunk`` bytes.

Each wait is bounded by the group's timeout: a rank that is gone fails the round on the others (gloo sees the
connection close; otherwise the timeout), instead of hanging them.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist

from lightning_asyncckpt.collectives.groups import ProcessGroup, control_device
from lightning_asyncckpt.collectives.objects import all_gather_object

ROUND_BUDGET = 64 << 20  # bytes of one round's gathered chunks, all ranks' together
MAX_CHUNK = 4 << 20  # bytes per rank per round, at most
MIN_CHUNK = 64 << 10  # ... and at least (large worlds exceed the budget rather than send tiny messages)


def share_of(size: int, world: int) -> int:
    """(any rank, local) The bytes each rank owns of a file of ``size`` bytes: the size over the world,
    rounded up."""
    return -(-size // world)


def chunk_for(world: int) -> int:
    """(any rank, local) The chunk each rank contributes per round: :data:`MAX_CHUNK`, smaller in large worlds
    so that a round's ``world`` chunks stay within :data:`ROUND_BUDGET` (never under :data:`MIN_CHUNK`)."""
    return max(MIN_CHUNK, min(MAX_CHUNK, ROUND_BUDGET // world))


def all_same(identity: Hashable, group: ProcessGroup | None = None) -> list[Hashable]:
    """(all ranks of ``group``, same order) Every rank's ``identity`` (a small picklable value: what a rank
    means to read, e.g. the path and size of the file), in group-rank order: the caller goes on with the
    exchange only where all are equal, which every rank sees alike. ``torch.distributed``'s gather of objects
    (on the device the backend wants: the training's group may be NCCL's)."""
    return all_gather_object(identity, group)


def any_failed(failed: bool, group: ProcessGroup | None = None) -> bool:
    """(all ranks of ``group``, same order) Whether any rank's ``failed`` is True (one all-reduce of one
    byte): a rank whose read of its share failed tells the others before the exchange, so that all of them
    leave it alike instead of waiting for its chunks."""
    flag = torch.tensor([int(failed)], dtype=torch.int64, device=control_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def exchange(buffer: bytearray, size: int, group: ProcessGroup | None = None) -> int:
    """(all ranks of ``group``, same order, each having filled its own share of ``buffer``) Every rank's share
    gathered into every rank's ``buffer`` in place, in rounds of one chunk per rank.

    Args:
        buffer: ``world * share_of(size, world)`` bytes; this rank's share already read into it.
        size: the file's size, the same on every rank.
        group: the group that shares the read (the default group when None).

    Returns:
        the rounds run (the same on every rank)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    share, chunk = share_of(size, world), chunk_for(world)
    if len(buffer) != world * share:
        raise ValueError(f"exchange: the buffer has {len(buffer)} bytes, not {world} x {share}")
    device = control_device(group)
    whole = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
    rounds = 0
    for start in range(0, share, chunk):
        n = min(chunk, share - start)
        views = [whole[r * share + start:r * share + start + n] for r in range(world)]
        if device.type == "cpu":
            dist.all_gather(views, views[me].clone(), group=group)  # gloo: into the views, in place
        else:  # NCCL: staged on the device, one round at a time
            staged = [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(world)]
            dist.all_gather(staged, views[me].to(device), group=group)
            for view, got in zip(views, staged):
                view.copy_(got)
        rounds += 1
    return rounds


def describe(identities: list[Hashable]) -> str:
    """(any rank, local) The ranks' identities in a log line, shortened."""
    text = ", ".join(f"rank {r}: {i!r}" for r, i in enumerate(identities))
    return text if len(text) < 400 else text[:400] + "..."


__all__ = ["MAX_CHUNK", "MIN_CHUNK", "ROUND_BUDGET", "all_same", "any_failed", "chunk_for", "describe", "exchange",
           "share_of"]
