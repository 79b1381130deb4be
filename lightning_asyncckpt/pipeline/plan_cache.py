"""Reuse of a collective save's plan while the checkpoint's structure stays the same.

A collective save plans as DCP does: every rank's local plan is gathered to the coordinator, which makes
the global plan and the metadata and scatters each rank its part. Both payloads grow with the number of
ranks, and the coordinator's planning with the number of items of all ranks. Repeated saves of one
training run have the same structure, so their global plan and metadata are the same.

The cache does not trust a flag: every save, each rank still makes its local plan (local, cheap) and
hashes it with what else the global plan depends on (:func:`structure_digest`). One small all-reduce
(:meth:`PlanCache.agree`) then tells every rank whether *every* rank found its digest in its cache, from
the same planning round; only then the gather and scatter are skipped and each rank reuses its part of
that round's plan (and the coordinator the metadata). Otherwise every rank plans in full, and the round's
result is cached under an id the same all-reduce agreed on.

What differs per save stays out of the cache: the writer (its directory, its ``save_id``) is made anew,
shard names are relative (``__<rank>_<n>.distcp``), and the metadata is copied per save, as the writer's
``finish`` fills in the storage locations and the ``storage_meta`` of the save it commits.

``LIGHTNING_ASYNCCKPT_PLAN_CACHE=0`` turns caching off (every save plans in full), for comparisons.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_asyncckpt.collectives import AllMax, max_min

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan

log = logging.getLogger(__name__)

ENV_VAR = "LIGHTNING_ASYNCCKPT_PLAN_CACHE"
MAX_ENTRIES = 4  # structures kept (e.g. a full save and a weights-only save taking turns)
_ID_BITS = 62


def structure_digest(local_plan: SavePlan, *, world_size: int, rank: int, flatten: bool, writer: str,
                     metadata_extra: object = None) -> str:
    """(each rank, pure) A digest of everything this rank contributes to the global plan: each write item
    (fqn, chunk offsets and sizes, the tensor's size, dtype, layout and other properties, or a byte item),
    the local plan's storage and planner data (DCP's flattening map), the writer class, the world size and
    rank, and ``metadata_extra`` (what the coordinator puts into the metadata beside the plans, such as
    where each item sits in the checkpoint dict). Two local plans with the same digest plan alike."""
    parts = (world_size, rank, flatten, writer, local_plan.items, local_plan.storage_data,
             local_plan.planner_data, metadata_extra)
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class CachedPlan:
    """One planning round's result on this rank: its part of the global plan, and on the coordinator the
    metadata (copied out per save by :meth:`metadata_for_save`)."""

    round_id: int
    central_plan: SavePlan  # this rank's, after the coordinator's planning
    metadata: Metadata | None  # the coordinator's, else None

    def metadata_for_save(self) -> Metadata | None:
        """A copy for one save: the writer's ``finish`` sets its storage locations and ``storage_meta``."""
        return copy.copy(self.metadata) if self.metadata is not None else None


@dataclass(frozen=True)
class Decision:
    """What :meth:`PlanCache.agree` decided: reuse ``hit`` (on every rank), or plan in full and cache the
    result under ``round_id``."""

    hit: CachedPlan | None
    round_id: int


class PlanCache:
    """Plans of earlier collective saves on this rank, by structure digest (a few, least recently used
    dropped). It lives in the run (:class:`lightning_asyncckpt.pipeline.run_state.Run`): a new run starts empty."""

    def __init__(self, enabled: bool | None = None, max_entries: int = MAX_ENTRIES) -> None:
        self.enabled = os.environ.get(ENV_VAR, "1") != "0" if enabled is None else enabled
        self.max_entries = max_entries
        self._entries: OrderedDict[str, CachedPlan] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def agree(self, digest: str, all_max: AllMax) -> Decision:
        """(all ranks of the saving group, every collective save, in the same order) Looks ``digest`` up
        and agrees with the other ranks, in one all-reduce through ``all_max`` (element-wise maximum over
        ranks of a few integers, :meth:`Agreement.all_max`), on whether every rank reuses its entry of the
        same round (every rank has one, and the newest and oldest round among them are the same)."""
        entry = self._entries.get(digest) if self.enabled else None
        own = entry.round_id if entry is not None else -1
        proposal = random.getrandbits(_ID_BITS)  # the next round's id, if one is needed: the largest wins
        agreed = max_min(all_max, most=[int(entry is None), own, proposal], least=[own])
        (miss, newest, round_id), (oldest,) = agreed.most, agreed.least
        if miss == 0 and newest == oldest:
            self._entries.move_to_end(digest)
            self.hits += 1
            log.debug("lightning-asyncckpt: save plan reused (structure unchanged on every rank)")
            return Decision(entry, own)
        self.misses += 1
        log.debug("lightning-asyncckpt: planning the save in full (a structure changed, or nothing cached)")
        return Decision(None, round_id)

    def store(self, digest: str, round_id: int, central_plan: SavePlan, metadata: Metadata | None) -> None:
        """(each rank, after a full planning round that succeeded on every rank) Keeps its result."""
        if not self.enabled:
            return
        # a copy: the metadata handed to this save is filled in by its commit
        self._entries[digest] = CachedPlan(round_id, central_plan, copy.copy(metadata) if metadata is not None else None)
        self._entries.move_to_end(digest)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
