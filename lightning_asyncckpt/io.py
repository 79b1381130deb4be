"""``AsyncCheckpointIO``: a Lightning ``CheckpointIO`` that writes DCP checkpoints in the background.

One save, step by step:
1. ``save_checkpoint`` (the ranks Lightning calls it on: global rank 0 for single-device and DDP)
   snapshots the state into reused host buffers, plans a DCP save, hands the write to the engine's
   worker and returns.
2. ``finalize`` (all ranks; ``AsyncFinalizerCallback`` calls it after every training batch): each
   rank polls its own writes and commits the finished ones (write complete -> ``.metadata`` ->
   atomic rename), then the ranks agree on how far every save got and on any failure, so that a
   failure is raised on every rank, once.
3. ``teardown`` settles everything, then stops the workers.

On the way out after an exception (Ctrl-C and Lightning's SIGTERM handling included), or at interpreter
exit without ``teardown``, each rank first waits (``drain_timeout_s``) for its writes in flight, so that a
checkpoint scheduled before a crash or a preemption still lands: single-writer saves commit locally,
sharded ones over a gloo group whose collectives give up if a rank never comes.
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing.util
import os
import pickle
import shutil
import sys
import tempfile
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from torch.distributed.checkpoint.api import CheckpointException
from typing_extensions import override

from lightning_asyncckpt import _worker, commit, dcp_format, engines, staging, testing
from lightning_asyncckpt.agreement import Agreement
from lightning_asyncckpt.engines import Status
from lightning_asyncckpt.errors import CheckpointWriteError, RankFailure
from lightning_asyncckpt.staging import Stager

log = logging.getLogger(__name__)

# On the way out of an exception, how long a rank waits for the others to arrive for committing the
# saves written by all ranks together (a rank that never comes, e.g. one blocked in a training
# collective, costs this much before the others give up).
EXIT_MEET_S = 60.0


def _configure_logging() -> None:
    """INFO lines (one per committed checkpoint) show up the way Lightning's own do: Lightning gives its
    logger a console handler at INFO when the application has not configured logging; so do we."""
    pkg = logging.getLogger("lightning_asyncckpt")
    if pkg.level == logging.NOTSET:
        pkg.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers() and not pkg.handlers:
        pkg.addHandler(logging.StreamHandler())
        pkg.propagate = False


_configure_logging()


_REPLICATED = "replicated"  # a checkpoint dict (skeleton + tensors); one writer, or a share per rank
_SHARDED = "sharded"  # each rank's own shards, in Lightning's ModelParallelStrategy layout
META_FILE = dcp_format.META_FILE


METRICS_PREFIX = "asyncckpt/"


@dataclass(frozen=True)
class SaveRecord:
    """What one committed save cost, as this rank saw it (``AsyncCheckpointIO.history``, and what
    ``finalize`` returns).

    Attributes:
        path: the committed checkpoint.
        step: the checkpoint's ``global_step``, when it has one.
        stall_s: how long ``save_checkpoint`` held training on this rank (waiting for room included).
        write_s: from scheduling the write to the commit: how long the checkpoint took to become durable.
        nbytes: bytes written into shard files, by all ranks together.
        local_nbytes: bytes of tensors this rank staged and wrote.
        pending: saves still pending on this rank right after this one committed.
        worker_s: the background worker's own time for this rank's part (write and fsync).
    """

    path: str
    step: int | None
    stall_s: float
    write_s: float
    nbytes: int
    local_nbytes: int
    pending: int
    worker_s: float

    @property
    def gbps(self) -> float:
        """Write throughput in GB/s (1e9 bytes): all ranks' bytes over the time to the commit."""
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
        rate = f"{self.gbps:.2f} GB/s" if self.gbps >= 0.01 else f"{_human_bytes(self.gbps * 1e9)}/s"
        return (
            f"committed {os.path.basename(self.path)}: {_human_bytes(self.nbytes)} in {_seconds(self.write_s)}"
            f" ({rate}); training stalled {_seconds(self.stall_s)}"
        )


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s >= 10 else f"{s:.2f} s"


def _human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _global_step(state: Any) -> int | None:
    """The step a checkpoint was taken at: Lightning's ``global_step``, or a Fabric loop's ``step``."""
    if not isinstance(state, dict):
        return None
    step = state.get("global_step", state.get("step"))
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    return int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def _written_bytes(all_results: list) -> int:
    """Bytes in shard files, from every rank's DCP write results."""
    total = 0
    for rank_results in all_results:
        for r in rank_results or ():
            info = getattr(r, "storage_data", None)
            total += int(getattr(info, "length", 0) or 0)
    return total


@dataclass(eq=False)  # compared by identity
class _PendingSave:
    order: int  # local FIFO position
    seq: int | None  # the save's number in the cross-rank count, None if no rank announced it
    path: Path
    tmp: Path
    ticket: engines.Ticket
    plan: dcp_format.WritePlan
    result_path: Path
    buffer_set: Any
    stall_s: float
    nbytes: int
    step: int | None = None  # the checkpoint's global_step, for the record
    collective: bool = False  # every rank writes a part; committed by all ranks together
    coordinator_fault: str | None = None  # an injected commit failure (lightning_asyncckpt.testing)
    write_s: float = 0.0
    written: list | None = None  # a collective save's local write results, once this rank's part is on disk
    started: float = field(default_factory=time.monotonic)


@dataclass
class _Failed:
    order: int
    path: str
    failure: RankFailure
    seq: int | None = None


def _filesystem_failures(e: BaseException, rank: int) -> list[RankFailure] | None:
    """A save-time error that is a write failure (the filesystem refused), as rank failures; ``None`` for
    bad input, which is raised as it is."""
    if isinstance(e, CheckpointException):  # DCP's planning: the original error of each failing rank
        return [RankFailure.from_exception(r, exc) for r, (exc, _tb) in sorted(e.failures.items())]
    if isinstance(e, OSError) and not isinstance(e, (FileExistsError, IsADirectoryError, NotADirectoryError)):
        return [RankFailure.from_exception(rank, e)]
    return None


def _local_path(path: Any) -> Path:
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = text.decode()
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        raise ValueError(
            f"`AsyncCheckpointIO` writes to local or mounted filesystems only; got {text!r}."
            " Mount the remote storage (e.g. with a FUSE client) or use Lightning's `TorchCheckpointIO`."
        )
    return Path(text)


class AsyncCheckpointIO(CheckpointIO):
    """Writes checkpoints asynchronously as torch.distributed.checkpoint directories.

    Args:
        strategy: the async engine: ``"nvrx"`` (nvidia-resiliency-ext), ``"mcore"`` (Megatron-Core), or
            ``"auto"`` (nvrx when installed, else mcore with a warning). Read back with :attr:`engine`.
        worker: ``"persistent"`` (one long-lived worker process per rank, started once) or ``"fork"``
            (a process forked per save, whose copy-on-write memory is the snapshot).
        thread_count: shard files (and writer threads) per rank and save.
        timeout_s: a background write that takes longer fails the save (its worker is killed), so that
            a hung write is raised within a bounded time. A dead worker is detected at once.
        max_pending: saves in flight per rank; a further save first waits for the oldest write. Each
            in-flight save holds one copy of the state in host memory.
        poll_interval_s: sleep between checks while a blocking finalize waits.
        drain_timeout_s: on the way out after an exception (including Ctrl-C and Lightning's SIGTERM
            handling) or at interpreter exit without ``teardown``, how long this rank waits for the
            saves in flight that it commits alone (single-device and DDP saves, written by global rank 0)
            before stopping the workers. A save that finishes in time is committed, as a synchronous
            save made before the crash would be; one that fails is logged, never raised over the
            exception. Saves written by all ranks together (sharded) are committed by the ranks together
            over a gloo group made before the first such save, if every rank gets there within
            ``min(drain_timeout_s, 60)`` seconds; otherwise they are dropped. ``0`` drops every unfinished
            save at once.

    Call pattern (all ranks unless noted): ``save_checkpoint`` on the ranks Lightning calls it on;
    ``finalize`` on every rank, in the same order; ``teardown`` on every rank at the end.
    ``history`` lists a :class:`SaveRecord` for each save this rank committed.

    Construct it on every rank (before ``Trainer``/``Fabric`` launches, or in each process); it starts
    nothing until its first save, ``warmup``, or the callback's ``setup``.
    """

    def __init__(
        self,
        strategy: str = "auto",
        *,
        worker: str = "persistent",
        thread_count: int = 1,
        timeout_s: float = 1800.0,
        max_pending: int = 2,
        poll_interval_s: float = 0.02,
        drain_timeout_s: float = 300.0,
    ) -> None:
        super().__init__()
        if thread_count < 1:
            raise ValueError(f"`AsyncCheckpointIO(thread_count={thread_count})` must be at least 1.")
        if max_pending < 1:
            raise ValueError(f"`AsyncCheckpointIO(max_pending={max_pending})` must be at least 1.")
        if timeout_s <= 0:
            raise ValueError(f"`AsyncCheckpointIO(timeout_s={timeout_s})` must be positive.")
        if drain_timeout_s < 0:
            raise ValueError(f"`AsyncCheckpointIO(drain_timeout_s={drain_timeout_s})` must not be negative.")
        self._engine_name = engines.resolve(strategy)
        self._worker_mode = engines.parse_worker(worker)
        self.thread_count = thread_count
        self.timeout_s = float(timeout_s)
        self.max_pending = max_pending
        self.poll_interval_s = poll_interval_s
        self.drain_timeout_s = float(drain_timeout_s)
        self.history: list[SaveRecord] = []  # every committed save, oldest first
        self._returned = 0  # history[:_returned] was returned by finalize()
        self.write_hook: Callable[[list], None] | None = None  # picklable; runs in the worker
        self._agreement = Agreement()
        self._engine: engines.Engine | None = None
        self._stager = Stager(
            shared=self._worker_mode is engines.WorkerMode.PERSISTENT,
            copy_cpu=self._worker_mode is engines.WorkerMode.PERSISTENT,
        )
        self._pending: deque[_PendingSave] = deque()
        self._failures: list[_Failed] = []
        self._removals: list[tuple[Path, int]] = []
        self._order = 0
        self._last_ok_order = 0
        self._announced = 0
        self._consumed = 0
        self._reported = 0
        self._finalizer_attached = False
        self._cleaned_dirs: set[Path] = set()
        self._doomed_tmps: list[Path] = []  # partial directories of failed collective saves (coordinator)
        self._results_dir: Path | None = None
        self._torn_down = False
        self._new_run()
        self._save_calls = 0  # this rank's saves, counted from 1: what injected faults target
        self._save_started: float | None = None
        self._exit_hook: multiprocessing.util.Finalize | None = None
        self._exit_agreement: Agreement | None = None  # made before the first collective save

    # ---------------------------------------------------------------------------------------------
    # Public properties
    @property
    def engine(self) -> str:
        """The resolved engine name: ``"nvrx"`` or ``"mcore"`` (decided in ``__init__``, on every rank)."""
        return self._engine_name.value

    @property
    def worker(self) -> str:
        """The worker mode: ``"persistent"`` or ``"fork"``."""
        return self._worker_mode.value

    @property
    def num_pending(self) -> int:
        """(any rank, any time) Saves of this rank not yet committed or failed."""
        return len(self._pending)

    def worker_pids(self) -> list[int]:
        """(any rank, any time) PIDs of this rank's live background writers (the persistent worker, or
        forked ones)."""
        pids = self._engine.worker_pids() if self._engine is not None else []
        for save in self._pending:
            proc = save.ticket.process
            if proc is not None and proc.is_alive():
                pids.append(proc.pid)
        return pids

    # ---------------------------------------------------------------------------------------------
    # Lightning's CheckpointIO
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """(the ranks Lightning calls it on) Snapshots ``checkpoint`` and schedules its write to ``path``.

        Returns once the snapshot is taken: training may change every tensor right after.
        Errors of the write are raised later, by :meth:`finalize`.
        """
        self._save(checkpoint, path, storage_options, collective=False, mode=_REPLICATED)

    def save_checkpoint_distributed(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """(all ranks, same order) Saves a checkpoint whose state is replicated on every rank; each rank
        snapshots and writes a disjoint share of the tensors, so every byte is written once and the write
        is spread across ranks. The result is one checkpoint that loads on any number of ranks.
        Used by :class:`~lightning_asyncckpt.AsyncDDPStrategy`."""
        self._save(checkpoint, path, storage_options, collective=self._agreement.active, mode=_REPLICATED)

    def save_checkpoint_sharded(self, state: dict[str, Any], path: Any, meta: dict[str, Any] | None = None) -> None:
        """(all ranks, same order) Saves a sharded state the way Lightning's ``ModelParallelStrategy`` lays
        it out: each rank writes its own shards of ``state`` (``DTensor`` local shards, and its share of
        the replicated tensors), and global rank 0 writes ``meta`` to ``meta.pt`` beside them. Nothing is
        gathered on one rank. Stock Lightning and plain ``torch.distributed.checkpoint`` read the result.
        Used by :class:`~lightning_asyncckpt.AsyncModelParallelStrategy`."""
        extra: list[tuple[str, bytes]] = []
        if meta is not None and self._agreement.rank == 0:
            buf = io.BytesIO()
            torch.save(meta, buf)  # serialized now: a snapshot of the non-tensor state
            extra.append((META_FILE, buf.getvalue()))
        self._save(state, path, None, collective=self._agreement.active, mode=_SHARDED, extra_files=extra,
                   step=_global_step(meta))

    def _save(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any, collective: bool, mode: str,
        extra_files: list[tuple[str, bytes]] | None = None, step: int | None = None,
    ) -> None:
        self._save_calls += 1
        self._save_started = time.perf_counter()  # the stall counts from here: waiting for room and the snapshot
        try:
            snapshot, local_error = None, None
            try:
                path = self._check_save_args(path, storage_options)
                self._start(path.parent)
                self._settle_local(blocking=False)
                if not self._agreement.active:
                    self._raise_local_failures()
                self._wait_for_room()
                if collective:
                    snapshot = self._take_snapshot(checkpoint, mode, collective)
            except Exception as e:
                if not collective:
                    raise
                local_error = e
            if collective and self._agreement.all_max([int(local_error is not None)])[0]:
                # A rank that failed before the collective planning must not leave the others in it. The
                # failing rank records its error (raised on every rank at the next finalize); the others
                # drop this save.
                self._stager.release(snapshot.buffer_set if snapshot is not None else None)
                if self._announced > self._consumed:
                    self._consumed = self._announced
                if local_error is not None:
                    raise local_error
                return
            self._schedule(checkpoint, path, collective, mode, snapshot, extra_files or [],
                           step if step is not None else _global_step(checkpoint))
        except (Exception, CheckpointException) as e:
            if isinstance(e, CheckpointWriteError):
                raise
            rank = self._agreement.rank
            failures = _filesystem_failures(e, rank)
            if not self._agreement.active:
                if failures is None:
                    raise  # bad input: the caller's own error type (TypeError, pickling error, ...)
                raise CheckpointWriteError(str(path), failures) from (None if isinstance(e, CheckpointException) else e)
            # Raising here, on one rank alone, would leave the other ranks waiting in Lightning's barrier:
            # the failure is raised on every rank by the next finalize instead. (A failure in DCP's collective
            # planning reaches every rank; each records its own.)
            for failure in failures if failures is not None else [RankFailure.from_exception(rank, e)]:
                if failure.rank == rank:
                    self._failures.append(_Failed(self._order, str(path), failure))
            log.error("lightning-asyncckpt: save to %s failed at save time: %s", path, e)
            if not self._torn_down:
                return
        if self._torn_down:
            # After teardown nobody will finalize (e.g. `trainer.save_checkpoint` after `fit`): complete
            # the save before returning, and stop the worker again, rather than lose it at exit. Every rank
            # is here for a collective save: the ranks commit it together, or all raise its error (also
            # one recorded above on some ranks only, which must not leave the others in the finalize).
            try:
                if collective:
                    self._finalize(blocking=True, force=True)
                else:
                    self._settle_local(blocking=True)
                    self._raise_local_failures()
            finally:
                self._close(abort=False)

    @staticmethod
    def _check_save_args(path: Any, storage_options: Any) -> Path:
        """Bad input is an error in the trainer, at save time, never a background crash."""
        if storage_options:
            raise TypeError(
                f"`storage_options` is not supported by `AsyncCheckpointIO.save_checkpoint`; got {storage_options!r}."
            )
        path = _local_path(path)
        if path.is_file() and not path.is_symlink():
            raise FileExistsError(
                f"`AsyncCheckpointIO` saves checkpoints as directories, but {str(path)!r} is an existing regular"
                " file (perhaps from `TorchCheckpointIO`). Remove it or save to another path."
            )
        return path

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """(any rank) Waits for this rank's pending saves, then reads the checkpoint at ``path``.

        A regular file (a ``torch.save`` checkpoint) is read with Lightning's ``TorchCheckpointIO``.
        """
        path = _local_path(path)
        self._settle_local(blocking=True)
        for f in self._failures:
            if Path(f.path) == path:
                raise CheckpointWriteError(f.path, [f.failure])
        if path.is_file():
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if not path.exists():
            raise FileNotFoundError(f"Checkpoint at {str(path)!r} not found.")
        if not commit.is_committed(path):
            raise FileNotFoundError(f"{str(path)!r} is not a complete checkpoint (no {commit.METADATA_FILE}).")
        return dcp_format.load(path, map_location=map_location, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """(the ranks Lightning calls it on) Removes ``path`` once every save scheduled so far has committed.

        A checkpoint still being written is never deleted, and the newest committed checkpoint is kept
        until a newer one commits.
        """
        self._removals.append((_local_path(path), self._order))
        self._run_removals()

    @override
    def teardown(self) -> None:
        """(all ranks) Blocking finalize, then stops the workers.

        Inside an exception handler (Lightning tears down on errors) it raises nothing, so that the
        original exception is not masked: it waits up to ``drain_timeout_s`` for the saves in flight
        (collective ones only over the exit group, whose collectives give up if a rank never comes),
        commits those that finish, then stops the workers and removes unfinished saves.
        """
        self._teardown(aborting=sys.exc_info()[1] is not None)

    def _teardown(self, aborting: bool) -> None:
        try:
            if aborting:
                self._drain(self.drain_timeout_s)
            else:
                self._finalize(blocking=True, force=True)
        finally:
            self._close(abort=aborting)

    # ---------------------------------------------------------------------------------------------
    # Finalization
    def finalize(self, blocking: bool = False) -> list[SaveRecord]:
        """(all ranks, same order) Commits the saves whose writes finished; ``blocking`` waits for all.

        1. (each rank) poll own writes; commit finished single-writer saves; 2. (all ranks) agree on
        progress and failures; 3. (all ranks) raise :class:`CheckpointWriteError` for a failed save.

        Returns a :class:`SaveRecord` for every save this rank committed since the previous call
        (saves can also commit inside ``save_checkpoint``), e.g. for ``fabric.log_dict(r.metrics())``.
        """
        self._finalize(blocking, force=True)
        out = self.history[self._returned:]
        self._returned = len(self.history)
        return out

    def _finalize(self, blocking: bool, force: bool, deadline: float | None = None) -> list[str]:
        """With several ranks, one agreement round per poll. ``force`` agrees even when no rank announced a
        save (explicit calls, teardown, Fabric); the callback's per-batch call agrees only while an
        announced save is unsettled, so that a run without pending saves pays no collective."""
        committed_before = len(self.history)
        if not self._agreement.active:
            self._settle_local(blocking=blocking)
            self._raise_local_failures()
            return [r.path for r in self.history[committed_before:]]
        if not (force or self._announced > self._reported):
            return []
        while True:
            self._settle_local(blocking=False)
            # a save is "ready" on this rank when committed here, or, if collective, when its part is written
            ready_through = min(
                (p.seq for p in self._pending if p.seq is not None and p.written is None), default=self._announced + 1
            ) - 1
            # saves before the first failed one still commit: a failing rank has no entry for the failed save
            first_failed = min(
                (f.seq if f.seq is not None else 0 for f in self._failures), default=self._announced + 1
            )
            progress = [-ready_through, 1 if self._failures else 0, 1 if self._pending else 0, -first_failed]
            if deadline is not None:  # the way out: stop waiting once any rank's time is up (agreed)
                progress.append(int(time.monotonic() > deadline))
            neg_ready, any_failed, any_pending, neg_first_failed, *out_of_time = self._agreement.all_max(progress)
            while (
                self._pending
                and self._pending[0].written is not None
                and self._pending[0].seq <= -neg_ready
                and self._pending[0].seq < -neg_first_failed
            ):
                self._commit_collective(self._pending[0])  # same saves, same order, on every rank
            if any(out_of_time):
                break
            if any_failed:
                if -neg_ready + 1 >= -neg_first_failed:
                    self._raise_agreed_failures()
                # A save before the failed one is still being written on some rank: it commits first (a
                # good checkpoint is never dropped for a later failure). Every rank takes this branch.
                time.sleep(self.poll_interval_s)
                continue
            self._reported = max(self._reported, -neg_ready)
            if not blocking or (not any_pending and self._reported >= self._announced):
                break
            time.sleep(self.poll_interval_s)
        return [r.path for r in self.history[committed_before:]]

    def __enter__(self) -> AsyncCheckpointIO:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """``with AsyncCheckpointIO(...) as io:`` (all ranks): on a normal exit every save is committed
        (errors raised on every rank) and the workers stop; on an exception the saves in flight still
        land where they can (``drain_timeout_s``) and the workers stop, without masking the exception. For loops that never call ``teardown``, such as Fabric's."""
        self._teardown(aborting=exc is not None)

    def warmup(self, like: dict[str, Any] | None = None) -> None:
        """(writing ranks) Starts the background worker now, so that the first save does not pay for it.

        ``like``: a checkpoint like the ones that will be saved (e.g. ``{"state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()]}``); its staging buffers are allocated now as well.
        """
        self._torn_down = False
        self._new_run()
        self._start(None)
        assert self._engine is not None
        self._engine.start()
        if like is not None:
            self._prepare(like, collective=False)

    def _prepare(self, like: dict[str, Any], collective: bool) -> None:
        """Allocates the staging buffers for saves of checkpoints like ``like`` (this rank's share, if
        ``collective``). Local; called before the first save."""
        if any(bs.buffers for bs in self._stager._sets):
            return
        rank, world = (self._agreement.rank, self._agreement.world_size) if collective else (0, 1)
        nbytes = self._stager.prepare(like, rank=rank, world_size=world)
        log.debug("lightning-asyncckpt: prepared %d bytes of staging buffers", nbytes)

    # Called by AsyncFinalizerCallback on every rank.
    def _attach_finalizer(self) -> None:
        self._finalizer_attached = True
        self._torn_down = False
        self._new_run()

    def _new_run(self) -> None:
        """A new run's name for temporary directories (agreed across ranks at its first collective save)."""
        self._run_token = f"{os.getpid()}{uuid.uuid4().hex[:6]}"
        self._run_token_agreed = False
        self._collective_count = 0

    def _announce_save(self) -> None:
        self._announced += 1

    def _abort(self) -> None:
        """Lets the saves in flight land (``drain_timeout_s``), then stops workers and drops unfinished
        saves; never raises."""
        with contextlib.suppress(Exception):
            self._drain(self.drain_timeout_s)
        with contextlib.suppress(Exception):
            self._close(abort=True)

    def _drain(self, timeout_s: float) -> None:
        """(never raises) On the way out of an exception or at interpreter exit: waits up to ``timeout_s``
        for the saves in flight, commits those that finish (with the top-k removals that waited for
        them) and logs those that fail (``_record_failure``).

        - Saves this rank commits alone (single-writer, up to the first collective one): polled here,
          with no collectives.
        - Collective saves: the blocking finalize over the exit group, with the deadline agreed; its
          collectives fail, rather than wait forever, when a rank never comes.
        """
        if self._engine is None or not self._pending:
            return
        together = timeout_s > 0 and any(p.collective for p in self._pending) and self._exit_group_usable()
        if not together:
            with contextlib.suppress(Exception):
                self._settle_local(blocking=False)  # commits what has already finished, even with no time to wait
            if not self._solo_waiting() or timeout_s <= 0:
                self._failures.clear()
                return
        count = len(self._pending) if together else len(self._solo_waiting())
        log.warning(
            "lightning-asyncckpt: waiting up to %gs for %d checkpoint write(s) in flight%s before stopping",
            timeout_s, count, " (with every rank)" if together else "",
        )
        committed = len(self.history)
        deadline = time.monotonic() + timeout_s
        agreement = self._agreement
        try:
            if together:
                self._agreement = self._exit_agreement
                self._finalize(blocking=True, force=True, deadline=deadline)
            else:
                while self._solo_waiting() and time.monotonic() < deadline:
                    self._settle_local(blocking=False)
                    if self._solo_waiting():
                        time.sleep(self.poll_interval_s)
        except CheckpointWriteError as e:
            log.error("lightning-asyncckpt: %s", e)
        except KeyboardInterrupt:
            log.warning("lightning-asyncckpt: interrupted while waiting for checkpoint writes; dropping them")
        except Exception as e:  # noqa: BLE001 - on the way out: report, never mask the original error
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            if together:  # e.g. a rank that never came
                log.warning("lightning-asyncckpt: not every rank could commit the saves in flight (%s);"
                            " dropping them", reason)
            else:
                log.error("lightning-asyncckpt: error while waiting for checkpoint writes: %s", reason)
        finally:
            self._agreement = agreement
        self._failures.clear()  # each was logged when recorded; the caller is already handling an exception
        log.warning(
            "lightning-asyncckpt: %d of %d checkpoint write(s) in flight committed before stopping",
            len(self.history) - committed, count,
        )

    def _write_now(self) -> None:
        """(this rank, no collectives) Waits for this rank's writes in flight: single-writer saves commit,
        with the removals that waited for them; this rank's part of a collective save is written (the
        ranks commit it at the next finalize, or on the way out). A failure is recorded and raised on
        every rank by the next finalize. For a save that must be on disk when it returns, such as the one
        Lightning's SLURM auto-requeue makes right before it requeues the job."""
        if self._engine is None or not any(p.written is None for p in self._pending):
            return
        log.info("lightning-asyncckpt: waiting for %d checkpoint write(s) before going on",
                 sum(p.written is None for p in self._pending))
        self._settle_local(blocking=True)

    def _make_exit_group(self) -> None:
        """(all ranks, together, once) The group that the ranks commit collective saves over on the way out
        of an exception, whose collectives give up if a rank never comes (``drain_timeout_s``, at most
        ``EXIT_MEET_S``). Made before the first collective save: at the callback's ``setup`` for the
        Trainer, inside that save for Fabric."""
        if self._exit_group_usable() or not self._agreement.active or self.drain_timeout_s <= 0:
            return  # (a process group destroyed since, e.g. by an earlier Trainer, gets a new one)
        self._exit_agreement = self._agreement.exit_side(min(self.drain_timeout_s, EXIT_MEET_S))

    def _solo_waiting(self) -> list[_PendingSave]:
        """The saves in flight this rank commits alone, in order: those before the first collective one."""
        out = []
        for save in self._pending:
            if save.collective:
                break
            out.append(save)
        return out

    def _exit_group_usable(self) -> bool:
        """The exit group exists and the process group was not destroyed (e.g. by the script's end)."""
        try:
            return self._exit_agreement is not None and self._exit_agreement.active
        except Exception:  # noqa: BLE001 - a destroyed group
            return False

    @staticmethod
    def _drain_at_exit(ref: weakref.ref) -> None:
        """Interpreter exit without ``teardown`` (e.g. a Fabric script that ends, or dies of an uncaught
        exception): the last saves still land. Runs before ``multiprocessing`` stops daemon workers."""
        io_ = ref()
        if io_ is not None and not io_._torn_down:
            io_._abort()

    # ---------------------------------------------------------------------------------------------
    # Internals
    def _start(self, dirpath: Path | None) -> None:
        if self._engine is None:
            self._engine = engines.create(self._engine_name, self._worker_mode, self._agreement.rank)
        if self._exit_hook is None:
            # multiprocessing's exit handler (also run by multiprocessing children, e.g. ddp_spawn ranks)
            # runs finalizers of priority >= 0 before it terminates daemon processes such as our workers
            self._exit_hook = multiprocessing.util.Finalize(
                None, AsyncCheckpointIO._drain_at_exit, args=(weakref.ref(self),), exitpriority=100
            )
        if self._results_dir is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._results_dir = Path(tempfile.mkdtemp(prefix="asyncckpt-", dir=base))
        if dirpath is not None and dirpath not in self._cleaned_dirs:
            dirpath.mkdir(parents=True, exist_ok=True)
            if self._agreement.rank == 0:
                commit.cleanup_leftovers(dirpath, keep_prefix=commit.tmp_for(dirpath, self._run_token).name)
            self._cleaned_dirs.add(dirpath)

    def _take_snapshot(self, checkpoint: dict[str, Any], mode: str, collective: bool) -> staging.Snapshot:
        if mode == _SHARDED:
            return self._stager.snapshot_tree(checkpoint)
        if collective:  # replicated state: this rank copies and writes its share only
            return self._stager.snapshot(checkpoint, rank=self._agreement.rank, world_size=self._agreement.world_size)
        return self._stager.snapshot(checkpoint)

    def _schedule(
        self, checkpoint: dict[str, Any], path: Path, collective: bool, mode: str,
        snapshot: staging.Snapshot | None, extra_files: list[tuple[str, bytes]], step: int | None = None,
    ) -> None:
        """Plans and hands over one save. A collective save arrives with its snapshot taken and agreed."""
        assert self._engine is not None and self._results_dir is not None
        t0 = self._save_started or time.perf_counter()
        self._order += 1
        order = self._order
        seq = None
        if self._announced > self._consumed:
            self._consumed = self._announced
            seq = self._announced
        if collective:
            if seq is None:  # no callback announced it (Fabric): every rank is here, so it announces itself
                self._announced += 1
                self._consumed = seq = self._announced
            if not self._run_token_agreed:  # every rank writes into the same temporary directory
                self._run_token = self._agreement.all_gather(self._run_token)[0]
                self._run_token_agreed = True
                self._make_exit_group()  # every rank is here (Fabric; the Trainer made it at setup)
            self._collective_count += 1
            tmp = commit.tmp_for(path, f"{self._run_token}-c{self._collective_count}")
        else:
            tmp = commit.tmp_for(path, f"{self._run_token}-{order}")
        rank = self._agreement.rank if collective else 0
        try:
            if snapshot is None:
                snapshot = self._take_snapshot(checkpoint, mode, collective)
            if mode == _SHARDED:
                state: dict[str, Any] = snapshot.skeleton  # the copied tree, flattened by DCP as stock does
            else:
                state = dict(snapshot.tensors)
                if rank == 0:
                    state[staging.SKELETON_KEY] = snapshot.skeleton
            plan = dcp_format.plan_save(
                state, tmp, self._engine.writer_cls, self.thread_count, self._engine.split_by_size, collective,
                flatten=mode == _SHARDED,
            )
            result_path = self._results_dir / f"{order}.result"
            extra = [(str(tmp / name), data) for name, data in extra_files]
            if rank == 0:  # who wrote it, written by the worker before the commit (off the training thread)
                extra.append((str(tmp / commit.INFO_FILE), commit.info_bytes(self._writer_info(mode, collective, step))))
            fault_hook, coordinator_fault = testing.faults_for(
                self._agreement.rank, self._save_calls, self.engine, self.worker
            )
            hooks = tuple(h for h in (self.write_hook, fault_hook) if h is not None)
            hook = hooks[0] if len(hooks) == 1 else (testing.Hooks(hooks) if hooks else None)
            ticket = self._engine.schedule(
                _worker.write_job,
                (self._engine.writer_cls, plan.transforms, plan.buckets, str(result_path), hook, extra),
            )
        except BaseException:
            # bad input (e.g. an object that cannot be pickled): raised here, in the trainer
            if not collective:
                commit.remove_path(tmp)
            self._stager.release(snapshot.buffer_set if snapshot is not None else None)
            raise
        stall = time.perf_counter() - t0
        self._save_started = None
        self._pending.append(
            _PendingSave(
                order=order, seq=seq, path=path, tmp=tmp, ticket=ticket, plan=plan, result_path=result_path,
                buffer_set=snapshot.buffer_set, stall_s=stall, nbytes=snapshot.nbytes, step=step, collective=collective,
                coordinator_fault=coordinator_fault,
            )
        )
        log.debug("lightning-asyncckpt: scheduled %s (%d bytes), stall %.4fs", path, snapshot.nbytes, stall)

    def _writer_info(self, mode: str, collective: bool, step: int | None) -> dict[str, Any]:
        from lightning_asyncckpt import __version__

        world = self._agreement.world_size
        return {
            "writer": f"lightning-asyncckpt {__version__}",
            "engine": self.engine,
            "engine_version": getattr(self._engine, "version", None),
            "worker": self.worker,
            "layout": "sharded" if mode == _SHARDED else ("distributed" if collective else "single-writer"),
            "world_size": world,
            "writing_ranks": world if collective else 1,
            "global_step": step,
            "torch": torch.__version__,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def _settle_local(self, blocking: bool, until: int | None = None) -> None:
        """(this rank) Polls own writes in order; commits finished single-writer saves, marks finished
        parts of collective saves as written (they commit in ``_finalize``), records failures."""
        while True:
            # the oldest write not yet done here (a collective save whose part is written waits for finalize)
            save = next((p for p in self._pending if p.written is None), None)
            if save is None or (until is not None and save.order > until):
                return
            if not save.collective and save is not self._pending[0]:
                return  # single-writer saves commit in order, after the collective saves before them
            assert self._engine is not None
            status = self._engine.poll(save.ticket)
            if status is Status.RUNNING:
                waited = time.monotonic() - save.ticket.scheduled_at
                if waited > self.timeout_s:
                    self._fail_all(
                        RankFailure(
                            self._agreement.rank, "TimeoutError",
                            f"the background write did not finish within timeout_s={self.timeout_s:g}s;"
                            " its worker was killed",
                        )
                    )
                    return
                if not blocking:
                    return
                time.sleep(self.poll_interval_s)
                continue
            if status is Status.DEAD:
                self._fail_all(RankFailure(self._agreement.rank, "WorkerDied", save.ticket.detail))
                return
            self._stager.release(save.buffer_set)
            results, failure = self._read_outcome(save)
            if failure is None and save.collective:
                save.written = results
                continue
            self._pending.remove(save)
            if failure is None:
                failure = self._commit(save, [results], coordinator=True)
            if failure is not None:
                self._record_failure(save, failure)

    def _wait_for_room(self) -> None:
        """Each write in progress holds one copy of the state: wait until fewer than ``max_pending`` are
        (local; a collective save whose part is written has released its buffers)."""
        while True:
            unwritten = [p for p in self._pending if p.written is None]
            if len(unwritten) < self.max_pending:
                return
            self._settle_local(blocking=True, until=unwritten[0].order)
            if any(p is unwritten[0] for p in self._pending) and unwritten[0].written is None:
                return  # cannot progress locally (it waits for a collective commit): go on rather than spin

    def _read_outcome(self, save: _PendingSave) -> tuple[list, RankFailure | None]:
        """The worker's report for ``save``: its write results, or what went wrong."""
        rank = self._agreement.rank
        try:
            with open(save.result_path, "rb") as f:
                outcome = pickle.load(f)
            os.unlink(save.result_path)
        except FileNotFoundError:
            return [], RankFailure(rank, "WorkerDied", "the checkpoint worker exited without reporting a result")
        if not outcome["ok"]:
            return [], RankFailure(rank, outcome["error_type"], outcome["message"], outcome["errno"])
        save.write_s = float(outcome.get("write_s", 0.0))
        return outcome["results"], None

    def _commit(self, save: _PendingSave, all_results: list, coordinator: bool) -> RankFailure | None:
        """write complete -> (coordinator) .metadata -> rename -> removals that waited for it."""
        if coordinator:
            try:
                testing.raise_coordinator_fault(save.coordinator_fault, "metadata", save.path)
                save.plan.writer.finish(save.plan.metadata, all_results)
                testing.raise_coordinator_fault(save.coordinator_fault, "commit", save.path)
                commit.publish(save.tmp, save.path)
            except Exception as e:  # noqa: BLE001 - becomes a value, raised on every rank by finalize
                return RankFailure.from_exception(self._agreement.rank, e)
        record = SaveRecord(
            path=str(save.path), step=save.step, stall_s=save.stall_s, write_s=time.monotonic() - save.started,
            nbytes=_written_bytes(all_results), local_nbytes=save.nbytes, pending=len(self._pending),
            worker_s=save.write_s,
        )
        self.history.append(record)
        self._last_ok_order = save.order
        if self._agreement.rank == 0:
            log.info("lightning-asyncckpt: %s", record.summary())
        log.debug(
            "lightning-asyncckpt: %s: stall %.4f s, worker write %.3f s, scheduled-to-commit %.3f s, %d bytes"
            " staged here, %d pending", save.path, record.stall_s, record.worker_s, record.write_s,
            record.local_nbytes, record.pending,
        )
        self._run_removals()
        return None

    def _commit_collective(self, save: _PendingSave) -> None:
        """(all ranks, same order) Gathers every rank's write results to the coordinator, which writes
        the metadata and renames; then every rank learns the outcome and raises the same error."""
        self._pending.popleft()
        all_results = self._agreement.all_gather(save.written)
        coordinator = self._agreement.rank == 0
        failure = self._commit(save, all_results, coordinator) if coordinator else None
        failure = self._agreement.all_gather(failure)[0]
        if failure is not None:
            if coordinator:
                commit.remove_path(save.tmp)  # every rank's part of it was written
            self._drop_collective_pending()
            self._agreement.all_max([0])  # every rank has stopped its writers
            self._remove_doomed_tmps()
            raise CheckpointWriteError(str(save.path), [failure])
        if not coordinator:
            self._commit(save, all_results, coordinator=False)

    def _drop_collective_pending(self) -> None:
        """After an agreed failure, the other saves written by all ranks together cannot complete
        consistently: stop them everywhere."""
        keep: deque[_PendingSave] = deque()
        for save in self._pending:
            if save.collective:
                if self._engine is not None:
                    self._engine.kill(save.ticket)
                self._stager.release(save.buffer_set)
                self._discard_tmp(save)
            else:
                keep.append(save)
        if len(keep) != len(self._pending) and self._engine is not None and self._engine.persistent:
            self._engine.reset_after_failure()
        self._pending = keep

    def _owns_tmp(self, save: _PendingSave) -> bool:
        # every rank writes into a collective save's directory: only the coordinator removes it
        return not save.collective or self._agreement.rank == 0

    def _discard_tmp(self, save: _PendingSave) -> None:
        """Removes a failed save's partial directory. Other ranks may still be writing into a collective
        save's directory: the coordinator removes it once every rank has stopped (after the agreement)."""
        if save.collective:
            if self._owns_tmp(save):
                self._doomed_tmps.append(save.tmp)
        else:
            commit.remove_path(save.tmp)

    def _remove_doomed_tmps(self) -> None:
        for tmp in self._doomed_tmps:
            commit.remove_path(tmp)
        self._doomed_tmps = []

    def _record_failure(self, save: _PendingSave, failure: RankFailure) -> None:
        self._discard_tmp(save)
        with contextlib.suppress(OSError):
            os.unlink(save.result_path)
        self._failures.append(_Failed(save.order, str(save.path), failure, save.seq))
        log.error("lightning-asyncckpt: save to %s failed: %s", save.path, failure.describe())

    def _fail_all(self, failure: RankFailure) -> None:
        """The worker is dead or hung: every save queued on it is lost. The next save starts a new one.
        A collective save whose part this rank already wrote is not lost: it still commits."""
        assert self._engine is not None
        self._engine.reset_after_failure()
        keep: deque[_PendingSave] = deque()
        for save in self._pending:
            if save.written is not None:
                keep.append(save)
                continue
            self._engine.kill(save.ticket)
            self._stager.release(save.buffer_set)
            self._record_failure(save, failure)
        self._pending = keep

    def _run_removals(self) -> None:
        keep = []
        for path, after in self._removals:
            if after <= self._last_ok_order:
                commit.remove_path(path)
            else:
                keep.append((path, after))
        self._removals = keep

    def _raise_local_failures(self) -> None:
        if self._failures:
            first, rest = self._failures[0], self._failures[1:]
            self._failures = []
            raise CheckpointWriteError(first.path, [first.failure], note=self._more_note(rest))

    def _raise_agreed_failures(self) -> None:
        """(all ranks) Every rank learns every failure and raises the same error."""
        mine = [(f.path, f.failure) for f in self._failures]
        self._failures = []
        self._drop_collective_pending()
        gathered = [item for per_rank in self._agreement.all_gather(mine) for item in per_rank]
        self._remove_doomed_tmps()  # every rank has stopped its writers before the gather
        by_path: dict[str, list[RankFailure]] = {}
        for p, failure in gathered:
            by_path.setdefault(p, []).append(failure)
        (path, failures), *rest = by_path.items()
        raise CheckpointWriteError(path, failures, note=self._more_note([p for p, _ in rest]))

    @staticmethod
    def _more_note(rest: list) -> str:
        if not rest:
            return ""
        paths = [getattr(r, "path", r) for r in rest]
        return f"Saves to {paths} failed too."

    def _close(self, abort: bool) -> None:
        self._torn_down = True
        if self._exit_hook is not None:
            self._exit_hook.cancel()
            self._exit_hook = None
        if self._engine is not None:
            self._engine.close(abort=abort)
        for save in self._pending:  # only left when aborting
            if self._engine is not None:
                self._engine.kill(save.ticket)
            if self._owns_tmp(save):
                commit.remove_path(save.tmp)
        if self._pending:
            log.warning("lightning-asyncckpt: %d unfinished save(s) dropped", len(self._pending))
        self._pending.clear()
        if abort:
            self._failures.clear()  # logged when recorded; an aborted run does not raise them later
        self._remove_doomed_tmps()
        self._removals = [r for r in self._removals if r[1] <= self._last_ok_order]
        self._run_removals()
        self._removals.clear()
        self._reported = self._consumed = self._announced
        self._stager.clear()
        if self._results_dir is not None:
            shutil.rmtree(self._results_dir, ignore_errors=True)
            self._results_dir = None
        self._cleaned_dirs.clear()
