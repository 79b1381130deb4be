"""``LocalTier``: where and how often the local tier saves, and how many copies it keeps."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
from pathlib import Path

_SESSION = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_LONGEST_S = 365 * 86400.0
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")
# a handler that only sets a flag and returns would run the faulting instruction again, forever (a segfault
# in training_step then spins and ignores SIGTERM); SIGABRT and SIGSYS end the process all the same
_FAULTS = ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP", "SIGSYS")
_NOT_A_REQUEST = ("SIGCHLD",)  # sent whenever a child process (a DataLoader worker, the writer) ends
_OWN_ENTRY = re.compile(r"\..*|holder-\d+")  # hidden names (probes, spares), and what looks like a holder


@dataclasses.dataclass(frozen=True)
class LocalTier:
    """Node-local checkpoints every ``every_n_train_steps`` steps, replicated to peer ranks on other nodes.

    Args:
        dir: a node-local directory (``/dev/shm/...`` or a local NVMe mount) that exists on every node.
            The tier writes only under ``<dir>/asyncckpt-local/<session>/`` and never deletes anything else.
            It must be this user's or root's, and writable by others only with the sticky bit (as
            ``/dev/shm`` and ``/tmp`` are); what the tier makes below it is 0700 (files 0600), and an
            existing ``asyncckpt-local``, session or holder directory that is a link, another user's or
            writable by group or others is refused at setup (:mod:`lightning_asyncckpt.tiers.trusted_dirs`).
        every_n_train_steps: save to the local tier after every this many optimizer steps (global step).
        replication_factor: ``F``, how many ranks hold each share, its own rank included (NVRx's
            meaning): 1 keeps no replica, 2 one replica on a peer. Each clique of ``F`` ranks
            (``n, n + J, ..., n + (F-1)J``) exchanges its shares. ``None`` (the default) is 2 where the job
            spans several nodes (the node ranks that Lightning's cluster environment gives) and 1 on one
            node, where no other node could hold a replica: the same script then runs on a workstation and
            on a cluster.
        replication_jump: ``J``, the rank distance between a share's holders; ``None`` is the ranks per
            node, so that each replica is on another node. The world size must divide by ``J * F``.
        session: a name for this job's files, so that jobs sharing a directory do not mix: 1 to 64 of
            ``[A-Za-z0-9_.-]``, not starting with ``.`` and not ``holder-<n>`` (the tier's own names).
        timeout_s: a replication or recovery exchange that takes longer fails (never hangs); at most a year.
        emergency_signals: signals (names, or ``signal.Signals``) that request an emergency save: the next
            step boundary, all ranks agree, save to the local tier, drain and stop training. ``()`` leaves
            signals alone. SIGKILL and SIGSTOP cannot be caught, and fault signals (SIGSEGV, SIGBUS, SIGFPE,
            SIGILL, SIGABRT, SIGTRAP, SIGSYS) and SIGCHLD are not requests to stop, so they are refused.
        overlap_agreement: the tier's one small all-reduce per step is posted at a step boundary and read at
            the next, so that it runs beside the next step's compute instead of on its critical path; what
            it agrees on (a preemption, a failed local save, old steps to remove) then takes effect one step
            later on every rank. For large jobs, where the all-reduce's latency grows with the world size.

    Made on every rank with the same values; ``AsyncCheckpointIO(local=LocalTier(...))`` uses it.
    """

    dir: str | os.PathLike
    every_n_train_steps: int = 100
    replication_factor: int | None = None
    replication_jump: int | None = None
    session: str = "default"
    timeout_s: float = 600.0
    emergency_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    overlap_agreement: bool = False

    def __post_init__(self) -> None:
        import importlib.util

        if importlib.util.find_spec("nvidia_resiliency_ext") is None:
            from lightning_asyncckpt.errors import EngineNotAvailableError

            raise EngineNotAvailableError(
                "LocalTier uses nvidia-resiliency-ext's clique layout and replication:"
                " `pip install nvidia-resiliency-ext` (the \"nvrx\" engine's package; the persistent tier may still"
                " use either engine).")
        if not isinstance(self.dir, (str, os.PathLike)) or not str(self.dir):
            raise TypeError(f"LocalTier(dir=...) must be a path to a node-local directory; got {self.dir!r}.")
        object.__setattr__(self, "dir", Path(self.dir).expanduser())
        _positive_int("every_n_train_steps", self.every_n_train_steps)
        if self.replication_factor is not None:
            _positive_int("replication_factor", self.replication_factor)
        if self.replication_jump is not None:
            _positive_int("replication_jump", self.replication_jump)
        if not isinstance(self.session, str) or not _SESSION.fullmatch(self.session):
            raise ValueError(f"LocalTier(session=...) must be 1 to 64 of [A-Za-z0-9_.-]; got {self.session!r}.")
        if _OWN_ENTRY.fullmatch(self.session):  # '..' would write outside asyncckpt-local/, '.' mix with holders
            raise ValueError(f"LocalTier(session=...) may not start with '.' or be holder-<n>, names that leave or"
                             f" mix with the tier's own directories; got {self.session!r}. Fix: a plain name such as"
                             " the experiment's, e.g. session='run-42'.")
        if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float))
                or not 0 < self.timeout_s <= _LONGEST_S):
            raise ValueError(f"LocalTier(timeout_s=...) must be a number of seconds > 0 and at most {_LONGEST_S:.0f}"
                             f" (a year: every wait of the tier has a bound); got {self.timeout_s!r}.")
        if not isinstance(self.overlap_agreement, bool):
            raise ValueError(f"LocalTier(overlap_agreement=...) must be True or False; got {self.overlap_agreement!r}.")
        object.__setattr__(self, "emergency_signals", _signal_names(self.emergency_signals))

    def factor_for(self, nodes: int) -> int:
        """(every rank, at setup) ``F`` for a job on ``nodes`` nodes: ``replication_factor``, or where that is
        None, 2 on several nodes and 1 on one."""
        if self.replication_factor is not None:
            return self.replication_factor
        return 2 if nodes > 1 else 1

    @property
    def root(self) -> Path:
        """The only directory the tier writes into or removes from."""
        return Path(self.dir) / "asyncckpt-local" / self.session


def _signal_names(value: object) -> tuple[str, ...]:
    """``emergency_signals`` as names, each one a signal that can request an emergency save."""
    if value is None:
        raise TypeError("LocalTier(emergency_signals=None): give a tuple of signal names, or emergency_signals=()"
                        " to leave every signal alone.")
    if isinstance(value, (str, signal.Signals)):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"LocalTier(emergency_signals=...) must be a tuple of signal names such as ('SIGTERM',);"
                        f" got {value!r}.") from None
    names = []
    for item in items:
        name = item.name if isinstance(item, signal.Signals) else item  # signal.SIGTERM too
        if not isinstance(name, str) or not isinstance(getattr(signal, name, None), signal.Signals):
            raise ValueError(f"LocalTier(emergency_signals=...): {item!r} is not a signal name (e.g. 'SIGTERM').")
        if name in _UNCATCHABLE:
            raise ValueError(f"LocalTier(emergency_signals=...): {name} cannot be caught, so it can never request"
                             " an emergency save. Fix: the signal your scheduler sends ahead of it (SIGTERM, or"
                             " SLURM's `--signal=USR1@90`).")
        if name in _FAULTS or name in _NOT_A_REQUEST:
            why = ("reports a fault in this process: a handler that only sets a flag returns to the faulting"
                   " instruction, which faults again, forever" if name in _FAULTS else
                   "is sent whenever a child process ends (a DataLoader worker, the checkpoint writer)")
            raise ValueError(f"LocalTier(emergency_signals=...): {name} {why}; it is not a request to stop. Fix: the"
                             " signal your scheduler sends ahead of a preemption (SIGTERM, or SLURM's"
                             " `--signal=USR1@90`).")
        names.append(name)
    return tuple(names)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"LocalTier({name}=...) must be an int >= 1; got {value!r}.")
