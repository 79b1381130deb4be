"""Which step the local tier can restore (:func:`plan`), which shares each rank must hold again
(:func:`refill`), and where each rank gets each share it needs (:func:`fetch`). Pure: every rank computes
the same answer from the same gathered holdings."""

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


def holds(rank: int, cliques: list[list[int]], factor: int) -> list[int]:
    """The owners whose shares ``rank`` holds after every save: its clique's (with replication), else its own."""
    return sorted(next(c for c in cliques if rank in c)) if factor > 1 else [rank]


def refill(plan: Plan, holdings: list[list[Held]], cliques: list[list[int]], factor: int,
           node_of: list[int]) -> list[tuple[int, int, int, Held]]:
    """The ``(owner, sender, receiver, manifest)`` sends that give every rank back what it holds after a
    save (a node back with an empty directory gets its ranks' shares and replicas again), each from a copy
    on the receiver's own node where there is one, else from the holders in turn. Same order on every rank."""
    where = _where(plan, holdings)
    moves = []
    for receiver in range(len(holdings)):
        have = {h.owner for h in holdings[receiver] if h.step == plan.step}
        for owner in holds(receiver, cliques, factor):
            if owner not in have:
                copies = sorted(where[owner], key=lambda c: (node_of[c[0]] != node_of[receiver], c[0]))
                near = [c for c in copies if node_of[c[0]] == node_of[receiver]]
                sender, manifest = near[0] if near else copies[receiver % len(copies)]
                moves.append((owner, sender, receiver, manifest))
    return moves


@dataclass(frozen=True)
class Fetch:
    """How every rank gets the shares it needs at one step, once :func:`refill` has run: ``reads[r]``, the
    ``(owner, holder, manifest)`` that rank ``r`` reads from a holder directory on its own node (no
    network); ``moves``, the ``(owner, sender, receiver, manifest)`` sent between nodes (a replicated state
    whose shares its node does not hold), in the order every rank runs them."""

    reads: dict[int, list[tuple[int, int, Held]]]
    moves: list[tuple[int, int, int, Held]]


def fetch(plan: Plan, holdings: list[list[Held]], node_of: list[int], needs: dict[int, list[int]]) -> Fetch:
    """Where each rank gets each owner's share in ``needs[rank]`` (a sharded state: its own; a replicated
    one: every owner's): a copy on its own node if there is one (its own first), else a copy on another
    node, the senders taken in turn so that no holder sends everything. ``holdings`` as after the refill."""
    where = _where(plan, holdings)
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


def after(holdings: list[list[Held]], moves: list[tuple[int, int, int, Held]]) -> list[list[Held]]:
    """The holdings once ``moves`` have run (each receiver then holds what it was sent)."""
    out = [list(h) for h in holdings]
    for _owner, _sender, receiver, manifest in moves:
        out[receiver].append(manifest)
    return out


def _where(plan: Plan, holdings: list[list[Held]]) -> dict[int, list[tuple[int, Held]]]:
    where: dict[int, list[tuple[int, Held]]] = {}
    for holder, held in enumerate(holdings):
        for h in held:
            if h.step == plan.step:
                where.setdefault(h.owner, []).append((holder, h))
    return where


def why_not(holdings: list[list[Held]], cliques: list[list[int]], others: dict[tuple, int] | None = None,
            topology: tuple = ()) -> str:
    """One line on why no step is complete: which owners' shares are missing at the newest step any rank has,
    or, where no rank has any under this run's ``topology``, the steps saved under ``others`` (``{topology:
    newest step}``, gathered from every rank)."""
    steps = {h.step for held in holdings for h in held}
    if not steps and others:
        (world, jump, factor), step = max(others.items(), key=lambda kv: kv[1])
        now = (f"this run has {topology[0]} with replication_jump={topology[1]}, replication_factor={topology[2]}"
               if len(topology) == 3 else "this run's differs")
        return (f"step {step} was saved by {world} rank(s) with replication_jump={jump}, replication_factor={factor},"
                f" and {now}: the local tier does not reshard (the persistent tier does); `lightning-asyncckpt"
                " local DIR --remove --yes` frees those files")
    if not steps:
        return "no rank holds any local checkpoint (every local directory is empty)"
    newest = max(steps)
    clique_of = {r: c for c in cliques for r in c}
    missing = [o for o in range(len(holdings))
               if not any(h.step == newest and h.owner == o for r in clique_of[o] for h in holdings[r])]
    return (f"step {newest} lacks the shares of rank(s) {missing} (their whole clique lost them); no older"
            " step is complete either")
