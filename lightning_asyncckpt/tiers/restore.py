"""Restoring the local tier's newest complete step on every rank (:func:`restore`).

Three moves, each rank in the same order:

1. **Refill.** Every rank holds again what it holds after a save (its share and its clique's replicas):
   a node back with an empty directory gets them sent, each share once, into its mapped files. This is
   also what protects the next failure.
2. **Check.** Every rank checks the CRC32 of every share in its own holder directory (and of what it was
   sent); the ranks agree on the outcome (one gather), so that either all restore or all fall back.
3. **Read.** Each rank reads the shares it needs (sharded: its own; replicated: every owner's) from the
   holder directories of its own node, checked in 2; a share its node does not hold is sent from
   another node and checked on arrival.

Every checkpoint returned is in memory of its own (read, not mapped): a later save reuses the files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_asyncckpt.tiers import exchange, packing, recovery, shares
from lightning_asyncckpt.tiers.store import Held, LocalStore


@dataclass
class Ranks:
    """What a restore needs to know of the run (the same on every rank but ``rank`` and ``store``)."""

    rank: int
    world: int
    root: Path
    store: LocalStore  # this rank's own holder directory
    group: dist.ProcessGroup | None
    node_of: list[int]
    cliques: list[list[int]]
    factor: int
    topology: tuple
    gather: Callable[[Any], list[Any]]


@dataclass
class Restored:
    """The checkpoint (None where a check failed, then ``problems`` says why) and what moved."""

    checkpoint: Any | None
    problems: list[str]
    sent: int  # shares sent between ranks
    read: int  # shares read from a holder directory on the reader's node


def restore(plan: recovery.Plan, holdings: list[list[Held]], ranks: Ranks) -> Restored:
    """(every rank, together) Restores ``plan.step``; see the module docstring."""
    me, step = ranks.rank, plan.step
    mode = plan.sources[0][1].mode
    needs = {r: ([r] if mode == shares.SHARDED else list(range(ranks.world))) for r in range(ranks.world)}
    refill = recovery.refill(plan, holdings, ranks.cliques, ranks.factor, ranks.node_of)
    fetch = recovery.fetch(plan, recovery.after(holdings, refill), ranks.node_of, needs)
    mine = set(needs[me])
    got: dict[int, tuple[bytes, torch.Tensor]] = {}
    bad: list[str] = []

    # 1. refill: received into reserved files, checked, then committed under their names
    reserved = {}

    def into(m: Held) -> torch.Tensor:
        reserved[m.owner] = ranks.store.reserve(step, m.owner, m.nbytes)
        return reserved[m.owner].tensor

    senders = {(o, r): s for o, s, r, _ in refill}
    refilled = set()
    for m, head, flat in exchange.transfer(refill, ranks.store.map, into, me, ranks.group):
        problem = _check(m, head, flat, f"sent by rank {senders[(m.owner, me)]}")
        if problem:
            bad.append(problem)
            continue
        ranks.store.commit(m, reserved[m.owner], head)
        refilled.add(m.owner)
        if m.owner in mine:
            got[m.owner] = (head, flat.clone())  # the file is reused by a later save

    # 2. check this rank's own holder directory (what it did not just receive and check)
    for h in ranks.store.holdings(ranks.topology):
        if h.step != step or h.owner in refilled:
            continue
        head, flat = ranks.store.read(h) if h.owner in mine else ranks.store.map(h)
        problem = _check(h, head, flat, f"held by rank {me}")
        if problem:
            bad.append(problem)
        elif h.owner in mine:
            got[h.owner] = (head, flat)

    # 3a. what this rank's node does not hold: sent from another node, checked on arrival
    def fresh(m: Held) -> torch.Tensor:
        return torch.empty(m.nbytes, dtype=torch.uint8)

    movers = {(o, r): s for o, s, r, _ in fetch.moves}
    for m, head, flat in exchange.transfer(fetch.moves, ranks.store.map, fresh, me, ranks.group):
        problem = _check(m, head, flat, f"sent by rank {movers[(m.owner, me)]}")
        if problem:
            bad.append(problem)
        else:
            got[m.owner] = (head, flat)
    problems = sorted({p for ps in ranks.gather(bad) for p in ps})
    sent, read = len(refill) + len(fetch.moves), sum(len(v) for v in fetch.reads.values())
    if problems:
        return Restored(None, problems, sent, read)

    # 3b. the rest from the other holder directories of this node, checked by their holders in 2
    for owner, holder, manifest in fetch.reads.get(me, []):
        if owner not in got:
            got[owner] = LocalStore(ranks.root, holder).read(manifest)
    own = packing.unpack(*got[me])
    if mode == shares.SHARDED:
        return Restored(own["state"], [], sent, read)
    every = [own, *(packing.unpack(*got[o]) for o in sorted(got) if o != me)]
    return Restored(shares.assemble(own, every), [], sent, read)


def _check(m: Held, head: bytes, flat: torch.Tensor, where: str) -> str | None:
    actual, head_actual = packing.crc32(flat), packing.crc32(head)
    if actual == m.crc32 and head_actual == m.head_crc32:
        return None
    return (f"rank {m.owner}'s share in the copy {where} has CRC32 {actual:08x}/{head_actual:08x},"
            f" its manifest {m.crc32:08x}/{m.head_crc32:08x}")
