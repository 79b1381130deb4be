"""``Save``: one save, one object, from the save call to its end, with an explicit state.

Made by ``SavePipeline`` on the training thread of each saving rank when a save is asked for; filled in
as it goes (``scheduler`` snapshots and hands it over, ``poller`` sees its write end, ``committer`` makes
it a checkpoint); every change of state is a named transition (:meth:`Save.to`), checked against
:data:`TRANSITIONS`, so that a save can never, say, commit after it was abandoned.

States:

- ``REQUESTED``: asked for; being validated, snapshotted, planned.
- ``COPYING``: a collective lazy save whose background copy runs; not yet handed to the worker (the ranks
  agree on its fate first, at the wait before the optimizer step).
- ``WRITING``: handed to the worker. A single-writer lazy save is handed over inside the save call, behind
  a gate (``gate``) that its copy opens once proven; until the training thread has settled that copy it is
  also ``run.copying``.
- ``LOST``: handed over behind its gate, but its worker died before the copy was settled: the training
  thread hands it to the next worker once the copy is proven.
- ``ABANDONED``: its copy failed (reported once, then); its worker skips it and nothing is committed.
- ``WRITTEN``: a collective save whose part on this rank is on disk; the ranks commit it together.
- ``PUBLISHING``: a remote DCP directory whose ``.metadata`` is being uploaded (the coordinator).
- ``COMMITTED``, ``FAILED``, ``DROPPED`` (unfinished on the way out): the end.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_asyncckpt.engines import Ticket
from lightning_asyncckpt.faults.policy import NO_FAULTS, SaveFaults
from lightning_asyncckpt.format.layout import Layout
from lightning_asyncckpt.pipeline.dcp_plan import DcpPlan
from lightning_asyncckpt.snapshot import lazy, staging
from lightning_asyncckpt.write import file_layout


class SaveState(str, enum.Enum):
    REQUESTED = "requested"
    COPYING = "copying"
    WRITING = "writing"
    LOST = "lost"
    ABANDONED = "abandoned"
    WRITTEN = "written"
    PUBLISHING = "publishing"
    COMMITTED = "committed"
    FAILED = "failed"
    DROPPED = "dropped"


S = SaveState
ENDED = frozenset({S.COMMITTED, S.FAILED, S.DROPPED})
TRANSITIONS: dict[SaveState, frozenset[SaveState]] = {
    S.REQUESTED: frozenset({S.COPYING, S.WRITING, S.FAILED, S.DROPPED}),
    S.COPYING: frozenset({S.WRITING, S.FAILED, S.DROPPED}),
    S.WRITING: frozenset({S.WRITTEN, S.PUBLISHING, S.COMMITTED, S.LOST, S.ABANDONED, S.FAILED, S.DROPPED}),
    S.LOST: frozenset({S.WRITING, S.FAILED, S.DROPPED}),
    S.ABANDONED: frozenset({S.DROPPED}),
    S.WRITTEN: frozenset({S.PUBLISHING, S.COMMITTED, S.FAILED, S.DROPPED}),
    S.PUBLISHING: frozenset({S.COMMITTED, S.FAILED, S.DROPPED}),
    S.COMMITTED: frozenset(),
    S.FAILED: frozenset(),
    S.DROPPED: frozenset(),
}


class TransitionError(RuntimeError):
    """A save was asked to move between states that do not follow each other: a bug in the pipeline."""


@dataclass(eq=False)  # compared by identity
class Save:
    """One save. The first group is the request as the face received it; the others are filled in as the
    save goes (see the module docstring for ``state``)."""

    # -- the request (the save call) --
    checkpoint: dict[str, Any]
    path: Any  # as the caller gave it; a checked local Path (or a remote URL as a str) once validated
    layout: Layout
    collective: bool  # every rank writes a part (and is here); committed by all ranks together
    seq: int | None  # the save's number in the cross-rank count, None if no rank counted it
    called_at: float  # perf_counter at the call: the stall counts from here
    writes_file: bool = False  # one torch.save file at ``path`` (stock's format), else a DCP directory
    step: int | None = None  # the checkpoint's global_step, for the record
    extra_files: list[tuple[str, bytes]] = field(default_factory=list)  # (name in the checkpoint, bytes)
    faults: SaveFaults = NO_FAULTS
    call: int = 0  # this rank's save call it came from, counted from 1 (``SavePipeline.saves_scheduled``)
    write_hook: Any = None  # picklable; the worker calls it with the buckets before writing
    copy_hook: Any = None  # a lazy snapshot's copy thread calls it before it copies (testing.HoldCopy)
    state: SaveState = SaveState.REQUESTED

    # -- the snapshot (scheduler) --
    order: int = 0  # this rank's FIFO position
    tmp: Path | str | None = None  # where the worker writes; a remote file: the URL itself (visible only complete)
    rank: int = 0  # the rank whose part this is (0 for a single writer)
    snapshot: staging.Snapshot | None = None
    skeleton: bytes | None = None  # the skeleton, torch.save'd at save time (None for a sharded save)
    shape: file_layout.FileLayout | None = None  # aliases and devices, for a torch.save file
    copy: lazy.BackgroundCopy | None = None  # a lazy snapshot's copy
    follows: int | None = None  # the order of the write whose buffers the lazy copy waits for
    planned: DcpPlan | None = None  # a DCP save planned at save time
    stall_s: float = 0.0  # how long training was held: the save call (plus the wait before the step)
    lazy_nbytes: int = 0  # bytes its lazy snapshot copied after the save call returned

    # -- the write (handed to the worker) --
    ticket: Ticket | None = None
    plan: Any = None  # dcp_plan.WritePlan
    result_path: Path | None = None
    gate: Any = None  # write.gate.Gate: a lazy single writer's write waits there for its copy
    handed_at: float = 0.0  # monotonic, at the hand-over
    write_s: float = 0.0  # the worker's own write time, as it reported
    file_nbytes: int = 0  # the file's size, as the worker reported it
    written: list | None = None  # a collective save's local write results, once this rank's part is on disk

    def to(self, state: SaveState) -> None:
        """Moves the save to ``state``; a move that does not follow from the current state raises."""
        if state not in TRANSITIONS[self.state]:
            raise TransitionError(f"save {self.order} to {self.path}: {self.state.value} -> {state.value} is not a transition")
        self.state = state
        if state is S.WRITING:
            self.handed_at = time.monotonic()

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def buffer_set(self) -> Any:
        """This save's hold on its staging buffers (None before the snapshot, or without staging)."""
        return self.snapshot.buffer_set if self.snapshot is not None else None

    @property
    def nbytes(self) -> int:
        return self.snapshot.nbytes if self.snapshot is not None else 0

    @property
    def copy_running(self) -> bool:
        """Its lazy copy's thread may still write into its buffers."""
        return self.copy is not None and not self.copy.done()

    @property
    def remote(self) -> bool:
        """Written to an object store: nothing to publish or clean up locally (an unfinished upload is
        never visible; the worker discards a failed one)."""
        return isinstance(self.path, str)
