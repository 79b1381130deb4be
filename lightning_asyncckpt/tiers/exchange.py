"""Recovery transfers between ranks: point-to-point sends over gloo of a share's header and tensors, in an
order every rank computes alike (:mod:`lightning_asyncckpt.tiers.recovery`). NVRx's own retrieval sends
every tensor through CUDA, and only within a clique; this is ours.

A transfer has two halves so that a rank that cannot take part never leaves a peer waiting in a send or a
receive: :func:`prepare` does everything that can fail on one rank (mapping the copies it sends, reserving
the files or memory it receives into), the ranks agree on the outcome, and only then :func:`transfer` moves
the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_asyncckpt.tiers.store import Held

Move = tuple[int, int, int, Held]  # (owner, sender, receiver, manifest)


@dataclass
class Prepared:
    """This rank's side of each move it takes part in, by the move's index in the list."""

    sends: dict[int, tuple[bytes, torch.Tensor]] = field(default_factory=dict)  # header, tensors' bytes
    receives: dict[int, torch.Tensor] = field(default_factory=dict)  # where the tensors' bytes go


def prepare(moves: Sequence[Move], read: Callable[[Held], tuple[bytes, torch.Tensor]],
            into: Callable[[Held], torch.Tensor], me: int) -> Prepared:
    """(every rank, on its own) This rank's side of ``moves``: ``read(manifest)`` for each copy it sends,
    ``into(manifest)`` for each it receives. Raises what they raise (``OSError`` for a missing file or a
    full directory), before any byte has moved."""
    out = Prepared()
    for i, (_owner, sender, receiver, manifest) in enumerate(moves):
        if sender == me:
            out.sends[i] = read(manifest)
        elif receiver == me:
            out.receives[i] = into(manifest)
    return out


def transfer(moves: Sequence[Move], prepared: Prepared, me: int,
             group: dist.ProcessGroup | None) -> list[tuple[Held, bytes, torch.Tensor]]:
    """(every rank of ``group``, together, once every rank has prepared) Runs ``moves`` (the same list on
    every rank, in order). Returns what this rank received: ``(manifest, header, bytes)``. Each move involves
    two ranks and every rank runs them in the same order, so the first unfinished move always has both its
    ranks at it: nothing waits on a peer that is not coming (and the group's timeout bounds each call)."""
    got = []
    for i, (_owner, sender, receiver, manifest) in enumerate(moves):
        if sender == me:
            head, flat = prepared.sends[i]
            if head:
                dist.send(torch.frombuffer(bytearray(head), dtype=torch.uint8), dst=receiver, group=group)
            if flat.numel():
                dist.send(flat, dst=receiver, group=group)
        elif receiver == me:
            head = torch.empty(manifest.head_nbytes, dtype=torch.uint8)
            flat = prepared.receives[i]
            if head.numel():
                dist.recv(head, src=sender, group=group)
            if flat.numel():
                dist.recv(flat, src=sender, group=group)
            got.append((manifest, bytes(head.numpy()), flat))
    return got
