"""``TierGroups``: who a run's local tier talks to: its ranks, their nodes, its cliques and process groups.

Made once, at setup, by :func:`~lightning_asyncckpt.tiers.setup.open_tier` (every rank, in the same order:
making process groups is collective), and never changed after: every part of the tier (saving, the step
boundary, the restore) reads the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_asyncckpt import collectives
from lightning_asyncckpt.tiers import cliques
from lightning_asyncckpt.tiers.config import LocalTier

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class TierGroups:
    """(every rank) The tier's ranks and groups; the same on every rank but ``rank`` and ``clique``."""

    distributed: bool  # a process group exists (else one rank, nothing to agree with)
    rank: int  # this process's global rank
    world: int  # the number of ranks
    jump: int  # the rank distance between the members of a clique (the ranks per node, by default)
    node_of: list[int]  # each rank's node
    factor: int  # F: the copies of each share (1: none but its own)
    cliques: list[list[int]]  # which ranks hold each other's shares
    clique: list[int]  # this rank's clique
    group: ProcessGroup | None  # the tier's agreement (main thread)
    clique_group: ProcessGroup | None  # this rank's clique (the writer's thread); None without replicas

    @property
    def topology(self) -> tuple[int, int, int]:
        """``(world, jump, factor)``: a step saved under another topology cannot be restored by this one."""
        return (self.world, self.jump, self.factor)

    @property
    def nodes(self) -> int:
        return len(set(self.node_of))

    def gather(self, obj: object) -> list[object]:
        """(all ranks) Every rank's ``obj`` over the tier's group."""
        return _gather(obj, self.group, self.distributed, self.world)


def _gather(obj: object, group: ProcessGroup | None, distributed: bool, world: int) -> list[object]:
    if not distributed or world == 1:
        return [obj]
    return collectives.gather_objects(obj, group)


def make_groups(config: LocalTier, node_rank: int, local_world_size: int) -> TierGroups:
    """(every rank, together, once the training's process group exists) Makes the tier's gloo group, learns
    every rank's node over it, lays out the cliques and makes every clique's group (every rank makes every
    clique's group, in the same order: collective)."""
    distributed = collectives.is_distributed()
    rank, world = collectives.rank(), collectives.world_size()
    jump = config.replication_jump or max(local_world_size, 1)
    group = clique_group = None
    if distributed:  # the tier's agreement (main thread)
        group = collectives.bounded_group(config.timeout_s)
    node_of = _gather(node_rank, group, distributed, world)
    nodes = len(set(node_of))
    factor = config.factor_for(nodes)  # F; by default it follows the nodes
    layout = cliques.layout(world, jump, factor, nodes)
    clique = cliques.clique_of(rank, layout)
    if distributed and factor > 1:  # every rank makes every clique's group, in the same order
        groups = collectives.bounded_groups(layout, config.timeout_s)
        clique_group = groups[layout.index(clique)]
    return TierGroups(distributed, rank, world, jump, node_of, factor, layout, clique, group, clique_group)
