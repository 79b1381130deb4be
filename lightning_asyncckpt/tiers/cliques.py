"""Which ranks hold each other's shares: NVRx's clique layout (``parse_group_sequence``), checked first.

With world size ``W``, jump ``J`` and factor ``F``, the cliques are ``n, n + J, ..., n + (F-1)J`` for
``n = aJF + b`` (``a < W / JF``, ``b < J``): 32 ranks, ``J = 8``, ``F = 2`` give 0-8, 1-9, ..., 23-31.
"""

from __future__ import annotations


class TierConfigError(ValueError):
    """The local tier cannot run with this configuration (raised at setup, on every rank, before any save)."""


def layout(world_size: int, jump: int, factor: int, nodes: int = 1) -> list[list[int]]:
    """The cliques, sorted; refuses a world size that does not divide by ``jump * factor`` (on one of
    ``nodes`` nodes with ``jump`` its ranks, saying that no other node could hold a replica)."""
    if factor > 1 and world_size == jump and nodes == 1:
        raise TierConfigError(
            f"LocalTier: replication_factor={factor} in a job of one node ({world_size} rank(s), replication_jump"
            f" = {jump} ranks per node): no other node can hold a replica. Fix: replication_factor=1, or leave it"
            " out (the default is 1 on one node and 2 on several): each rank then keeps its own share on its"
            " node, which survives a crashed or restarted process, not a lost node. Or run on several nodes."
        )
    if world_size % (jump * factor):
        raise TierConfigError(
            f"LocalTier: the world size {world_size} does not divide by replication_jump x replication_factor"
            f" = {jump} x {factor} = {jump * factor}, so the ranks cannot form cliques of {factor}."
            f" Fix: use a world size that is a multiple of {jump * factor}, or change replication_factor"
            " (1 keeps no replica) or replication_jump (the ranks per node by default)."
        )
    from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import parse_group_sequence

    return [list(c) for c in parse_group_sequence(jump, factor, world_size)]


def clique_of(rank: int, cliques: list[list[int]]) -> list[int]:
    return next(c for c in cliques if rank in c)


def same_node_peers(cliques: list[list[int]], node_of: list[int]) -> list[tuple[int, int, int]]:
    """``(rank, peer, node)`` for each pair of one clique on the same node (their replicas would be lost
    together with that node)."""
    found = []
    for c in cliques:
        for i, a in enumerate(c):
            found += [(a, b, node_of[a]) for b in c[i + 1:] if node_of[a] == node_of[b]]
    return found
