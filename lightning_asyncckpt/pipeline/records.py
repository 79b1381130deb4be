"""``SaveRecord``: what one committed save cost, and the figures loggers get from it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lightning_asyncckpt.units import human_bytes, rate, seconds

METRICS_PREFIX = "asyncckpt/"


@dataclass(frozen=True)
class SaveRecord:
    """What one committed save cost, as this rank saw it (``AsyncCheckpointIO.history``, and what
    ``finalize`` returns).

    Attributes:
        path: the committed checkpoint.
        step: the checkpoint's ``global_step``, when it has one.
        stall_s: how long ``save_checkpoint`` held training on this rank (waiting for room included), plus,
            for a lazy snapshot, how long the wait for its copy and the hand-over held it.
        write_s: from scheduling the write to the commit: how long the checkpoint took to become durable.
        nbytes: bytes written into shard files, by all ranks together.
        local_nbytes: bytes of tensors this rank staged and wrote.
        pending: saves still pending on this rank right after this one committed.
        worker_s: the background worker's own time for this rank's part (write and fsync).
        lazy_nbytes: bytes of ``local_nbytes`` copied in the background after the save call returned
            (``snapshot="lazy"``); the wait for that copy counts in ``stall_s``.
    """

    path: str
    step: int | None
    stall_s: float
    write_s: float
    nbytes: int
    local_nbytes: int
    pending: int
    worker_s: float
    lazy_nbytes: int = 0

    @property
    def gbps(self) -> float:
        """Write throughput in GB/s (1e9 bytes), all ranks' bytes over the time to the commit."""
        return self.nbytes / max(self.write_s, 1e-9) / 1e9

    def metrics(self, prefix: str = METRICS_PREFIX) -> dict[str, float]:
        """The figures a logger gets, under one prefix (``AsyncFinalizerCallback`` logs these on rank 0)."""
        return {
            f"{prefix}stall_seconds": self.stall_s,
            f"{prefix}write_seconds": self.write_s,
            f"{prefix}bytes_written": float(self.nbytes),
            f"{prefix}write_gb_per_second": self.gbps,
            f"{prefix}pending_saves": float(self.pending),
        }

    def summary(self) -> str:
        """The INFO line logged on rank zero for every committed checkpoint."""
        speed = rate(self.nbytes / max(self.write_s, 1e-9))
        return (
            f"committed {os.path.basename(self.path)}: {human_bytes(self.nbytes)} in {seconds(self.write_s)}"
            f" ({speed}); training stalled {seconds(self.stall_s)}"
        )


class Ledger:
    """What this rank's saves came to, kept by the plugin across its runs: the records of the committed
    saves, oldest first, and the numbers of the save calls that committed (``SaveSession.saves_settled``).
    Both are the plugin's own containers, shared: a record outlives the run that made it."""

    def __init__(self, history: list[SaveRecord], committed_calls: set[int] | None = None) -> None:
        self._history = history
        self._committed_calls = committed_calls if committed_calls is not None else set()

    @property
    def history(self) -> list[SaveRecord]:
        return self._history

    def __len__(self) -> int:
        return len(self._history)

    def record(self, record: SaveRecord, call: int) -> None:
        """(this rank, at a commit) The record of a save that committed, from save call ``call``."""
        self._history.append(record)
        self._committed_calls.add(call)


def global_step(state: object) -> int | None:
    """The step a checkpoint was taken at: Lightning's ``global_step``, or a Fabric loop's ``step``."""
    if not isinstance(state, dict):
        return None
    step = state.get("global_step", state.get("step"))
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    return int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def written_bytes(all_results: list) -> int:
    """Bytes in shard files, from every rank's DCP write results."""
    total = 0
    for rank_results in all_results:
        for r in rank_results or ():
            info = getattr(r, "storage_data", None)
            total += int(getattr(info, "length", 0) or 0)
    return total
