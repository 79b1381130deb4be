"""Which step the local tier can restore, and who sends each share (pure: every rank computes the same
answer from the same gathered holdings)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_asyncckpt.tiers.store import Held


@dataclass(frozen=True)
class Plan:
    """Step ``step`` is complete: every owner's share is held in its clique. ``sources[owner]`` is the rank
    whose copy that owner gets (itself when it still holds its own), with its manifest."""

    step: int
    sources: dict[int, tuple[int, Held]]

    def moves(self, clique: list[int]) -> list[tuple[int, int, int]]:
        """``(owner, sender, nbytes)`` of ``clique``'s owners that get their share from a peer, in rank order."""
        return [(o, s, h.nbytes) for o in sorted(clique) for s, h in [self.sources[o]] if s != o]


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
