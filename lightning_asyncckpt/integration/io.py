"""``AsyncCheckpointIO``: the Lightning/Fabric face of the save pipeline.

One save, and the module that owns each step:
1. ``save_checkpoint`` (the ranks Lightning calls it on) validates, snapshots into reused host buffers,
   plans and hands the write to the engine's worker (``scheduler``), then returns.
2. ``finalize`` (all ranks, after every training batch through ``AsyncFinalizerCallback``): each rank polls
   its writes (``poller``), the ranks agree on progress and failures (``finalizer``), written saves are
   committed with ``.metadata`` last and an atomic publish, and top-k removals run (``committer``).
3. ``teardown`` settles everything, then stops the workers (``run``). On the way out of an exception, or
   at interpreter exit without ``teardown``, saves in flight still land where they can (``drain``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from typing_extensions import override

from lightning_asyncckpt import engines
from lightning_asyncckpt.faults.injected import EnvironmentFaults
from lightning_asyncckpt.faults.policy import FaultPolicy, check_policy
from lightning_asyncckpt.format import paths
from lightning_asyncckpt.format.dcp import META_FILE
from lightning_asyncckpt.format.layout import Layout
from lightning_asyncckpt.integration import autoattach, lightning_api, loading, logsetup, versions
from lightning_asyncckpt.integration.lightning_api import CheckpointIO
from lightning_asyncckpt.pipeline import poller, write_jobs
from lightning_asyncckpt.pipeline.committer import request_removal
from lightning_asyncckpt.pipeline.finalizer import finalize
from lightning_asyncckpt.pipeline.pipeline import SavePipeline
from lightning_asyncckpt.pipeline.records import SaveRecord, global_step
from lightning_asyncckpt.pipeline.settings import Settings
from lightning_asyncckpt.tiers import restore_key
from lightning_asyncckpt.tiers.config import LocalTier
from lightning_asyncckpt.tiers.run import TierRun

__all__ = ["AsyncCheckpointIO", "SaveRecord", "META_FILE"]


logsetup.configure()


def _setting(name: str) -> property:
    def get(self: AsyncCheckpointIO) -> Any:
        return getattr(self.settings, name)

    def set_(self: AsyncCheckpointIO, value: Any) -> None:
        self.settings = dataclasses.replace(self.settings, **{name: value})

    return property(get, set_, doc=f"``{name}``: see the class docstring.")


class AsyncCheckpointIO(SavePipeline, CheckpointIO):
    """Writes checkpoints in the background: the same file or DCP directory stock Lightning writes.

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
        drain_timeout_s: on the way out of an exception (Ctrl-C, SIGTERM) or at interpreter exit without
            ``teardown``, how long this rank waits for the saves in flight to land (see
            :mod:`lightning_asyncckpt.pipeline.drain`); ``0`` drops every unfinished save at once.
        format: ``"auto"``: where stock Lightning writes one file (single device, DDP from rank 0, Fabric),
            the same ``torch.save`` file; sharded and ``AsyncDDPStrategy`` saves are DCP directories.
            ``"dcp"``: single-writer saves are DCP directories too (0.1's layout).
        faults: where injected faults come from (:mod:`lightning_asyncckpt.testing`); by default the
            ``LIGHTNING_ASYNCCKPT_FAULTS`` environment variable, read at every save.
        snapshot: ``"eager"``: ``save_checkpoint`` copies the whole state before it returns. ``"lazy"``: it
            copies only what may change before the next optimizer step (buffers, small tensors, non-tensor
            state) and leaves the parameters and state of the tracked optimizers (:meth:`track_optimizers`;
            ``AsyncFinalizerCallback`` tracks the Trainer's) to a background copy during the next forward
            and backward, waited for by :meth:`wait_for_snapshot` before the optimizer step. A tensor that
            changes in place before its copy fails that save (see :mod:`lightning_asyncckpt.snapshot.lazy`).
            Fork-per-save (``worker="fork"``) saves are always eager.
        local: a :class:`~lightning_asyncckpt.LocalTier`: frequent node-local checkpoints on every rank,
            replicated to peers on other nodes, beside the persistent ones (``README.md``, "Two tiers").
            ``ckpt_path="last"`` then resumes from the newest step complete in either tier.
        worker_nice: the nice value of the writer processes: 0 (the default) is the trainer's own
            priority, up to 19 the lowest. A higher value gives the CPU to whatever else competes for it
            (data-loading workers, other jobs) first; the write is never starved (nice 10 still gets about
            a tenth of a contended core) but commits later. nvidia-resiliency-ext 0.6+ runs its own worker
            at 10; measured on a CPU-bound Trainer, 10 did not lower training's overhead and made commits
            about 1.5 times later (``benchmarks/README.md``), hence 0 here.
        verify_on_load: before a checkpoint is loaded through this plugin (``ckpt_path=``, ``load_checkpoint``,
            ``fabric.load`` through the package's strategies), check every zip record against its CRC32 and
            size, and refuse a mismatch (``CorruptCheckpointError`` naming the file and the record), as the CLI's
            ``verify`` does; stock Lightning loads a flipped bit silently. ``False`` skips the CRC32 pass (one
            read of the checkpoint's bytes from the page cache; ``benchmarks/bench_verify_load.py``); the checks
            that item paths stay inside the checkpoint and name regular files always run.

    Construct it on every rank; it starts nothing until the first save, ``warmup`` or the callback's
    ``setup``. With torch, Lightning or the engine outside the supported versions it raises
    :class:`~lightning_asyncckpt.errors.UnsupportedVersionError` at once (:mod:`lightning_asyncckpt.integration.versions`). ``history`` lists a :class:`SaveRecord` for each save this rank committed.
    """

    def __init__(
        self, strategy: str = "auto", *, worker: str = "persistent", thread_count: int = 1, timeout_s: float = 1800.0,
        max_pending: int = 2, poll_interval_s: float = 0.02, drain_timeout_s: float = 300.0,
        format: str = "auto", faults: FaultPolicy | None = None, snapshot: str = "eager", worker_nice: int = 0,
        local: LocalTier | None = None, verify_on_load: bool = True,
    ) -> None:
        CheckpointIO.__init__(self)
        if not isinstance(verify_on_load, bool):
            raise TypeError(f"AsyncCheckpointIO(verify_on_load=...) takes True or False; got {verify_on_load!r}.")
        if local is not None and not isinstance(local, LocalTier):
            raise TypeError(f"AsyncCheckpointIO(local=...) takes a LocalTier(dir=..., ...) or None; got {local!r}.")
        worker_mode = engines.parse_worker(worker)
        settings = dict(thread_count=thread_count, timeout_s=timeout_s, max_pending=max_pending,
                        poll_interval_s=poll_interval_s, drain_timeout_s=drain_timeout_s, format=format,
                        snapshot=snapshot, worker_nice=worker_nice)
        Settings(engines.EngineName.NVRX, worker_mode, **settings)  # bad arguments first, before any import
        check_policy(faults, "AsyncCheckpointIO(faults=...)")
        versions.check_installed("torch", lightning_api.PACKAGE)  # before anything is written that could not be read back
        engine = engines.resolve(strategy)
        versions.check_installed(versions.ENGINE_PACKAGES[engine.value])
        SavePipeline.__init__(self, Settings(engine, worker_mode, **settings))
        self.faults: FaultPolicy = faults if faults is not None else EnvironmentFaults()
        self.write_hook: Any = None  # picklable; the worker calls it with the buckets before writing
        self.copy_hook: Any = None  # a lazy snapshot's copy thread calls it before copying (testing.HoldCopy)
        self._returned = 0  # history[:_returned] was returned by finalize()
        self.local = local
        self.verify_on_load = verify_on_load  # read by every load path of the plugin and the strategies
        self.tier: TierRun | None = None  # the local tier's run, made at setup on every rank (tier_trainer, tier_fabric)
        autoattach.install(self)  # the Trainer that takes this plugin gets the finalizer (and no other Trainer)

    def wait_for_snapshot(self) -> None:
        """(every rank, on the training thread, right before ``optimizer.step()``) As
        :meth:`SavePipeline.wait_for_snapshot` for the persistent saves, and then for a lazy local-tier save's
        copy (``local=``; every rank saves to the local tier). ``AsyncFinalizerCallback`` calls it in
        ``on_before_optimizer_step``; Fabric users call it themselves."""
        SavePipeline.wait_for_snapshot(self)
        if self.tier is not None:
            self.tier.wait_copy()

    @property
    def engine(self) -> str:
        """``"nvrx"`` or ``"mcore"``: the engine ``strategy`` resolved to (in ``__init__``, on every rank)."""
        return self.settings.engine

    @property
    def worker(self) -> str:
        return self.settings.worker  # "persistent" or "fork"

    # the arguments, read back; assigning one validates it and replaces the frozen settings (the next
    # save uses it)
    thread_count = _setting("thread_count")
    timeout_s = _setting("timeout_s")
    max_pending = _setting("max_pending")
    poll_interval_s = _setting("poll_interval_s")
    drain_timeout_s = _setting("drain_timeout_s")
    format = _setting("format")
    snapshot = _setting("snapshot")
    worker_nice = _setting("worker_nice")

    @property
    def num_pending(self) -> int:
        """(any rank, any time) Saves of this rank not yet committed or failed (a lazy snapshot being copied
        included)."""
        return len(self._run.unsettled()) if self._run is not None else 0

    @property
    def exit_group_ready(self) -> bool:
        """(any rank) Whether the group for committing collective saves on the way out exists and is usable."""
        return self._exit_group.usable()

    def worker_pids(self) -> list[int]:
        """(any rank, any time) PIDs of this rank's live background writers (the persistent worker, or forked ones)."""
        return self._run.worker_pids() if self._run is not None else []

    def is_pending(self, path: Any) -> bool:
        """(the saving ranks) Whether a save to ``path`` is scheduled and not yet committed: it exists for
        whoever picks free names (``ModelCheckpoint``'s ``-v1`` suffixes), as stock's synchronous file would."""
        path = paths.checkpoint_path(path)
        return self._run is not None and any(p == path for p, _ in self._run.unsettled())

    def staging_buffers(self) -> list[torch.Tensor]:
        """(any rank) The host buffers held for snapshots, reused from save to save (empty after ``teardown``)."""
        return self._run.stager.buffers() if self._run is not None else []

    # Lightning's CheckpointIO -------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """(the ranks Lightning calls it on) Snapshots ``checkpoint`` and schedules its write to ``path``.
        Returns once the snapshot is taken; errors of the write are raised later, by :meth:`finalize`."""
        self._save(checkpoint, path, storage_options, Layout.SINGLE_WRITER, trainer_save=_from_trainer(checkpoint))

    def save_checkpoint_distributed(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """(all ranks, same order) Saves a state replicated on every rank; each rank snapshots and writes a
        disjoint share, so every byte is written once. One checkpoint that loads on any number of ranks.
        Used by :class:`~lightning_asyncckpt.AsyncDDPStrategy`."""
        self._save(checkpoint, path, storage_options, Layout.DISTRIBUTED, trainer_save=_from_trainer(checkpoint))

    def save_checkpoint_sharded(self, state: dict[str, Any], path: Any, meta: dict[str, Any] | None = None) -> None:
        """(all ranks, same order) Saves a sharded state in Lightning's ``ModelParallelStrategy`` layout: each
        rank writes its own shards (``DTensor`` local shards and its share of replicated tensors), global
        rank 0 also writes ``meta`` to ``meta.pt``. Stock Lightning and plain DCP read the result."""
        extra = [write_jobs.meta_file(meta)] if meta is not None and self._agreement.rank == 0 else []
        self._save(state, path, None, Layout.SHARDED, extra, global_step(meta), trainer_save=_from_trainer(meta))

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """(any rank) Waits for this rank's pending saves, then reads the checkpoint at ``path`` (a directory
        of this library or DCP, or a ``torch.save`` file, local or at an fsspec URL). A failed save at
        ``path`` is raised here. With other ranks up, a save that another rank is still writing into that
        directory is waited for first (at most ``timeout_s``): Fabric's ``save`` returns on every rank once
        rank 0 has scheduled it, and its ``load`` then reads on every rank. A path that the local tier's
        recovery returned (``TierRun.latest``) gives the checkpoint it fetched, once; loaded again later it
        raises ``FileNotFoundError`` saying what to load instead (:mod:`~lightning_asyncckpt.tiers.restore_key`)."""
        restored = self.tier.take(path) if self.tier is not None else None
        if restored is not None:
            return restored
        step = restore_key.step_of(path)
        if step is not None:  # trainer.ckpt_path after a resume from the local tier, loaded again
            raise restore_key.not_held(path, step)
        path = paths.checkpoint_path(path)
        if self._run is not None:
            self.wait_for_snapshot()
            poller.settle_for(self._run, self.settings, self._agreement.rank, path)
        if self._agreement.active:
            paths.wait_until_landed(path, self.settings.timeout_s, self.settings.poll_interval_s)
        return loading.load(path, map_location=map_location, weights_only=weights_only, verify=self.verify_on_load)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """(the ranks Lightning calls it on) Removes ``path`` once every save scheduled so far has committed:
        a checkpoint being written is never deleted, the newest committed one stays until a newer commits."""
        request_removal(self._ensure_run(), paths.checkpoint_path(path))

    @override
    def teardown(self) -> None:
        """(all ranks) Blocking finalize (errors raised on every rank), then stops the workers. After
        :meth:`abort` (the callback's ``on_exception``) it has nothing left to do. Called while an exception
        raised during this run propagates (Lightning tears down on errors, also without the callback), it
        is :meth:`abort`, so as not to mask it; one the user was already handling when the run began (a
        retry loop's ``except`` block) does not count."""
        if self._propagating():
            self.abort()
        else:
            self._finalize_all()

    def finalize(self, blocking: bool = False) -> list[SaveRecord]:
        """(all ranks, same order) Commits the saves whose writes finished (``blocking``: all of them) and
        raises :class:`CheckpointWriteError` on every rank for a failed one. Returns the records committed
        on this rank since the previous call, e.g. for ``fabric.log_dict(r.metrics())``."""
        self.settle(blocking)
        out = self.history[self._returned:]
        self._returned = len(self.history)
        return out

    def settle(self, blocking: bool = True) -> None:
        """(all ranks, same order) ``finalize`` without taking its records: for loads, which must see every
        save settled first (the strategies' ``load_checkpoint``, ``fabric.load``)."""
        run = self._ensure_run()
        self.settle_snapshot(blocking)
        finalize(run, self._agreement, self.settings, blocking, force=True)

    def __enter__(self) -> AsyncCheckpointIO:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """(all ranks) For loops that never tear down (Fabric's): ``teardown``, or :meth:`abort` on an exception."""
        if exc is None:
            self.teardown()
        else:
            self.abort()

    def warmup(self, like: dict[str, Any] | None = None) -> None:
        """(writing ranks) Starts the background worker now, so that the first save does not pay for it (nor
        the first DCP save for importing DCP's writer: only a Trainer stage whose saves are single files
        skips that import). ``like`` (a checkpoint like the ones to come) also allocates the staging
        buffers. Local: it changes nothing the ranks must agree on, so it may be called on some ranks only."""
        self._closed, self._began = False, True
        # a Trainer stage whose saves are single torch.save files (begin_run, not collective) never needs DCP's
        # writer in its worker; a user's warmup may come before any kind of save
        directories = self._collective_run is not False or self.settings.format == "dcp"
        self._ensure_run().start(self._agreement.rank, None).start(directories=directories)
        if like is not None:
            self.prepare(like, distributed=False)


def _from_trainer(checkpoint: Any) -> bool:
    """A checkpoint the Lightning Trainer built (its dict carries Lightning's version)."""
    return isinstance(checkpoint, dict) and "pytorch-lightning_version" in checkpoint



lightning_api.register_with_the_other(AsyncCheckpointIO)  # either distribution's Trainer takes it as a plugin

def find_async_io(strategy: Any) -> AsyncCheckpointIO | None:
    """The ``AsyncCheckpointIO`` behind a strategy's (possibly wrapped) checkpoint IO, if any (None for a
    strategy that has no checkpoint IO: Fabric's ``ModelParallelStrategy`` raises when asked for it)."""
    try:
        io = getattr(strategy, "_checkpoint_io", None) or getattr(strategy, "checkpoint_io", None)
    except NotImplementedError:
        return None
    for _ in range(8):
        if io is None or isinstance(io, AsyncCheckpointIO):
            return io
        io = getattr(io, "checkpoint_io", None)
    return None
