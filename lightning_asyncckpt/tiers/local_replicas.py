"""Replicas of a replicated (DDP) state, made without sending the state.

Under DDP every rank holds the same tensors, so a clique member can copy its peers' shares from its own
memory at the save call, as it copies its own, and nothing large crosses the network. What proves that a
replica made this way holds the owner's bytes is a checksum: each member CRCs every share it copied, the
clique gathers those (and each owner's small header), and a replica whose CRC differs from its owner's
(a tensor that is not replicated bit for bit, e.g. BatchNorm statistics without SyncBatchNorm) is sent by
its owner, point to point, into the holder's file. Either way every replica ends as its owner's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_asyncckpt import collectives
from lightning_asyncckpt.collectives import ProcessGroup
from lightning_asyncckpt.tiers.packing import crc32


@dataclass(frozen=True)
class Settled:
    """What a holder writes for one owner's share: the owner's header and the CRC32s."""

    head: bytes
    head_crc32: int
    crc32: int


def settle(me: int, own_head: bytes, flats: dict, group: ProcessGroup | None,
           ok: bool = True) -> tuple[dict[int, Settled], int, list[int]]:
    """(every member of the clique ``group``, together, in the writer thread) ``flats`` maps each clique
    owner to the ``uint8`` tensor this rank copied that owner's share into. Returns, by owner, what to
    write, how many replicas were repaired (sent by their owner) in the whole clique, and the members
    whose copy failed (``ok`` False: a lazy copy torn by a change in place). If any did, nothing is
    repaired and nothing is to be written, on every member: a repair would spread its torn bytes."""
    mine = {owner: crc32(t) for owner, t in flats.items()}
    row = (me, own_head, crc32(own_head), mine, ok)
    if group is None:
        rows = [row]
    else:
        rows = collectives.gather_objects(row, group)
    failed = sorted(r[0] for r in rows if not r[4])
    if failed:
        return {}, 0, failed
    by_rank = {r[0]: r for r in rows}
    # every member computes the same list from the same rows: the replicas whose bytes differ from the owner's
    repairs = sorted((owner, holder) for holder, r in by_rank.items() for owner, c in r[3].items()
                     if owner != holder and c != by_rank[owner][3][owner])
    for owner, holder in repairs:
        if me == owner:
            collectives.send(flats[owner], holder, group)
        elif me == holder:
            collectives.recv(flats[owner], owner, group)
            if crc32(flats[owner]) != by_rank[owner][3][owner]:
                raise RuntimeError(f"rank {owner}'s share arrived with another CRC32 than it sent")
    out = {}
    for owner in flats:
        _, head, head_crc, crcs, _ok = by_rank[owner]
        out[owner] = Settled(head, head_crc, crcs[owner])
    return out, len(repairs), []
