"""Tensors between ranks: point to point (the tier's recovery and repairs) and one member to all
(NVRx's clique replication).

Each wait is bounded by the group's timeout (the tier's gloo groups: ``LocalTier.timeout_s``), so a rank
that is gone fails the wait instead of hanging it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_asyncckpt.collectives.groups import ProcessGroup

Work = dist.Work
"""A message under way; ``wait()`` ends it (bounded by its group's timeout)."""


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup | None, tag: int = 0) -> Work:
    """(the sender; ``dst``, global rank, posts the matching :func:`irecv`) Starts sending ``tensor``."""
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int, group: ProcessGroup | None, tag: int = 0) -> Work:
    """(the receiver; ``src``, global rank, posts the matching :func:`isend`) Starts receiving into ``tensor``."""
    return dist.irecv(tensor, src=src, group=group, tag=tag)


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None) -> None:
    """(the sender, while ``dst`` runs the matching :func:`recv`) Sends ``tensor`` and waits."""
    dist.send(tensor, dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None) -> None:
    """(the receiver, while ``src`` runs the matching :func:`send`) Receives into ``tensor`` and waits."""
    dist.recv(tensor, src=src, group=group)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None) -> None:
    """(all ranks of ``group``, same order) ``src``'s (global rank) ``tensor`` into every member's ``tensor``."""
    dist.broadcast(tensor, src=src, group=group)
