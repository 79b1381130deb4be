"""Recovery transfers between ranks: point-to-point sends over gloo of a share's header and tensors, from a
list of moves every rank computes alike (:mod:`lightning_asyncckpt.tiers.recovery`), all under way at once
(through :mod:`lightning_asyncckpt.collectives`).
NVRx's own retrieval sends every tensor through CUDA, and only within a clique; this is ours.

A transfer has two halves so that a rank that cannot take part never leaves a peer waiting in a send or a
receive: :func:`prepare` does everything that can fail on one rank (mapping the copies it sends, reserving
the files or memory it receives into), the ranks agree on the outcome, and only then :func:`post` starts
moving the bytes (:func:`transfer`: and waits for them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lightning_asyncckpt import collectives
from lightning_asyncckpt.collectives import ProcessGroup
from lightning_asyncckpt.tiers.store import Held

Move = tuple[int, int, int, Held]  # (owner, sender, receiver, manifest)


@dataclass
class Prepared:
    """This rank's side of each move it takes part in, by the move's index in the list."""

    sends: dict[int, tuple[bytes, torch.Tensor]] = field(default_factory=dict)  # header, tensors' bytes
    receives: dict[int, torch.Tensor] = field(default_factory=dict)  # where the tensors' bytes go


def prepare(moves: Sequence[Move], read: Callable[[Held], tuple[bytes, torch.Tensor]],
            into: Callable[[Held], torch.Tensor] | None, me: int) -> Prepared:
    """(every rank, on its own) This rank's side of ``moves``: ``read(manifest)`` for each copy it sends,
    ``into(manifest)`` for each it receives (``into`` None: the sends only; the caller fills ``receives``
    before :func:`post`). Raises what they raise (``OSError`` for a missing file or a full directory),
    before any byte has moved."""
    out = Prepared()
    for i, (_owner, sender, receiver, manifest) in enumerate(moves):
        if sender == me:
            out.sends[i] = read(manifest)
        elif receiver == me and into is not None:
            out.receives[i] = into(manifest)
    return out


def keep(moves: Sequence[Move], prepared: Prepared, receivers_out: set[int]) -> tuple[list[Move], Prepared]:
    """``moves`` and ``prepared`` without the moves into ``receivers_out``, indexed anew (the same list on
    every rank that passes the same ``receivers_out``)."""
    kept = [i for i, m in enumerate(moves) if m[2] not in receivers_out]
    return [moves[i] for i in kept], Prepared(
        {j: prepared.sends[i] for j, i in enumerate(kept) if i in prepared.sends},
        {j: prepared.receives[i] for j, i in enumerate(kept) if i in prepared.receives})


@dataclass
class Posted:
    """The sends and receives of one :func:`post`, under way; :meth:`wait` ends them."""

    works: list[collectives.Work] = field(default_factory=list)
    got: list[tuple[Held, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    sent: list = field(default_factory=list)  # the headers' tensors, alive until their sends are done

    def wait(self) -> list[tuple[Held, bytes, torch.Tensor]]:
        """(the rank that posted) Waits for every message (each wait bounded by the group's timeout);
        returns what this rank received: ``(manifest, header, bytes)``, in the moves' order."""
        for work in self.works:
            work.wait()
        self.works, self.sent = [], []
        return [(manifest, bytes(head.numpy()), flat) for manifest, head, flat in self.got]


def post(moves: Sequence[Move], prepared: Prepared, me: int, group: ProcessGroup | None) -> Posted:
    """(every rank of ``group``, together, once every rank has prepared) Starts ``moves`` (the same list on
    every rank) and returns at once: the rank may work on other things (checksums) while the bytes move,
    then must :meth:`Posted.wait`.

    Every rank posts all its sends and receives at once, each message tagged with its move: the moves run
    side by side (a node back empty receives its ranks' shares from several senders at once, not one after
    the other), and a message can only match its own move. No rank waits on a peer that is not coming: every
    rank has prepared and agreed before any is posted, and the group's timeout bounds each wait."""
    out = Posted()
    for i, (_owner, sender, receiver, manifest) in enumerate(moves):
        if sender == me:
            head, flat = prepared.sends[i]
            out.sent.append(torch.frombuffer(bytearray(head), dtype=torch.uint8) if head else None)
            for tag, part in _parts(i, out.sent[-1], flat):
                out.works.append(collectives.isend(part, receiver, group, tag=tag))
        elif receiver == me:
            head = torch.empty(manifest.head_nbytes, dtype=torch.uint8)
            flat = prepared.receives[i]
            for tag, part in _parts(i, head, flat):
                out.works.append(collectives.irecv(part, sender, group, tag=tag))
            out.got.append((manifest, head, flat))
    return out


def transfer(moves: Sequence[Move], prepared: Prepared, me: int,
             group: ProcessGroup | None) -> list[tuple[Held, bytes, torch.Tensor]]:
    """:func:`post`, then :meth:`Posted.wait`: runs ``moves`` and returns what this rank received."""
    return post(moves, prepared, me, group).wait()


def _parts(move: int, head: torch.Tensor | None, flat: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """The messages of one move, with their tags (two per move): the header and the bytes, where not empty."""
    return [(2 * move + k, t) for k, t in enumerate((head, flat)) if t is not None and t.numel()]
