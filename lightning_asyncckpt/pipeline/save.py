"""``Save``: one save, one object, from the save call to its end, with an explicit state.

Made by :class:`~lightning_asyncckpt.pipeline.pipeline.SaveSession` (``submit``) on the training thread of each saving rank when a save is asked for; filled in
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
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from lightning_asyncckpt.engines import Ticket
from lightning_asyncckpt.faults.policy import NO_FAULTS, SaveFaults
from lightning_asyncckpt.format.layout import Layout
from lightning_asyncckpt.pipeline.dcp_plan import DcpPlan, WritePlan
from lightning_asyncckpt.snapshot import lazy, staging
from lightning_asyncckpt.snapshot.buffer_pool import Lease
from lightning_asyncckpt.storage import destination
from lightning_asyncckpt.storage.destination import Destination
from lightning_asyncckpt.write import file_layout
from lightning_asyncckpt.write.gate import Gate


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


class ExtraFile(NamedTuple):
    """A small file written beside a DCP directory's shards (``meta.pt``), serialized at save time."""

    name: str
    data: bytes


@dataclass(frozen=True)
class SaveRequest:
    """The save call, as the face received it. Replaced whole (never edited) when the scheduler checks
    its path or prepares a ``torch.save`` file's dict (:meth:`Save.validated`, :meth:`Save.prepared`)."""

    checkpoint: dict[str, object]
    path: Path | str  # as the caller gave it; a checked local Path (or a remote URL as a str) once validated
    layout: Layout
    collective: bool  # every rank writes a part (and is here); committed by all ranks together
    seq: int | None  # the save's number in the cross-rank count, None if no rank counted it
    called_at: float  # perf_counter at the call: the stall counts from here
    writes_file: bool = False  # one torch.save file at ``path`` (stock's format), else a DCP directory
    step: int | None = None  # the checkpoint's global_step, for the record
    extra_files: list[ExtraFile] = field(default_factory=list)
    faults: SaveFaults = NO_FAULTS
    call: int = 0  # this rank's save call it came from, counted from 1 (``SaveSession.saves_scheduled``)
    write_hook: Callable[[list], None] | None = None  # picklable; the worker calls it with the buckets before writing
    copy_hook: Callable[[], None] | None = None  # a lazy snapshot's copy thread calls it before it copies (testing.HoldCopy)
    destination: Destination | None = None  # where ``path`` is, once validated


@dataclass(frozen=True)
class Staged:
    """What the scheduler made of the state at save time (on the training thread). A value: each step
    replaces it (:meth:`Save.snapshotted`, ...)."""

    snapshot: staging.Snapshot | None = None
    skeleton: bytes | None = None  # the skeleton, torch.save'd at save time (None for a sharded save)
    shape: file_layout.FileLayout | None = None  # aliases and devices, for a torch.save file
    copy: lazy.BackgroundCopy | None = None  # a lazy snapshot's copy
    follows: int | None = None  # the order of the write whose buffers the lazy copy waits for
    planned: DcpPlan | None = None  # a DCP save planned at save time


@dataclass(frozen=True)
class Costs:
    """What the save cost, as it goes (the record's figures, :class:`~.records.SaveRecord`). A value:
    each step replaces it."""

    stall_s: float = 0.0  # how long training was held: the save call (plus the wait before the step)
    lazy_nbytes: int = 0  # bytes its lazy snapshot copied after the save call returned
    handed_at: float = 0.0  # monotonic, at the hand-over
    write_s: float = 0.0  # the worker's own write time, as it reported
    file_nbytes: int = 0  # the file's size, as the worker reported it


class Save:
    """One save: the request, then what the scheduler, the worker and the commit make of it. Compared by
    identity. Every change goes through a method here, named after the step that makes it."""

    def __init__(self, checkpoint: dict[str, object], path: Path | str, layout: Layout, collective: bool,
                 seq: int | None, called_at: float, **request: object) -> None:
        """Args:
            checkpoint, path, layout, collective, seq, called_at, **request: the fields of :class:`SaveRequest`.
        """
        self.request = SaveRequest(checkpoint, path, layout, collective, seq, called_at, **request)
        self.state = SaveState.REQUESTED
        self.order = 0  # this rank's FIFO position
        self.tmp: Path | str | None = None  # where the worker writes; a remote file: the URL itself (visible only complete)
        self.rank = 0  # the rank whose part this is (0 for a single writer)
        self.staged = Staged()
        self.costs = Costs()
        # the write (handed to the worker)
        self.ticket: Ticket | None = None
        self.plan: WritePlan | None = None
        self.result_path: Path | None = None
        self.gate: Gate | None = None  # a lazy single writer's write waits there for its copy
        self.written: list | None = None  # a collective save's local write results, once this rank's part is on disk

    # -- the request, read through ---------------------------------------------------------------------
    @property
    def checkpoint(self) -> dict[str, object]:
        return self.request.checkpoint

    @property
    def path(self) -> Path | str:
        return self.request.path

    @property
    def destination(self) -> Destination:
        """Where it goes: temp paths, publish, discard (the checked one, once validated)."""
        checked = self.request.destination
        return checked if checked is not None else destination.of(self.path)

    @property
    def layout(self) -> Layout:
        return self.request.layout

    @property
    def collective(self) -> bool:
        return self.request.collective

    @property
    def seq(self) -> int | None:
        return self.request.seq

    @property
    def called_at(self) -> float:
        return self.request.called_at

    @property
    def writes_file(self) -> bool:
        return self.request.writes_file

    @property
    def step(self) -> int | None:
        return self.request.step

    @property
    def extra_files(self) -> list[ExtraFile]:
        return self.request.extra_files

    @property
    def faults(self) -> SaveFaults:
        return self.request.faults

    @property
    def call(self) -> int:
        return self.request.call

    @property
    def write_hook(self) -> Callable[[list], None] | None:
        return self.request.write_hook

    @property
    def copy_hook(self) -> Callable[[], None] | None:
        return self.request.copy_hook

    # -- the steps, in the order a save takes them ----------------------------------------------------
    def validated(self, checked: Destination) -> None:
        """(scheduler) The checked destination replaces the path the caller gave."""
        self.request = replace(self.request, path=checked.location, destination=checked)

    def placed(self, order: int, tmp: Path | str, rank: int) -> None:
        """(scheduler) Its position in this rank's queue, the hidden path it is written to, and whose part it is."""
        self.order, self.tmp, self.rank = order, tmp, rank

    def prepared(self, checkpoint: dict[str, object], shape: file_layout.FileLayout) -> None:
        """(scheduler) A ``torch.save`` file's dict, as stock's file has it, and its aliases and devices."""
        self.request = replace(self.request, checkpoint=checkpoint)
        self.staged = replace(self.staged, shape=shape)

    def snapshotted(self, snapshot: staging.Snapshot) -> None:
        self.staged = replace(self.staged, snapshot=snapshot)

    def serialized(self, skeleton: bytes) -> None:
        self.staged = replace(self.staged, skeleton=skeleton)

    def planned_now(self, planned: DcpPlan) -> None:
        """(scheduler) Planned at save time, while every rank is here (a lazy DCP save)."""
        self.staged = replace(self.staged, planned=planned)

    def following(self, order: int) -> None:
        """(scheduler) Its lazy copy waits for the write of ``order``, whose buffers it reuses."""
        self.staged = replace(self.staged, follows=order)

    def handed_over(self, ticket: Ticket, plan: WritePlan | None, result_path: Path, gate: Gate | None,
                    stall_s: float) -> None:
        """(scheduler) The worker has its write: ``WRITING``."""
        self.ticket, self.plan, self.result_path, self.gate = ticket, plan, result_path, gate
        self.costs = replace(self.costs, stall_s=stall_s)
        self.to(S.WRITING)

    def copy_started(self, copy: lazy.BackgroundCopy, stall_s: float) -> None:
        """(scheduler) A lazy snapshot's background copy runs; the save call returns now."""
        self.staged = replace(self.staged, copy=copy)
        self.costs = replace(self.costs, stall_s=stall_s, lazy_nbytes=copy.nbytes)

    def stalled(self, seconds: float) -> None:
        """(settle_copy) The wait for its lazy copy held training this much longer."""
        self.costs = replace(self.costs, stall_s=self.costs.stall_s + seconds)

    def ungated(self) -> None:
        """(settle_copy) Its worker died with it queued behind its gate: the gate goes, it is handed over anew."""
        if self.gate is not None:
            self.gate.remove()
        self.gate = None

    def reported(self, write_s: float, file_nbytes: int) -> None:
        """(poller) The worker's own figures for the write."""
        self.costs = replace(self.costs, write_s=write_s, file_nbytes=file_nbytes)

    def wrote(self, results: list) -> None:
        """(poller) This rank's part of a collective save is on disk: ``WRITTEN``."""
        self.written = results
        self.to(S.WRITTEN)

    def to(self, state: SaveState) -> None:
        """Moves the save to ``state``; a move that does not follow from the current state raises.

        Raises:
            TransitionError: ``state`` does not follow the current one (a bug in the pipeline).
        """
        if state not in TRANSITIONS[self.state]:
            raise TransitionError(f"save {self.order} to {self.path}: {self.state.value} -> {state.value} is not a transition")
        self.state = state
        if state is S.WRITING:
            self.costs = replace(self.costs, handed_at=time.monotonic())

    # -- read ------------------------------------------------------------------------------------------
    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def snapshot(self) -> staging.Snapshot | None:
        return self.staged.snapshot

    @property
    def copy(self) -> lazy.BackgroundCopy | None:
        return self.staged.copy

    @property
    def buffer_set(self) -> Lease | None:
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
        return self.destination.is_remote
