"""Which step the local tier can restore (:func:`plan`), and where each rank gets each share it needs
(:func:`fetch`). Pure: every rank computes the same answer from the same gathered holdings."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_asyncckpt.tiers.store import Held


@dataclass(frozen=True)
class Plan:
    """Step ``step`` is complete: every owner's share is held in its clique. ``sources[owner]`` is a rank
    that holds that owner's share (the owner itself when it still holds its own), with its manifest."""

    step: int
    sources: dict[int, tuple[int, Held]]


def plan(holdings: list[list[Held]], cliques: list[list[int]]) -> Plan | None:
    """The newest step whose every owner has a copy in its clique, or None. A rank prefers its own copy;
    otherwise the lowest peer that holds one sends it."""
    world = len(holdings)
    clique_of = {r: c for c in cliques for r in c}
    steps = sorted({h.step for held in holdings for h in held}, reverse=True)
    for step in steps:
        sources: dict[int, tuple[int, Held]] = {}
        for owner in range(world):
            for holder in sorted(clique_of[owner], key=lambda r: (r != owner, r)):
                match = [h for h in holdings[holder] if h.step == step and h.owner == owner]
                if match:
                    sources[owner] = (holder, match[0])
                    break
        if len(sources) == world:
            return Plan(step, sources)
    return None


@dataclass(frozen=True)
class Fetch:
    """How every rank gets the shares it needs at one step: ``reads[r]``, the ``(owner, holder, manifest)``
    that rank ``r`` reads from a holder directory on its own node (node-local storage: no network);
    ``moves``, the ``(owner, sender, receiver, manifest)`` sent between nodes, in the order every rank runs
    them."""

    reads: dict[int, list[tuple[int, int, Held]]]
    moves: list[tuple[int, int, int, Held]]


def fetch(plan: Plan, holdings: list[list[Held]], node_of: list[int], needs: dict[int, list[int]]) -> Fetch:
    """Where each rank gets each owner's share in ``needs[rank]`` (a sharded state: its own; a replicated
    one: every owner's): a copy on its own node if there is one (its own first), else a copy on another
    node, the senders taken in turn so that no holder sends everything."""
    where: dict[int, list[tuple[int, Held]]] = {}
    for holder, held in enumerate(holdings):
        for h in held:
            if h.step == plan.step:
                where.setdefault(h.owner, []).append((holder, h))
    reads: dict[int, list[tuple[int, int, Held]]] = {r: [] for r in needs}
    moves: list[tuple[int, int, int, Held]] = []
    for receiver in sorted(needs):
        for owner in needs[receiver]:
            copies = sorted(where[owner], key=lambda c: (c[0] != receiver, c[0]))
            near = [c for c in copies if node_of[c[0]] == node_of[receiver]]
            if near:
                reads[receiver].append((owner, *near[0]))
            else:
                sender, manifest = copies[receiver % len(copies)]
                moves.append((owner, sender, receiver, manifest))
    return Fetch(reads, moves)


def why_not(holdings: list[list[Held]], cliques: list[list[int]]) -> str:
    """One line on why no step is complete: which owners' shares are missing at the newest step any rank has."""
    steps = {h.step for held in holdings for h in held}
    if not steps:
        return "no rank holds any local checkpoint (every local directory is empty)"
    newest = max(steps)
    clique_of = {r: c for c in cliques for r in c}
    missing = [o for o in range(len(holdings))
               if not any(h.step == newest and h.owner == o for r in clique_of[o] for h in holdings[r])]
    return (f"step {newest} lacks the shares of rank(s) {missing} (their whole clique lost them); no older"
            " step is complete either")
