"""``TierRun``: one run's local tier on one rank, from setup to the last step.

Made at setup on every rank (it makes process groups: collective), once the training's process group
exists; it takes the session's lock for the run's life (:mod:`~lightning_asyncckpt.tiers.job_lock`: one job
at a time in a session). Its methods run on every rank, in the same order, at step boundaries:

- :meth:`begin` names the run before its first save or restore: a fresh start a new run, a resume the run
  of its persistent destination; no other run's local step is restored (:mod:`~lightning_asyncckpt.tiers.run_identity`);

- :meth:`save` copies this rank's share (and, for a replicated state, its clique peers' shares) into
  mapped node-local files and hands them to the writer thread (which settles the replicas and commits);
- :meth:`boundary` agrees, in one all-reduce on the tier's own gloo group, on a preemption request, a
  failed local save and the newest step complete everywhere; older steps are then removed;
- :meth:`latest` picks the step to resume from: the local tier's newest complete step, unless the
  persistent one is newer, and restores it (:mod:`lightning_asyncckpt.tiers.restore`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_asyncckpt import collectives
from lightning_asyncckpt.collectives import Agreed, StepAgreement
from lightning_asyncckpt.errors import CheckpointWriteError, RankFailure
from lightning_asyncckpt.snapshot.lazy import BackgroundCopy
from lightning_asyncckpt.tiers import (
    checks,
    cliques,
    deferred_refill,
    huge_pages,
    job_lock,
    packing,
    pinning,
    recovery,
    restore,
    restore_key,
    run_identity,
    shares,
)
from lightning_asyncckpt.tiers.config import LocalTier
from lightning_asyncckpt.tiers.mapped import MappedFile
from lightning_asyncckpt.tiers.persistent import global_step
from lightning_asyncckpt.tiers.preemption import PreemptionFlag
from lightning_asyncckpt.tiers.store import LocalStore, holder_dir
from lightning_asyncckpt.tiers.writer import Copied, ShareWriter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Boundary:
    """What the ranks agreed on at a step boundary."""

    preempted: bool  # some rank received a preemption signal
    complete: int  # the newest step every rank holds in full (-1: none yet)
    everywhere: bool = False  # every rank received the same preemption signal
    # every rank has the handler that signal replaced, to pass it on (TierRun.replaced_handler)
    handlers_everywhere: bool = False


class TierRun:
    """(every rank) The local tier of one run; see the module docstring."""

    def __init__(self, config: LocalTier, node_rank: int, local_world_size: int) -> None:
        self.config = config
        self.distributed = collectives.is_distributed()
        self.rank, self.world = collectives.rank(), collectives.world_size()
        self.jump = config.replication_jump or max(local_world_size, 1)
        self.group = self.clique_group = None
        if self.distributed:  # the tier's agreement (main thread)
            self.group = collectives.bounded_group(config.timeout_s)
        self.node_of = self.gather(node_rank)
        nodes = len(set(self.node_of))
        self.factor = factor = config.factor_for(nodes)  # F; by default it follows the nodes
        self.cliques = cliques.layout(self.world, self.jump, factor, nodes)
        self.clique = cliques.clique_of(self.rank, self.cliques)
        if self.distributed and factor > 1:  # every rank makes every clique's group, in the same order
            groups = collectives.bounded_groups(self.cliques, config.timeout_s)
            self.clique_group = groups[self.cliques.index(self.clique)]
        self.agreement = StepAgreement(self.group if self.world > 1 else None, config.overlap_agreement)
        checks.agree(checks.directory(Path(config.dir), self.rank, node_rank), self.gather)
        # before anything is written: the tier's own directories, where they exist, are this user's alone
        own = [config.root.parent.name, config.root.name, holder_dir(config.root, self.rank).name]
        checks.agree(checks.trusted(Path(config.dir), own, self.rank, node_rank), self.gather)
        if self.rank == 0 and config.replication_factor is None and factor == 1:
            log.info("lightning-asyncckpt: the local tier keeps no replicas: this job runs on one node, so each rank"
                     " keeps its own share there (replication_factor=None is 1 on one node, 2 on several)")
        if self.rank == 0 and (line := huge_pages.hint(Path(config.dir))):
            log.info(line)  # a recovery is twice as fast on a tmpfs with huge pages (huge_pages' docstring)
        checks.cliques_span_nodes(self.cliques, self.node_of, self.jump)
        checks.not_shared(config.root, self.rank, self.node_of, self.gather)
        leader = self.rank == self.node_of.index(node_rank)  # the node's lowest rank locks for its ranks
        self._lock = job_lock.exclusive(config.root, leader, f"LocalTier(dir={str(config.dir)!r},"
                                        f" session={config.session!r})", self.gather)  # before any file of ours
        self.run: str | None = None  # the run id, once begin() agreed on it
        self.topology = (self.world, self.jump, factor)
        self.store = LocalStore(config.root, self.rank, keep_free=len(self.clique) if factor > 1 else 1,
                                base=Path(config.dir))
        self.writer = ShareWriter(self.store, self.rank, self.clique_group, self.topology, config.timeout_s)
        self.flag = PreemptionFlag(config.emergency_signals)  # armed by arm(), once the loop runs
        self.complete = -1
        self.saved_step = -1
        self.last_stall_s: float | None = None
        self._space_checked = False
        self._prepared = False
        self._restored: dict[str, Any] = {}
        self._refill: Any = None  # the replicas a restore left for later, until the first boundary (_start_refill)
        self._copy: BackgroundCopy | None = None  # a lazy save's copy, until wait_copy

    def begin(self, destination: str = "", resuming: bool = False) -> None:
        """(every rank, together, once per run: before its first local save or restore) Names this run: a new
        run id, or where ``resuming`` the run of the local steps recorded for ``destination`` (where its
        persistent checkpoints go), so that no other run's local step is ever restored
        (:mod:`~lightning_asyncckpt.tiers.run_identity`). :meth:`save` and :meth:`latest` begin a run that
        has not begun (as a fresh start and a resume, without a destination)."""
        if self.run is None:
            record, problem = run_identity.begin(self.store.dir, self.rank, self.gather, destination, resuming)
            checks.agree(problem, self.gather)
            self.run = record.run
            self.writer.begin_run(record.run)

    def gather(self, obj: Any) -> list[Any]:
        """(all ranks) Every rank's ``obj`` over the tier's group."""
        if not self.distributed or self.world == 1:
            return [obj]
        return collectives.gather_objects(obj, self.group)

    # saving ------------------------------------------------------------------------------------------
    def save(self, step: int, checkpoint: dict[str, Any], lazy: Any = None, hook: Any = None) -> None:
        """(every rank, at the same step boundaries) Copies this rank's share of ``checkpoint`` (a DTensor
        state: its local shards; a replicated one: its part, and its clique peers' parts, which it holds
        too) into mapped files of its holder directory, then a thread checks the replicas and commits. Waits
        for the previous local save's thread first (at most ``timeout_s``). A file that cannot be reserved
        (a full directory) fails this save on every rank at the next :meth:`boundary`, as a failed write.

        ``lazy`` (a lazy snapshot's rule, ``AsyncCheckpointIO.lazy_rule``): the tensors it watches (the
        optimizers' parameters and state) are copied into the files by a background copy while the next
        step's forward and backward run; :meth:`wait_copy` waits for it before the optimizer step. One
        changed in place before its copy fails this save (nothing of it is committed), on every rank at the
        next :meth:`boundary`. ``hook``: the copy thread calls it first (tests: ``testing.HoldCopy``)."""
        self.begin()
        start = time.perf_counter()
        self._start_refill()
        if not self.writer.wait(self.config.timeout_s):
            raise TimeoutError(f"lightning-asyncckpt: the local save of step {self.saved_step} is still running"
                               f" after timeout_s={self.config.timeout_s}")
        self._raise_failed()
        mode, laid = self._layouts(checkpoint)
        head = laid[self.rank][0].header()  # this rank's; made once: also counted by the space check
        self._check_space(laid, len(head))
        self._pin_for(laid)
        copied, failure, deferred = [], None, []
        for owner, (lay, tensors) in laid.items():
            try:
                file = self.store.reserve(step, owner, lay.nbytes)
            except OSError as e:  # a full directory: this rank still takes part in the clique's exchange (its
                # peers would wait for it), from memory, and its thread reports the failure after
                failure = failure or f"local save of step {step}: {type(e).__name__}: {e}"
                file = MappedFile(None, lay.nbytes, torch.empty(lay.nbytes, dtype=torch.uint8))
            # the one copy, straight into node-local storage (of what a lazy rule leaves: the rest, later)
            deferred += packing.copy_into(lay, tensors, file.tensor, lazy)
            copied.append(Copied(owner, head if owner == self.rank else b"", file))
        self._copy = BackgroundCopy(deferred, hook=hook) if deferred else None  # their versions: read now
        self.writer.submit(step, mode, copied, failure, self._copy)
        self.saved_step = step
        self.last_stall_s = time.perf_counter() - start

    def wait_copy(self) -> None:
        """(every rank, right before the optimizer changes the state) Waits for a lazy save's background copy
        (at most ``timeout_s``); a problem with it is the writer thread's to report, at the next boundary."""
        if self._copy is not None:
            self._copy.wait(self.config.timeout_s)
            self._copy = None

    @property
    def wants_files(self) -> bool:
        """True until the first local save or :meth:`prepare`: the first save's files are not made yet."""
        return self.saved_step < 0 and not self._prepared

    def prepare(self, like: dict[str, Any]) -> None:
        """(every rank, at a step boundary before the first local save, once the optimizer has its state)
        Makes the first save's files in the background thread, sized for ``like`` (the checkpoint, or its
        model and optimizer states: a file a few bytes off is resized at the save, keeping its pages), so
        that the first save copies into ready files as every later one does. The save checks the space."""
        if not self.wants_files or self.writer.busy:  # busy: replicas sent after a restore; next boundary
            return
        _mode, laid = self._layouts(like)
        self._pin_for(laid)
        self.writer.make_ahead([lay.nbytes for lay, _ in laid.values()])
        self._prepared = True

    def _layouts(self, checkpoint: dict[str, Any]) -> tuple[str, dict[int, Any]]:
        """The mode, and each share's layout and tensors by owner: this rank's, and with a replicated
        state and replication its clique peers' too (it holds their replicas)."""
        mode = shares.SHARDED if shares.has_dtensors(checkpoint) else shares.REPLICATED
        owners = self.clique if mode == shares.REPLICATED and self.clique_group is not None else [self.rank]
        made = shares.make_many(checkpoint, owners, self.world, mode)
        return mode, {o: packing.layout(share) for o, share in made.items()}

    def _pin_for(self, laid: dict[int, Any]) -> None:
        """A GPU state: the pool's files are registered with CUDA, so that the save's copy runs at pinned speed."""
        device = pinning.cuda_device(laid[self.rank][1])
        if device is not None:
            self.store.pool.pin_for(device)

    def _check_space(self, laid: dict[int, Any], head_bytes: int) -> None:
        """(every rank, together, at the first save) Refuses a directory too small for the shares, their
        headers (``head_bytes``: this rank's) and manifests (collective)."""
        if not self._space_checked:
            checks.space(Path(self.config.dir), self.rank, self.node_of, laid[self.rank][0].nbytes,
                         self.store.used_bytes(), self.factor, self.gather, head_bytes=head_bytes)
            self._space_checked = True

    def boundary(self) -> Boundary:
        """(every rank, after every optimizer step) One all-reduce: a preemption request on any rank (and whether
        every rank received the same signal, and has the handler it replaced to pass it on to), a failed
        local save on any rank (raised here on every rank), and the newest step complete everywhere, whose
        older steps this rank then removes from its own holder directory. With ``overlap_agreement`` the
        round is posted here and what the previous boundary posted is returned (nothing at the first):
        :mod:`lightning_asyncckpt.collectives.rounds`."""
        self._start_refill()
        agreed = self.agreement.round(*self._values())
        return Boundary(False, self.complete) if agreed is None else self._agreed(agreed)

    def _values(self) -> tuple[list[int], list[int]]:
        """What this rank brings to a boundary's round: the values whose highest, and those whose lowest,
        every rank agrees on."""
        signum = self.flag.received_number
        handler = int(signum > 0 and self.flag.replaced_handler() is not None)
        return [signum, int(self.writer.error is not None)], [signum, handler, self.writer.newest_done]

    def _agreed(self, agreed: Agreed) -> Boundary:
        (highest, failed), (lowest, handlers, complete) = agreed.most, agreed.least
        if failed:
            self._raise_failed(force=True)
        if complete > self.complete:
            self.complete = complete
            self.store.remove_older(complete)
        same = lowest > 0 and lowest == highest
        return Boundary(highest > 0, self.complete, everywhere=same, handlers_everywhere=same and handlers == 1)

    def finish(self) -> int:
        """(every rank) Waits for the local save in flight, then agrees; returns the newest complete step."""
        self._start_refill()
        self.writer.wait(self.config.timeout_s)
        posted = self.agreement.settle()  # an overlapped round: read (its failure raised), not lost
        if posted is not None:
            self._agreed(posted)
        return self._agreed(self.agreement.now(*self._values())).complete

    def _raise_failed(self, force: bool = False) -> None:
        errors = self.gather(self.writer.error) if (force or self.world == 1) else None
        if errors and any(errors):
            self.writer.error = None
            failures = [RankFailure(r, "LocalTierError", e) for r, e in enumerate(errors) if e]
            raise CheckpointWriteError(str(self.config.root), failures,
                                       note="The local tier keeps its newest complete step.")

    def arm(self, pass_on: tuple[str, ...] = ()) -> bool:
        """(every rank, main thread, once the training loop starts) Installs the preemption handlers, after
        Lightning's own (whose SIGTERM handler runs a collective inside the handler): ours replace them
        until :meth:`close`. ``pass_on``: signals whose replaced handler is collective and runs after the
        emergency save on every rank or none (:meth:`replaced_handler`). False where none could be installed
        (not the main thread), with one warning."""
        armed = self.flag.install(pass_on)
        if not armed and self.config.emergency_signals:
            log.warning("lightning-asyncckpt: LocalTier(emergency_signals=%s) are not handled on global rank %d:"
                        " its training loop runs off Python's main thread, where no signal handler can be"
                        " installed, so a preemption stops it without an emergency save. Fix: train on the main"
                        " thread, or emergency_signals=() to say that this is meant.",
                        self.config.emergency_signals, self.rank)
        return armed

    @property
    def preemption_signal(self) -> str | None:
        return self.flag.received

    def replaced_handler(self) -> Any | None:
        """(every rank, at the boundary that stops training) The handler this rank's received signal replaced,
        where that signal is to be passed on (:meth:`arm`); run it only where
        :attr:`Boundary.handlers_everywhere`: every rank then runs its own, so a collective in it is reached
        by all."""
        return self.flag.replaced_handler()

    def replaced(self, name: str) -> Any:
        """(any rank) The handler that :meth:`arm` replaced for signal ``name`` (callable or not; None: none)."""
        return self.flag.replaced(name)

    # recovering --------------------------------------------------------------------------------------
    def latest(self, persistent: Any, weights_only: bool | None = None) -> Any:
        """(every rank, together, before loading) The checkpoint to resume from: a key for :meth:`take` (the
        local tier's newest complete step, :func:`~lightning_asyncckpt.tiers.restore.restore`), else
        ``persistent`` (also when it is newer, or when a share fails its CRC check), with one log line why.

        ``weights_only``: the caller's (``fit(..., weights_only=...)``, ``fabric.load``): the shares' headers
        are read with ``torch.load(weights_only=True)`` unless it is False, as stock reads a checkpoint (None
        is stock's default, True). A header that holds more (a pickle that would run code) raises
        :class:`~lightning_asyncckpt.tiers.packing.UnsafeShareError` on every rank, naming its file.

        A copy that fails its CRC32 check is left out and the restore tried again: the step is still
        complete where another rank of its clique holds a good copy (which also replaces the bad one). Each
        try leaves out at least one more copy, so the tries end."""
        self.begin(resuming=True)
        self._refill = None  # an earlier restore's replicas, never started: every rank drops them alike
        self.writer.wait(self.config.timeout_s)  # nothing of this run's is still being written or sent
        # read once (a persistent checkpoint on an object store is a request), gathered with every try's holdings
        mine = global_step(persistent) if self.rank == 0 else None
        failed: list[str] = []  # why each earlier try failed
        left_out: set[tuple[int, int, int]] = set()  # (holder, step, owner): copies that failed their check
        while True:
            plan, holdings, pstep, why = self._plan(mine, left_out)
            if plan is None:
                return self._persistent(persistent, pstep, "; ".join(
                    [*failed, f"without the copies that failed, {why}" if failed else why]))
            ranks = restore.Ranks(self.rank, self.world, self.config.root, self.store, self.group, self.node_of,
                                  self.cliques, self.factor, self.topology, self.gather, weights_only is not False)
            done = restore.restore(plan, holdings, ranks)
            if done.unsafe:
                raise packing.UnsafeShareError.of_step(done.unsafe, self.config.root, self.config.dir)
            if not done.problems:
                break
            more = f" (and {len(done.problems) - 3} more)" if len(done.problems) > 3 else ""
            why = f"step {plan.step} failed its checks: " + "; ".join(done.problems[:3]) + more
            bad = {(holder, plan.step, owner) for holder, owner in done.corrupt} - left_out
            if not bad:  # not (only) a bad copy: another try would meet the same problem
                return self._persistent(persistent, pstep, "; ".join([*failed, why]))
            failed.append(why)
            left_out |= bad
            if self.rank == 0:
                log.warning("lightning-asyncckpt: local tier: %s; trying again without %s", why, ", ".join(
                    f"rank {h}'s copy of rank {o}'s share" for h, _s, o in sorted(bad)))
        key = restore_key.key_for(self.config.root, plan.step)
        self._restored[key] = done.checkpoint
        self.complete = plan.step
        later = done.later
        if later.moves:  # every rank of the clique joins, in its writer's thread (see deferred_refill)
            self._refill = lambda: deferred_refill.run(later, self.rank, self.store, self.clique_group)
        if self.rank == 0:
            log.warning("lightning-asyncckpt: resuming from the local tier at step %d (%d share(s) sent between"
                        " ranks, %d read on their own node%s)", plan.step, done.sent, done.read,
                        f"; {len(later.moves)} replica(s) sent after, while training resumes" if later.moves else "")
        return key

    def _plan(self, pstep_here: int | None, left_out: set[tuple[int, int, int]]) -> tuple[Any, list, int | None, str]:
        """(every rank, together) What every rank holds now, less the copies ``left_out``, and the step to
        restore from it: ``(plan, holdings, persistent step, why not)``; plan None where the persistent tier
        is to be used (no complete local step, or an older one), and then ``why not``. ``pstep_here``: the
        persistent checkpoint's step as rank 0 read it (None on the others)."""
        rows = self.gather((self.store.holdings(self.topology), pstep_here, self.store.saved_under_others(self.topology)))
        holdings = [[h for h in row[0] if h.run == self.run and (holder, h.step, h.owner) not in left_out]
                    for holder, row in enumerate(rows)]
        pstep = rows[0][1]
        plan = recovery.plan(holdings, self.cliques)
        if plan is None:
            others: dict[tuple, int] = {}
            for row in rows:  # a resized job: steps saved under another topology, which it cannot use
                for topo, step in row[2].items():
                    others[topo] = max(others.get(topo, -1), step)
            return None, holdings, pstep, recovery.why_not(holdings, self.cliques, others, self.topology)
        if pstep is not None and pstep > plan.step:
            return None, holdings, pstep, f"its step {pstep} is newer than the local tier's {plan.step}"
        return plan, holdings, pstep, ""

    def _persistent(self, persistent: Any, pstep: int | None, why: str) -> Any:
        if self.rank == 0:
            target = ("nothing (no persistent checkpoint)" if persistent is None
                      else f"{persistent} (step {pstep})" if pstep is not None else str(persistent))
            log.warning("lightning-asyncckpt: resuming from the persistent tier, %s: local tier: %s", target, why)
        return persistent

    def _start_refill(self) -> None:
        """(every rank, at its first boundary, save, finish or close after a restore) Starts sending the
        replicas the restore left for later (:mod:`~lightning_asyncckpt.tiers.deferred_refill`) in the writer's
        thread: after the checkpoint is loaded into the model, not beside that load, so that they overlap the
        first training steps, as a local save's replication does."""
        if self._refill is not None:
            job, self._refill = self._refill, None
            self.writer.background(job, "asyncckpt-local-refill")

    def take(self, key: Any) -> Any | None:
        """The checkpoint :meth:`latest` fetched for ``key`` (once), or None for any other path."""
        return self._restored.pop(str(key), None)

    def close(self, wait: bool = True) -> None:
        """(every rank) Waits for the local save in flight (at most ``timeout_s``; not at all without
        ``wait``: its thread is a daemon) and gives the signals back."""
        if not wait:
            self._refill = None  # a peer may be gone: nothing more is sent
            self.agreement.drop()
        self._start_refill()
        if wait and self.writer.wait(self.config.timeout_s):
            self.store.close()  # its spare files: the next run makes its own
        self.flag.uninstall()
        self._lock.release()
