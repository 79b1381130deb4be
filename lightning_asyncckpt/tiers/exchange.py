"""Recovery transfers between ranks: point-to-point sends over gloo of a share's header and tensors, in an
order every rank computes alike (:mod:`lightning_asyncckpt.tiers.recovery`). NVRx's own retrieval sends
every tensor through CUDA, and only within a clique; this is ours.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from lightning_asyncckpt.tiers.store import Held

Move = tuple[int, int, int, Held]  # (owner, sender, receiver, manifest)


def transfer(moves: Sequence[Move], read: Callable[[Held], tuple[bytes, torch.Tensor]],
             into: Callable[[Held], torch.Tensor], me: int,
             group: dist.ProcessGroup | None) -> list[tuple[Held, bytes, torch.Tensor]]:
    """(every rank of ``group``, together) Runs ``moves`` (the same list on every rank, in order): the
    sender sends its copy (``read(manifest)``: header and tensors' bytes), the receiver receives the tensors'
    bytes into ``into(manifest)``. Returns what this rank received: ``(manifest, header, bytes)``. Each move
    involves two ranks and every rank runs them in the same order, so the first unfinished move always has
    both its ranks at it: nothing waits on a peer that is not coming (and the group's timeout bounds each
    call)."""
    got = []
    for _owner, sender, receiver, manifest in moves:
        if sender == me:
            head, flat = read(manifest)
            if head:
                dist.send(torch.frombuffer(bytearray(head), dtype=torch.uint8), dst=receiver, group=group)
            if flat.numel():
                dist.send(flat, dst=receiver, group=group)
        elif receiver == me:
            head = torch.empty(manifest.head_nbytes, dtype=torch.uint8)
            flat = into(manifest)
            if head.numel():
                dist.recv(head, src=sender, group=group)
            if flat.numel():
                dist.recv(flat, src=sender, group=group)
            got.append((manifest, bytes(head.numpy()), flat))
    return got
