"""Recovery transfers between nodes: point-to-point sends over gloo of the shares that a rank's own node
does not hold, in an order every rank computes alike (:func:`lightning_asyncckpt.tiers.recovery.fetch`).
NVRx's own retrieval sends every tensor through CUDA, and only within a clique; this is ours.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from lightning_asyncckpt.tiers.store import Held


def transfer(moves: Sequence[tuple[int, int, int, Held]], read: Callable[[Held], torch.Tensor], me: int,
             group: dist.ProcessGroup | None) -> dict[int, torch.Tensor]:
    """(every rank of ``group``, together) Runs ``moves`` (``(owner, sender, receiver, manifest)``, the same
    list on every rank, in order): the sender sends its copy (``read(manifest)``) to the receiver. Returns
    the shares this rank received, by owner. Each move involves two ranks and every rank runs them in the
    same order, so the first unfinished move always has both its ranks at it: nothing waits on a peer
    that is not coming (and the group's timeout bounds each call)."""
    got: dict[int, torch.Tensor] = {}
    for owner, sender, receiver, manifest in moves:
        if sender == me:
            dist.send(read(manifest), dst=receiver, group=group)
        elif receiver == me:
            buf = torch.empty(manifest.nbytes, dtype=torch.uint8)
            dist.recv(buf, src=sender, group=group)
            got[owner] = buf
    return got
