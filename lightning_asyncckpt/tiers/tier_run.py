"""``TierRun``: one run's local tier on one rank, from setup to the last step.

Made at setup on every rank by :func:`~lightning_asyncckpt.tiers.setup.open_tier` (collective: process
groups, setup checks), once the training's process group exists; it holds the session's lock for the run's
life (:mod:`~lightning_asyncckpt.tiers.job_lock`: one job at a time in a session). It implements
:class:`~lightning_asyncckpt.tiers.hook.LocalTierHook`, the interface the plugin drives it through, and
composes one part per concern:

- the run's name: :meth:`TierRun.begin` names the run before its first save or restore: a fresh start a new
  run, a resume the run of its persistent destination; no other run's local step is restored
  (:mod:`~lightning_asyncckpt.tiers.run_identity`);
- saving (:mod:`~lightning_asyncckpt.tiers.saving`): this rank's share copied into mapped node-local files,
  handed to the writer thread (:mod:`~lightning_asyncckpt.tiers.writer`), which settles replicas and commits;
- the step boundary (:mod:`~lightning_asyncckpt.tiers.boundary`): one all-reduce on a preemption request,
  a failed local save and the newest step complete everywhere; older steps are then removed;
- resuming (:mod:`~lightning_asyncckpt.tiers.resuming`): the local tier's newest complete step, unless the
  persistent one is newer, restored (:mod:`~lightning_asyncckpt.tiers.restore`);
- preemption signals (:mod:`~lightning_asyncckpt.tiers.preemption`): set a flag, agreed at the boundary.

Every method runs on every rank, in the same order, at step boundaries, unless its docstring says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning_asyncckpt.tiers import checks, run_identity
from lightning_asyncckpt.tiers.boundary import Boundary, StepBoundary
from lightning_asyncckpt.tiers.config import LocalTier
from lightning_asyncckpt.tiers.hook import Checkpoint, CopyHook, LazyRule, StepEnd
from lightning_asyncckpt.tiers.job_lock import JobLock
from lightning_asyncckpt.tiers.preemption import PreemptionFlag
from lightning_asyncckpt.tiers.resuming import TierRestorer
from lightning_asyncckpt.tiers.saving import TierSaver
from lightning_asyncckpt.tiers.store import LocalStore
from lightning_asyncckpt.tiers.tier_groups import TierGroups
from lightning_asyncckpt.tiers.writer import ShareWriter

if TYPE_CHECKING:
    from pathlib import Path

    from lightning_asyncckpt.tiers.preemption import Handler

__all__ = ["Boundary", "TierRun"]


class TierRun:
    """(every rank) The local tier of one run; see the module docstring. Made by
    :func:`~lightning_asyncckpt.tiers.setup.open_tier`, which checks and locks first."""

    def __init__(self, config: LocalTier, groups: TierGroups, store: LocalStore, writer: ShareWriter, lock: JobLock,
                 flag: PreemptionFlag, steps: StepBoundary, saver: TierSaver, restorer: TierRestorer) -> None:
        self.config, self.groups, self.store, self.writer = config, groups, store, writer
        self._lock, self._flag, self._steps = lock, flag, steps
        self._saver, self._restorer = saver, restorer
        self.run: str | None = None  # the run id, once begin() agreed on it

    # what the rest of the package reads -------------------------------------------------------------
    @property
    def factor(self) -> int:
        """F: the copies of each share kept (1: each rank its own only)."""
        return self.groups.factor

    @property
    def clique(self) -> list[int]:
        """The ranks that hold each other's shares, this one's among them."""
        return self.groups.clique

    @property
    def topology(self) -> tuple[int, int, int]:
        return self.groups.topology

    @property
    def complete(self) -> int:
        """The newest step complete on every rank, as of the last boundary (-1: none yet)."""
        return self._steps.complete

    @property
    def saved_step(self) -> int:
        """The newest step this rank began saving (-1: none)."""
        return self._saver.saved_step

    @property
    def last_stall_s(self) -> float | None:
        """How long the newest local save held the training loop (None: none yet)."""
        return self._saver.last_stall_s

    @property
    def wants_files(self) -> bool:
        """True until the first local save or :meth:`prepare`: the first save's files are not made yet."""
        return self._saver.wants_files

    @property
    def preemption_signal(self) -> str | None:
        """The signal this rank received (``"SIGTERM"``), None for none."""
        return self._flag.received

    def gather(self, obj: object) -> list[object]:
        """(all ranks) Every rank's ``obj`` over the tier's group."""
        return self.groups.gather(obj)

    # the run's name -----------------------------------------------------------------------------------
    def begin(self, destination: str = "", resuming: bool = False) -> None:
        """(every rank, together, once per run: before its first local save or restore) Names this run: a new
        run id, or where ``resuming`` the run of the local steps recorded for ``destination`` (where its
        persistent checkpoints go), so that no other run's local step is ever restored
        (:mod:`~lightning_asyncckpt.tiers.run_identity`). :meth:`save` and :meth:`latest` begin a run that
        has not begun (as a fresh start and a resume, without a destination)."""
        if self.run is None:
            record, problem = run_identity.begin(self.store.dir, self.groups.rank, self.gather, destination, resuming)
            checks.agree(problem, self.gather)
            self.run = record.run
            self.writer.begin_run(record.run)

    # saving -------------------------------------------------------------------------------------------
    def step_end(self, step: int, checkpoint: Callable[[], Checkpoint], like: Callable[[], Checkpoint],
                 lazy: LazyRule = None, hook: CopyHook = None) -> StepEnd:
        """(every rank, after every optimizer step) Agrees on the step boundary (:meth:`boundary`); saves
        ``checkpoint()`` every ``every_n_train_steps`` and on a preemption request; before the first save,
        makes its files sized for ``like()`` (the states that make up nearly all of its bytes). On a
        preemption request it then waits for the save and its replicas (:meth:`finish`): stop training.

        Args:
            step: the optimizer steps taken so far (``trainer.global_step``, the Fabric loop's counter).
            checkpoint: builds the checkpoint to save, as the persistent save would write it.
            like: builds a state of the checkpoint's size (called only until the first save).
            lazy, hook: as :meth:`save`'s.

        Returns:
            What the boundary decided.
        """
        boundary = self.boundary()
        due = step > 0 and step % self.config.every_n_train_steps == 0
        saved = (due or boundary.preempted) and step != self.saved_step
        if saved:
            self.save(step, checkpoint(), lazy=lazy, hook=hook)
        elif step > 0 and self.wants_files:  # the first save's files, made while the next steps run
            self.prepare(like())
        if not boundary.preempted:
            return StepEnd(saved, False, boundary.complete, replicated=self.factor > 1)
        return StepEnd(saved, True, self.finish(), boundary.handlers_everywhere, replicated=self.factor > 1)

    def save(self, step: int, checkpoint: Checkpoint, lazy: LazyRule = None, hook: CopyHook = None) -> None:
        """(every rank, at the same step boundaries) Saves ``checkpoint`` as ``step``: :meth:`TierSaver.save
        <lightning_asyncckpt.tiers.saving.TierSaver.save>`, once the run has begun."""
        self.begin()
        self._restorer.start_refill()
        self._saver.save(step, checkpoint, lazy=lazy, hook=hook)

    def wait_copy(self) -> None:
        """(every rank, right before the optimizer changes the state) Waits for a lazy save's background copy
        (at most ``timeout_s``); a problem with it is the writer thread's to report, at the next boundary."""
        self._saver.wait_copy()

    def prepare(self, like: Checkpoint) -> None:
        """(every rank, at a step boundary before the first local save) Makes the first save's files, sized
        for ``like``, in the background (:meth:`TierSaver.prepare <lightning_asyncckpt.tiers.saving.TierSaver.prepare>`)."""
        self._saver.prepare(like)

    # the step boundary --------------------------------------------------------------------------------
    def boundary(self) -> Boundary:
        """(every rank, after every optimizer step) One all-reduce: a preemption request on any rank, a
        failed local save on any rank (raised here on every rank), and the newest step complete everywhere
        (:mod:`~lightning_asyncckpt.tiers.boundary`)."""
        self._restorer.start_refill()
        return self._steps.round()

    def finish(self) -> int:
        """(every rank) Waits for the local save in flight, then agrees; returns the newest complete step."""
        self._restorer.start_refill()
        self.writer.wait(self.config.timeout_s)
        return self._steps.finish()

    # preemption ---------------------------------------------------------------------------------------
    def arm(self, pass_on: tuple[str, ...] = ()) -> bool:
        """(every rank, main thread, once the training loop starts) Installs the preemption handlers, after
        Lightning's own (whose SIGTERM handler runs a collective inside the handler): ours replace them
        until :meth:`close`. ``pass_on``: signals whose replaced handler is collective and runs after the
        emergency save on every rank or none (:meth:`replaced_handler`). False where none could be installed
        (not the main thread), with one warning."""
        return self._flag.arm(self.groups.rank, pass_on)

    def replaced_handler(self) -> Handler | None:
        """(every rank, at the boundary that stops training) The handler this rank's received signal replaced,
        where that signal is to be passed on (:meth:`arm`); run it only where
        :attr:`Boundary.handlers_everywhere`: every rank then runs its own, so a collective in it is reached
        by all."""
        return self._flag.replaced_handler()

    def replaced(self, name: str) -> object:
        """(any rank) The handler that :meth:`arm` replaced for signal ``name`` (callable or not; None: none)."""
        return self._flag.replaced(name)

    # resuming -----------------------------------------------------------------------------------------
    def latest(self, persistent: str | Path | None, weights_only: bool | None = None) -> str | Path | None:
        """(every rank, together, before loading) The checkpoint to resume from: a key for :meth:`take`, or
        ``persistent`` (:meth:`TierRestorer.latest <lightning_asyncckpt.tiers.resuming.TierRestorer.latest>`).
        A run that has not begun begins as a resume."""
        self.begin(resuming=True)
        assert self.run is not None
        return self._restorer.latest(self.run, persistent, weights_only)

    def take(self, key: object) -> Checkpoint | None:
        """(any rank, at load) The checkpoint :meth:`latest` fetched for ``key`` (once), or None for any other path."""
        return self._restorer.take(key)

    # the end ------------------------------------------------------------------------------------------
    def close(self, wait: bool = True) -> None:
        """(every rank) Waits for the local save in flight (at most ``timeout_s``; not at all without
        ``wait``: its thread is a daemon), gives the signals back and releases the session's lock."""
        if not wait:
            self._restorer.drop_refill()  # a peer may be gone: nothing more is sent
            self._steps.drop()
        self._restorer.start_refill()
        if wait and self.writer.wait(self.config.timeout_s):
            self.store.close()  # its spare files: the next run makes its own
        self._flag.uninstall()
        self._lock.release()
