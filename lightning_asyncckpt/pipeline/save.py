"""One save on its way from the save call to the worker: the request as the face received it, and the
hand-over of a save whose snapshot is taken (a lazy one's copy may still run).

Made and read on the training thread of each saving rank (``scheduler``, ``write_jobs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_asyncckpt.faults.policy import NO_FAULTS, SaveFaults
from lightning_asyncckpt.format.layout import Layout
from lightning_asyncckpt.pipeline.dcp_plan import DcpPlan
from lightning_asyncckpt.pipeline.pending import PendingSave
from lightning_asyncckpt.snapshot import lazy, staging
from lightning_asyncckpt.write import torch_file


@dataclass
class SaveRequest:
    """One call to save, as the face received it."""

    checkpoint: dict[str, Any]
    path: Any  # as the caller gave it; a checked local Path once ``submit`` has validated it
    layout: Layout
    collective: bool  # every rank writes a part (and is here)
    seq: int | None  # the save's number in the cross-rank count
    started: float  # perf_counter at the call: the stall counts from here
    writes_file: bool = False  # one torch.save file at ``path`` (stock's format), else a DCP directory
    step: int | None = None
    extra_files: list[tuple[str, bytes]] = field(default_factory=list)  # (name in the checkpoint, bytes)
    faults: SaveFaults = NO_FAULTS
    call: int = 0  # this rank's save call it came from, counted from 1 (``SavePipeline.saves_scheduled``)


@dataclass
class HandOver:
    """A save whose snapshot is taken (a lazy one's copy may still run) and whose write is not yet handed
    to the worker. Its non-tensor state is serialized already: a snapshot of the step it was saved at."""

    request: SaveRequest
    snapshot: staging.Snapshot
    order: int
    tmp: Path | str
    rank: int
    skeleton: bytes | None  # the skeleton, torch.save'd at save time (None for a sharded save)
    shape: torch_file.FileLayout | None  # aliases and devices, for a torch.save file
    write_hook: Any
    copy_hook: Any  # a lazy snapshot's copy thread calls it before it copies (testing.HoldCopy)
    stall_s: float = 0.0  # how long the save call held training
    copy: lazy.BackgroundCopy | None = None  # a lazy snapshot's copy in flight
    follows: int | None = None  # the order of the write whose buffers the copy waits for
    planned: DcpPlan | None = None  # a DCP save planned at save time, while its lazy copy runs
    pending: PendingSave | None = None  # a single-writer save handed over at save time, behind its gate
