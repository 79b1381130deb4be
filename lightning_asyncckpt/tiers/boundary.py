"""The local tier at a step boundary: what the ranks agree on after every optimizer step.

:class:`StepBoundary` runs one all-reduce per boundary on the tier's own gloo group
(:mod:`~lightning_asyncckpt.collectives.rounds`), which carries:

- a preemption request on any rank (and whether every rank received the same signal, and has the handler
  it replaced to pass on: :mod:`~lightning_asyncckpt.integration.replaced_handlers`);
- a failed local save on any rank, raised here on every rank;
- the newest step complete everywhere; older steps are then removed from this rank's holder directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lightning_asyncckpt.collectives import Agreed, StepAgreement
from lightning_asyncckpt.errors import CheckpointWriteError, RankFailure
from lightning_asyncckpt.tiers.preemption import PreemptionFlag
from lightning_asyncckpt.tiers.store import LocalStore
from lightning_asyncckpt.tiers.tier_groups import TierGroups
from lightning_asyncckpt.tiers.writer import ShareWriter


@dataclass(frozen=True)
class Boundary:
    """What the ranks agreed on at a step boundary."""

    preempted: bool  # some rank received a preemption signal
    complete: int  # the newest step every rank holds in full (-1: none yet)
    everywhere: bool = False  # every rank received the same preemption signal
    # every rank has the handler that signal replaced, to pass it on (TierRun.replaced_handler)
    handlers_everywhere: bool = False


class StepBoundary:
    """(every rank, main thread) The tier's agreement at step boundaries, and the newest complete step."""

    def __init__(self, groups: TierGroups, agreement: StepAgreement, flag: PreemptionFlag, writer: ShareWriter,
                 store: LocalStore, root: Path) -> None:
        self.groups, self.agreement, self.flag = groups, agreement, flag
        self.writer, self.store, self.root = writer, store, root
        self.complete = -1  # the newest step complete on every rank (-1: none yet)

    def round(self) -> Boundary:
        """(every rank, after every optimizer step) One all-reduce (see the module docstring). With
        ``overlap_agreement`` the round is posted here and what the previous boundary posted is returned
        (nothing at the first): :mod:`lightning_asyncckpt.collectives.rounds`."""
        agreed = self.agreement.round(*self._values())
        return Boundary(False, self.complete) if agreed is None else self._agreed(agreed)

    def finish(self) -> int:
        """(every rank, once the local save in flight is written) Agrees now, reading a posted round first
        (its failure raised, not lost); returns the newest complete step."""
        posted = self.agreement.settle()  # an overlapped round: read (its failure raised), not lost
        if posted is not None:
            self._agreed(posted)
        return self._agreed(self.agreement.now(*self._values())).complete

    def restored(self, step: int) -> None:
        """(every rank, after a restore of ``step`` from the local tier) That step is complete everywhere."""
        self.complete = step

    def drop(self) -> None:
        """(every rank, on the way out of an exception) Forgets a posted round: a peer may be gone."""
        self.agreement.drop()

    def raise_failed(self, force: bool = False) -> None:
        """(every rank, together where ``force`` or with more than one rank) Raises a failed local save of any
        rank as :class:`CheckpointWriteError` on every rank (once); nothing where none failed."""
        errors = self.groups.gather(self.writer.error) if (force or self.groups.world == 1) else None
        if errors and any(errors):
            self.writer.clear_error()
            failures = [RankFailure(r, "LocalTierError", e) for r, e in enumerate(errors) if e]
            raise CheckpointWriteError(str(self.root), failures,
                                       note="The local tier keeps its newest complete step.")

    def _values(self) -> tuple[list[int], list[int]]:
        """What this rank brings to a boundary's round: the values whose highest, and those whose lowest,
        every rank agrees on."""
        signum = self.flag.received_number
        handler = int(signum > 0 and self.flag.replaced_handler() is not None)
        return [signum, int(self.writer.error is not None)], [signum, handler, self.writer.newest_done]

    def _agreed(self, agreed: Agreed) -> Boundary:
        (highest, failed), (lowest, handlers, complete) = agreed.most, agreed.least
        if failed:
            self.raise_failed(force=True)
        if complete > self.complete:
            self.complete = complete
            self.store.remove_older(complete)
        same = lowest > 0 and lowest == highest
        return Boundary(highest > 0, self.complete, everywhere=same, handlers_everywhere=same and handlers == 1)
