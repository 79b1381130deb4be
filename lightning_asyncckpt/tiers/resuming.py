"""The local tier at a resume: which tier to resume from, and the local step's restore, tried again without
a bad copy.

:class:`TierRestorer` picks the local tier's newest complete step, unless the persistent checkpoint is
newer (or the local tier has none), and restores it on every rank (:mod:`~lightning_asyncckpt.tiers.restore`);
the checkpoint it fetched is then handed, once, to the load that asks for its key
(:mod:`~lightning_asyncckpt.tiers.restore_key`). Replicas that a sharded restore leaves for later are sent
from the writer's thread once training resumes (:mod:`~lightning_asyncckpt.tiers.deferred_refill`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_asyncckpt.tiers import deferred_refill, packing, recovery, restore, restore_key
from lightning_asyncckpt.tiers.config import LocalTier
from lightning_asyncckpt.tiers.persistent_step import global_step
from lightning_asyncckpt.tiers.store import Held, LocalStore
from lightning_asyncckpt.tiers.tier_groups import TierGroups
from lightning_asyncckpt.tiers.writer import ShareWriter

if TYPE_CHECKING:
    from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    """(every rank alike) What every rank holds now, and the step to restore from it (None: the persistent
    tier, and ``why_not`` says why)."""

    plan: recovery.Plan | None
    holdings: list[list[Held]] = field(default_factory=list)
    persistent_step: int | None = None  # the persistent checkpoint's step, as rank 0 read it
    why_not: str = ""


class TierRestorer:
    """(every rank, together) One run's restores from the local tier."""

    def __init__(self, config: LocalTier, groups: TierGroups, store: LocalStore, writer: ShareWriter,
                 restored: Callable[[int], None]) -> None:
        self.config, self.groups, self.store, self.writer = config, groups, store, writer
        self._on_restored = restored  # the step boundary's: the restored step is complete everywhere
        self._fetched: dict[str, dict[str, object]] = {}  # the checkpoint each key names, until take()
        self._refill: Callable[[], None] | None = None  # the replicas a restore left for later (start_refill)

    def latest(self, run: str, persistent: str | Path | None, weights_only: bool | None = None) -> str | Path | None:
        """(every rank, together, before loading) The checkpoint to resume from: a key for :meth:`take` (the
        local tier's newest complete step of ``run``, :func:`~lightning_asyncckpt.tiers.restore.restore`),
        else ``persistent`` (also when it is newer, or when a share fails its CRC check), with one log line why.

        ``weights_only``: the caller's (``fit(..., weights_only=...)``, ``fabric.load``): the shares' headers
        are read with ``torch.load(weights_only=True)`` unless it is False, as stock reads a checkpoint (None
        is stock's default, True). A header that holds more (a pickle that would run code) raises
        :class:`~lightning_asyncckpt.tiers.packing.UnsafeShareError` on every rank, naming its file.

        A copy that fails its CRC32 check is left out and the restore tried again: the step is still
        complete where another rank of its clique holds a good copy (which also replaces the bad one). Each
        try leaves out at least one more copy, so the tries end."""
        g, config = self.groups, self.config
        self._refill = None  # an earlier restore's replicas, never started: every rank drops them alike
        self.writer.wait(config.timeout_s)  # nothing of this run's is still being written or sent
        # read once (a persistent checkpoint on an object store is a request), gathered with every try's holdings
        mine = global_step(persistent) if g.rank == 0 else None
        failed: list[str] = []  # why each earlier try failed
        left_out: set[tuple[int, int, int]] = set()  # (holder, step, owner): copies that failed their check
        while True:
            choice = self._choose(run, mine, left_out)
            plan = choice.plan
            if plan is None:
                return self._persistent(persistent, choice.persistent_step, "; ".join(
                    [*failed, f"without the copies that failed, {choice.why_not}" if failed else choice.why_not]))
            ranks = restore.Ranks(g.rank, g.world, config.root, self.store, g.group, g.node_of,
                                  g.cliques, g.factor, g.topology, g.gather, weights_only is not False)
            done = restore.restore(plan, choice.holdings, ranks)
            if done.unsafe:
                raise packing.UnsafeShareError.of_step(done.unsafe, config.root, config.dir)
            if not done.problems:
                break
            more = f" (and {len(done.problems) - 3} more)" if len(done.problems) > 3 else ""
            why = f"step {plan.step} failed its checks: " + "; ".join(done.problems[:3]) + more
            bad = {(holder, plan.step, owner) for holder, owner in done.corrupt} - left_out
            if not bad:  # not (only) a bad copy: another try would meet the same problem
                return self._persistent(persistent, choice.persistent_step, "; ".join([*failed, why]))
            failed.append(why)
            left_out |= bad
            if g.rank == 0:
                log.warning("lightning-asyncckpt: local tier: %s; trying again without %s", why, ", ".join(
                    f"rank {h}'s copy of rank {o}'s share" for h, _s, o in sorted(bad)))
        key = restore_key.key_for(config.root, plan.step)
        self._fetched[key] = done.checkpoint
        self._on_restored(plan.step)
        later = done.later
        if later.moves:  # every rank of the clique joins, in its writer's thread (see deferred_refill)
            self._refill = lambda: deferred_refill.run(later, g.rank, self.store, g.clique_group)
        if g.rank == 0:
            log.warning("lightning-asyncckpt: resuming from the local tier at step %d (%d share(s) sent between"
                        " ranks, %d read on their own node%s)", plan.step, done.sent, done.read,
                        f"; {len(later.moves)} replica(s) sent after, while training resumes" if later.moves else "")
        return key

    def _choose(self, run: str, pstep_here: int | None, left_out: set[tuple[int, int, int]]) -> Choice:
        """(every rank, together) What every rank holds now of ``run``, less the copies ``left_out``, and the
        step to restore from it; no plan where the persistent tier is to be used (no complete local step, or
        an older one). ``pstep_here``: the persistent checkpoint's step as rank 0 read it (None on the others)."""
        g = self.groups
        rows = g.gather((self.store.holdings(g.topology), pstep_here, self.store.saved_under_others(g.topology)))
        holdings = [[h for h in row[0] if h.run == run and (holder, h.step, h.owner) not in left_out]
                    for holder, row in enumerate(rows)]
        pstep = rows[0][1]
        plan = recovery.plan(holdings, g.cliques)
        if plan is None:
            others: dict[tuple, int] = {}
            for row in rows:  # a resized job: steps saved under another topology, which it cannot use
                for topo, step in row[2].items():
                    others[topo] = max(others.get(topo, -1), step)
            return Choice(None, holdings, pstep, recovery.why_not(holdings, g.cliques, others, g.topology))
        if pstep is not None and pstep > plan.step:
            return Choice(None, holdings, pstep, f"its step {pstep} is newer than the local tier's {plan.step}")
        return Choice(plan, holdings, pstep)

    def _persistent(self, persistent: str | Path | None, pstep: int | None, why: str) -> str | Path | None:
        if self.groups.rank == 0:
            target = ("nothing (no persistent checkpoint)" if persistent is None
                      else f"{persistent} (step {pstep})" if pstep is not None else str(persistent))
            log.warning("lightning-asyncckpt: resuming from the persistent tier, %s: local tier: %s", target, why)
        return persistent

    def take(self, key: object) -> dict[str, object] | None:
        """The checkpoint :meth:`latest` fetched for ``key`` (once), or None for any other path."""
        return self._fetched.pop(str(key), None)

    def start_refill(self) -> None:
        """(every rank, at its first boundary, save, finish or close after a restore) Starts sending the
        replicas the restore left for later (:mod:`~lightning_asyncckpt.tiers.deferred_refill`) in the writer's
        thread: after the checkpoint is loaded into the model, not beside that load, so that they overlap the
        first training steps, as a local save's replication does."""
        if self._refill is not None:
            job, self._refill = self._refill, None
            self.writer.background(job, "asyncckpt-local-refill")

    def drop_refill(self) -> None:
        """(every rank, on the way out of an exception) Sends nothing more: a peer may be gone."""
        self._refill = None
