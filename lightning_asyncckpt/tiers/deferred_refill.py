"""The replicas a sharded restore leaves for later, sent in the writer's thread from the first step boundary.

A node back with an empty directory needs, to resume a sharded (FSDP2) state, only its own ranks' shares.
The replicas it also held for its clique peers on other nodes protect against the *next* failure, not
this one, so :func:`~lightning_asyncckpt.tiers.restore.restore` prepares their transfers with the others
(files reserved, copies mapped, every rank agreed) but does not run them: that halves what a node back
empty receives before it can resume. From the first step boundary on (after the checkpoint is loaded
into the model, not beside that load), :func:`run` moves them in the writer's thread, over the
clique's own gloo group (the one the writer's replication uses; never the training's, which the main
thread is using), checks each on arrival and commits it. The next local save waits for it, as for a save
in flight. Until it is done, a loss of the nodes that sent them falls back to the persistent tier.

A replica that fails here (a CRC32, a peer gone) is logged and left out: the restore has succeeded
already, and the next local save replicates every share again. (A replicated state needs every share on
every rank to resume, so nothing of its refill is left for later.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch.distributed as dist

from lightning_asyncckpt.tiers import exchange, store
from lightning_asyncckpt.tiers.mapped import MappedFile
from lightning_asyncckpt.tiers.store import LocalStore

log = logging.getLogger(__name__)


@dataclass
class Deferred:
    """The moves left for later (the same list on every rank), this rank's side of them (prepared), and the
    files it reserved to receive into, by owner."""

    moves: list[exchange.Move] = field(default_factory=list)
    prepared: exchange.Prepared = field(default_factory=exchange.Prepared)
    reserved: dict[int, MappedFile] = field(default_factory=dict)


def run(deferred: Deferred, me: int, local: LocalStore, group: dist.ProcessGroup | None) -> int:
    """(every rank of a clique, in the writer's thread, from its first step boundary after a restore) Moves
    ``deferred``'s replicas, checks and commits those this rank receives; returns how many it committed.
    Never raises; a peer that never comes is bounded by the clique group's timeout (``timeout_s``)."""
    if not deferred.moves:
        return 0
    senders = {(o, r): s for o, s, r, _ in deferred.moves}
    kept = 0
    try:
        for m, head, flat in exchange.transfer(deferred.moves, deferred.prepared, me, group):
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
