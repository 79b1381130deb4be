"""``AsyncCheckpointIO``: the Lightning/Fabric face of the save pipeline.

It holds a :class:`~lightning_asyncckpt.pipeline.pipeline.SaveSession` (``session``), which owns the run of saves;
the plugin's own methods are Lightning's ``CheckpointIO`` and the few verbs a user calls. The callback, the
strategies and the local tier's hooks reach the session through :mod:`~lightning_asyncckpt.integration.contract`.

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

import sys
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_asyncckpt import engines
from lightning_asyncckpt.faults.injected import EnvironmentFaults
from lightning_asyncckpt.faults.policy import FaultPolicy, check_policy
from lightning_asyncckpt.format.dcp import META_FILE
from lightning_asyncckpt.format.layout import Layout
from lightning_asyncckpt.integration import autoattach, lightning_api, loading, logsetup, versions
from lightning_asyncckpt.integration.lightning_api import CheckpointIO
from lightning_asyncckpt.pipeline.pipeline import Instruments, SaveSession
from lightning_asyncckpt.pipeline.records import SaveRecord, global_step
from lightning_asyncckpt.pipeline.settings import Settings
from lightning_asyncckpt.storage import paths
from lightning_asyncckpt.tiers import restore_key
from lightning_asyncckpt.tiers.config import LocalTier

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import torch
    from torch.serialization import MAP_LOCATION

__all__ = ["AsyncCheckpointIO", "SaveRecord", "META_FILE"]


logsetup.configure()


class AsyncCheckpointIO(CheckpointIO):
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
            replicated to peers on other nodes, beside the persistent ones (``docs/tiers.md``).
            ``ckpt_path="last"`` then resumes from the newest step complete in either tier.
        worker_nice: the nice value of the writer processes: 0 (the default) is the trainer's own
            priority, up to 19 the lowest. A higher value gives the CPU to whatever else competes for it
            (data-loading workers, other jobs) first; the write is never starved (nice 10 still gets about
            a tenth of a contended core) but commits later. nvidia-resiliency-ext 0.6+ runs its own worker
            at 10; measured on a CPU-bound Trainer, 10 did not lower training's overhead and made commits
            about 1.5 times later (``benchmarks/results/findings-train.md``), hence 0 here.
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
        super().__init__()
        if not isinstance(verify_on_load, bool):
            raise TypeError(f"AsyncCheckpointIO(verify_on_load=...) takes True or False; got {verify_on_load!r}.")
        if local is not None and not isinstance(local, LocalTier):
            raise TypeError(f"AsyncCheckpointIO(local=...) takes a LocalTier(dir=..., ...) or None; got {local!r}.")
        # `strategy` resolves by looking for the engine's package, importing nothing; the versions are checked
        # once the arguments are valid, before anything is written that could not be read back
        worker_mode = engines.parse_worker(worker)
        settings = Settings(engines.resolve(strategy), worker_mode, thread_count=thread_count,
                            timeout_s=timeout_s, max_pending=max_pending, poll_interval_s=poll_interval_s,
                            drain_timeout_s=drain_timeout_s, format=format, snapshot=snapshot, worker_nice=worker_nice)
        check_policy(faults, "AsyncCheckpointIO(faults=...)")
        versions.check_installed("torch", lightning_api.PACKAGE, versions.ENGINE_PACKAGES[settings.engine])
        self._session = SaveSession(settings)
        self._returned = 0  # history[:_returned] was returned by finalize()
        # the user's options and instruments, read at each save or load (assigning them between saves is theirs)
        self.faults: FaultPolicy = faults if faults is not None else EnvironmentFaults()
        self.write_hook: Callable[[list], None] | None = None  # picklable; the worker calls it with the buckets before writing
        self.copy_hook: Callable[[], None] | None = None  # a lazy snapshot's copy thread calls it before copying (testing.HoldCopy)
        self.local = local
        self.verify_on_load = verify_on_load  # read by every load path of the plugin and the strategies
        autoattach.install(self)  # the Trainer that takes this plugin gets the finalizer (and no other Trainer)

    # what the plugin holds --------------------------------------------------------------------------------
    @property
    def session(self) -> SaveSession:
        """The run of saves this plugin holds: what the callback, the strategies and the local tier's hooks
        call (:class:`~lightning_asyncckpt.integration.contract.SessionInterface`), and this rank's figures
        (``num_pending``, ``worker_pids()``, ``staging_buffers()``, ``exit_group_ready``)."""
        return self._session

    @property
    def settings(self) -> Settings:
        """The arguments, validated and frozen (``settings.timeout_s``, ``settings.worker``...). To change one
        between saves: ``io.session.configure(timeout_s=60)``, validated as the constructor's."""
        return self._session.settings

    @property
    def engine(self) -> str:
        """``"nvrx"`` or ``"mcore"``: the engine ``strategy`` resolved to (in ``__init__``, on every rank)."""
        return self._session.settings.engine

    @property
    def history(self) -> list[SaveRecord]:
        """(any rank) A :class:`SaveRecord` for each save this rank committed, oldest first."""
        return self._session.history

    # Lightning's CheckpointIO -------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, object], path: Path | str, storage_options: object | None = None) -> None:
        """(the ranks Lightning calls it on) Snapshots ``checkpoint`` and schedules its write to ``path``.
        Returns once the snapshot is taken; errors of the write are raised later, by :meth:`finalize`.

        Args:
            checkpoint: the state to save; not read again once this returns (a lazy snapshot's tracked
                optimizers excepted, see :meth:`wait_for_snapshot`).
            path: the file or directory to write, local or an fsspec URL.
            storage_options: passed on to the write (fsspec's options for a URL)."""
        self._session.submit(checkpoint, path, Layout.SINGLE_WRITER, self._instruments(),
                             storage_options=storage_options, trainer_save=_from_trainer(checkpoint))

    def save_checkpoint_distributed(self, checkpoint: dict[str, object], path: Path | str,
                                    storage_options: object | None = None) -> None:
        """(all ranks, same order) Saves a state replicated on every rank; each rank snapshots and writes a
        disjoint share, so every byte is written once. One checkpoint that loads on any number of ranks.
        Used by :class:`~lightning_asyncckpt.AsyncDDPStrategy`.

        Args:
            checkpoint: the state, the same on every rank.
            path: the DCP directory to write, the same on every rank.
            storage_options: passed on to the write (fsspec's options for a URL)."""
        self._session.submit(checkpoint, path, Layout.DISTRIBUTED, self._instruments(),
                             storage_options=storage_options, trainer_save=_from_trainer(checkpoint))

    def save_checkpoint_sharded(self, state: dict[str, object], path: Path | str,
                                meta: dict[str, object] | None = None) -> None:
        """(all ranks, same order) Saves a sharded state in Lightning's ``ModelParallelStrategy`` layout: each
        rank writes its own shards (``DTensor`` local shards and its share of replicated tensors), global
        rank 0 also writes ``meta`` to ``meta.pt``. Stock Lightning and plain DCP read the result.

        Args:
            state: this rank's sharded state (module and optimizer state dicts).
            path: the checkpoint directory, the same on every rank.
            meta: the rest of the checkpoint (Lightning's loops, callbacks, ``global_step``), or None."""
        self._session.submit(state, path, Layout.SHARDED, self._instruments(), meta=meta, step=global_step(meta),
                             trainer_save=_from_trainer(meta))

    @override
    def load_checkpoint(self, path: Path | str, map_location: MAP_LOCATION = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """(any rank; all ranks together where a strategy's ``load_checkpoint`` calls it, as Lightning's resume
        and Fabric's ``load`` do) Waits for this rank's pending saves, then reads the checkpoint at ``path`` (a
        directory of this library or DCP, or a ``torch.save`` file, local or at an fsspec URL). Read together,
        a ``torch.save`` file or ``AsyncDDPStrategy``'s directory is read once across the ranks: each reads
        about ``1/W`` of it from the storage and receives the rest over the process group
        (:mod:`~lightning_asyncckpt.storage.read_once`). A failed save at
        ``path`` is raised here. With other ranks up, a save that another rank is still writing into that
        directory is waited for first (at most ``timeout_s``): Fabric's ``save`` returns on every rank once
        rank 0 has scheduled it, and its ``load`` then reads on every rank. A path that the local tier's
        recovery returned (``LocalTierHook.latest``) gives the checkpoint it fetched, once; loaded again later it
        raises ``FileNotFoundError`` saying what to load instead (:mod:`~lightning_asyncckpt.tiers.restore_key`).

        Args:
            path: a checkpoint file or directory, local or an fsspec URL.
            map_location: as ``torch.load``'s, for a ``torch.save`` file and for the tensors of a directory.
            weights_only: as ``torch.load``'s (None: torch's default).

        Returns:
            The checkpoint as stock Lightning would load it."""
        restored = self._session.take_restored(path)
        if restored is not None:
            return restored
        step = restore_key.step_of(path)
        if step is not None:  # trainer.ckpt_path after a resume from the local tier, loaded again
            raise restore_key.not_held(path, step)
        path = paths.checkpoint_path(path)
        self._session.settle_for_load(path)
        # a strategy's load runs on every rank together: a local torch.save file is then read once across them
        together = lightning_api.is_strategy_load(sys._getframe(1))
        return loading.load(path, map_location=map_location, weights_only=weights_only, verify=self.verify_on_load,
                            together=together)

    @override
    def remove_checkpoint(self, path: Path | str) -> None:
        """(the ranks Lightning calls it on) Removes ``path`` once every save scheduled so far has committed:
        a checkpoint being written is never deleted, the newest committed one stays until a newer commits.

        Args:
            path: a checkpoint this plugin saved (file or directory, local or an fsspec URL)."""
        self._session.request_removal(path)

    @override
    def teardown(self) -> None:
        """(all ranks) Blocking finalize (errors raised on every rank), then stops the workers. After
        :meth:`abort` (the callback's ``on_exception``) it has nothing left to do. Called while an exception
        raised during this run propagates (Lightning tears down on errors, also without the callback), it
        is :meth:`abort`, so as not to mask it; one the user was already handling when the run began (a
        retry loop's ``except`` block) does not count."""
        self._session.close()

    # the user's verbs ---------------------------------------------------------------------------------
    def finalize(self, blocking: bool = False) -> list[SaveRecord]:
        """(all ranks, same order) Commits the saves whose writes finished and raises
        :class:`CheckpointWriteError` on every rank for a failed one.

        Args:
            blocking: wait for every save in flight to commit or fail.

        Returns:
            The records committed on this rank since the previous call, e.g. for
            ``fabric.log_dict(r.metrics())``."""
        self._session.finalize(blocking)
        history = self._session.history
        out = history[self._returned:]
        self._returned = len(history)
        return out

    def wait_for_snapshot(self) -> None:
        """(every saving rank, on the training thread, right before ``optimizer.step()``) Waits for the
        background copy of a lazy snapshot (``snapshot="lazy"``), the persistent save's and a lazy local-tier
        save's (``local=``; every rank saves to the local tier); a collective save's write is handed to the
        worker then (a single writer's was handed over at save time, behind a gate the copy opened). Returns
        at once when none is in flight. ``AsyncFinalizerCallback`` calls it in ``on_before_optimizer_step``;
        Fabric users, who have no hooks, call it themselves before each ``optimizer.step()`` (or at least
        before the first step after a save). Never called, the next save, ``finalize``, ``load_checkpoint``,
        ``teardown`` or ``abort`` waits instead.

        The copy checks every tensor it copies: one changed in place between the save and its copy (an
        optimizer step, a callback or EMA editing weights, before this wait) fails that save, which is
        never written: :class:`CheckpointWriteError` naming the tensor, raised here when there is no process
        group, else by the next ``finalize`` on every rank. A change made through ``.data`` is invisible
        to that check: such code needs ``snapshot="eager"``."""
        self._session.wait_for_snapshot()

    def track_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """(the saving ranks, before the saves; the callback at the start of training, and at each save)
        The optimizers whose ``step`` alone changes their parameters and state: with ``snapshot="lazy"``
        those are copied in the background after ``save_checkpoint`` returns. Nothing tracked: every save
        is copied at save time. Fabric users call it once, with their optimizers.

        Args:
            optimizers: the optimizers (held weakly; a Lightning ``LightningOptimizer`` stands for the one it
                wraps), e.g. ``[optimizer]``."""
        self._session.track_optimizers(optimizers)

    def warmup(self, like: dict[str, object] | None = None) -> None:
        """(writing ranks) Starts the background worker now, so that the first save does not pay for it (nor
        the first DCP save for importing DCP's writer: only a Trainer stage whose saves are single files
        skips that import). Local: it changes nothing the ranks must agree on, so it may be called on some
        ranks only.

        Args:
            like: a checkpoint like the ones to come: also allocates the staging buffers."""
        self._session.warmup(like)

    def abort(self) -> None:
        """(the ranks that raised; never raises) Lets the saves in flight land (``drain_timeout_s``), then
        stops the workers and drops unfinished saves. What goes wrong on the way is logged."""
        self._session.abort()

    def __enter__(self) -> AsyncCheckpointIO:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """(all ranks) For loops that never tear down (Fabric's): ``teardown``, or :meth:`abort` on an exception."""
        if exc is None:
            self.teardown()
        else:
            self.abort()

    def _instruments(self) -> Instruments:
        return Instruments(self.faults, self.write_hook, self.copy_hook)


def _from_trainer(checkpoint: object) -> bool:
    """A checkpoint the Lightning Trainer built (its dict carries Lightning's version)."""
    return isinstance(checkpoint, dict) and "pytorch-lightning_version" in checkpoint



lightning_api.register_with_the_other(AsyncCheckpointIO)  # either distribution's Trainer takes it as a plugin

def find_async_io(strategy: object) -> AsyncCheckpointIO | None:
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
