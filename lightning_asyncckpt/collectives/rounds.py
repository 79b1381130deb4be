"""The local tier's agreement at every step boundary: one all-reduce of a few integers (maxima and minima,
:func:`~lightning_asyncckpt.collectives.agreement.max_min`'s encoding) over the tier's own gloo group
(:meth:`TierRun.boundary` says what they mean).

Waited for at once, it sits on every step's critical path: a gloo all-reduce of a few bytes took 3 to 5 ms
per rank here (4 ranks on 2 cores, right after a 4 MiB gradient all-reduce had put them in step;
``benchmarks/probe_agreement.py``), and its latency grows with the world size. ``overlapped`` posts each
boundary's round and reads it at the next boundary, so that it runs in gloo's thread beside the next step's
compute. What it agrees on then takes effect one step later on every rank alike: an emergency save happens
at the boundary after the signal's, a failed save is raised one step later, and old steps are removed one
step later.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_asyncckpt.collectives.agreement import Agreed, decode, encode
from lightning_asyncckpt.collectives.groups import ProcessGroup


class StepAgreement:
    """(all ranks of ``group``, main thread, same order) The rounds of one run's agreement."""

    def __init__(self, group: ProcessGroup | None, overlapped: bool = False) -> None:
        self.group = group  # None: one rank, nothing to agree with
        self.overlapped = overlapped and group is not None
        self._posted: tuple[dist.Work, torch.Tensor, int] | None = None

    def round(self, most: Sequence[int], least: Sequence[int]) -> Agreed | None:
        """(all ranks of the group, at a step boundary) The maxima of ``most`` and minima of ``least`` over
        the ranks: this boundary's; ``overlapped``, the previous boundary's (None at the first), and this
        boundary's are posted for the next one."""
        if self.group is None:
            return Agreed(list(most), list(least))
        if not self.overlapped:
            return self._wait(self._post(most, least))
        posted, self._posted = self._posted, self._post(most, least)
        return None if posted is None else self._wait(posted)

    def now(self, most: Sequence[int], least: Sequence[int]) -> Agreed:
        """(all ranks of the group) A round waited for at once, whatever the mode (finish and drain); call
        :meth:`settle` first, so that a posted round is read, not lost."""
        assert self._posted is None, "a posted round is still to be read: settle() first"
        return Agreed(list(most), list(least)) if self.group is None else self._wait(self._post(most, least))

    def settle(self) -> Agreed | None:
        """(all ranks of the group) The posted round's agreed values, waited for (None if none is posted)."""
        posted, self._posted = self._posted, None
        return None if posted is None else self._wait(posted)

    def drop(self) -> None:
        """(any rank, local) Forgets a posted round without waiting (a peer may be gone: its error stays in
        gloo's thread)."""
        self._posted = None

    def _post(self, most: Sequence[int], least: Sequence[int]) -> tuple[dist.Work, torch.Tensor, int]:
        t = torch.tensor(encode(most, least), dtype=torch.int64)
        return dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True), t, len(most)

    @staticmethod
    def _wait(posted: tuple[dist.Work, torch.Tensor, int]) -> Agreed:
        work, t, n_most = posted
        work.wait()  # bounded by the group's timeout (LocalTier.timeout_s)
        return decode(t.tolist(), n_most)
