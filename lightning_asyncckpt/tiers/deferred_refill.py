"""The replicas a sharded restore leaves for later, sent in the writer's thread from the first step boundary.

A node back with an empty directory needs, to resume a sharded (FSDP2) state, only its own ranks' shares.
The replicas it also held for its clique peers on other nodes protect against the *next* failure, not
this one, so :func:`~lightning_asyncckpt.tiers.restore.restore` prepares only their sends with the others
(the copies mapped, every rank agreed) and runs nothing: that halves what a node back empty receives, and
what it allocates, before it can resume. From the first step boundary on (after the checkpoint is loaded
into the model, not beside that load), :func:`run` reserves the files they arrive in, the clique agrees on
which could be, and the replicas move in the writer's thread, over the clique's own gloo group (the one
the writer's replication uses; never the training's, which the main thread is using); each is checked on
arrival and committed. The next local save waits for it, as for a save in flight. Until it is done, a loss
of the nodes that sent them falls back to the persistent tier.

A replica that fails here (no room for its file, a CRC32, a peer gone) is logged and left out: the restore
has succeeded already, and the next local save replicates every share again (where there is no room, the
first local save's space check refuses the directory, on every rank, with the sizes). (A replicated state needs
every share on every rank to resume, so nothing of its refill is left for later.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from lightning_asyncckpt import collectives
from lightning_asyncckpt.collectives import ProcessGroup
from lightning_asyncckpt.tiers import exchange, store
from lightning_asyncckpt.tiers.mapped import MappedFile
from lightning_asyncckpt.tiers.store import LocalStore

log = logging.getLogger(__name__)


@dataclass
class Deferred:
    """The moves left for later (the same list on every rank), this rank's sends of them (prepared), and,
    once :func:`run` has reserved them, the files it receives into, by owner."""

    moves: list[exchange.Move] = field(default_factory=list)
    prepared: exchange.Prepared = field(default_factory=exchange.Prepared)
    reserved: dict[int, MappedFile] = field(default_factory=dict)


def run(deferred: Deferred, me: int, local: LocalStore, group: ProcessGroup | None) -> int:
    """(every rank of a clique, in the writer's thread, from its first step boundary after a restore) Reserves
    the files ``deferred``'s replicas arrive in, agrees with the clique on which could be, moves them, checks
    and commits those this rank receives; returns how many it committed. Never raises; a peer that never
    comes is bounded by the clique group's timeout (``timeout_s``)."""
    if not deferred.moves:
        return 0
    kept = 0
    try:
        moves, prepared = _reserve_agreed(deferred, me, local, group)
        senders = {(o, r): s for o, s, r, _ in moves}
        for m, head, flat in exchange.transfer(moves, prepared, me, group):
            where = f"the copy sent by rank {senders[(m.owner, me)]} after the restore"
            problem = store.crc_mismatch(m, head, flat, where)
            if problem is None:
                local.commit(m, deferred.reserved[m.owner], head)
                kept += 1
            else:
                log.warning("lightning-asyncckpt: %s; left out, the next local save replicates it again", problem)
    except Exception as e:  # noqa: BLE001 - the restore has succeeded; only this protection waits for the next save
        log.warning("lightning-asyncckpt: rank %d: replicas refilled after the restore failed: %s: %s; the next local"
                    " save replicates every share again", me, type(e).__name__, e)
    return kept


def _reserve_agreed(deferred: Deferred, me: int, local: LocalStore,
                    group: ProcessGroup | None) -> tuple[list[exchange.Move], exchange.Prepared]:
    """(every rank of the clique, together) Reserves this rank's receiving files; the moves into a rank that
    could not reserve all of its are dropped on every rank, so that no sender waits for a receive never
    posted."""
    problem = None
    try:
        for i, (owner, _sender, receiver, manifest) in enumerate(deferred.moves):
            if receiver == me:
                deferred.reserved[owner] = local.reserve(manifest.step, owner, manifest.nbytes)
                deferred.prepared.receives[i] = deferred.reserved[owner].tensor
    except OSError as e:  # e.g. ENOSPC: a directory with room for the rank's own share but not its replicas
        problem = f"{type(e).__name__}: {e}"
        for owner in list(deferred.reserved):  # those reserved before the failure: spares for the next save
            local.release(deferred.reserved.pop(owner))
        log.warning("lightning-asyncckpt: rank %d could not reserve the replicas it is sent after the restore: %s;"
                    " left out (the first local save checks the directory's space for them)", me, problem)
    rows = [(me, problem)] if group is None else collectives.gather_objects((me, problem), group)
    return exchange.keep(deferred.moves, deferred.prepared, {rank for rank, p in rows if p is not None})
