"""The one named interface between Lightning's side and the save session.

Lightning's side is the finalizer callback, the strategies (``strategies.py``, ``fabric.py``) and the local
tier's hooks (``tier_trainer.py``, ``tier_fabric.py``). They reach the plugin's session through
``AsyncCheckpointIO.session`` and call only what :class:`SessionInterface` names; they set none of its
attributes. What a strategy can do is declared by the strategy, as a :class:`StrategyCapabilities` value
(:class:`AsyncSaveStrategy`), and read through :func:`capabilities_of`: stock strategies have the defaults.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from lightning_asyncckpt.pipeline.pipeline import AttachedTier
from lightning_asyncckpt.pipeline.records import SaveRecord
from lightning_asyncckpt.pipeline.settings import Settings

if TYPE_CHECKING:
    import torch

    from lightning_asyncckpt.snapshot.staging import Defer


@dataclass(frozen=True)
class StrategyCapabilities:
    """What a strategy's saves are like, as the callback and the tier hooks need to know.

    Attributes:
        all_ranks_write: every rank calls the plugin for every save (``AsyncDDPStrategy``, sharded saves): the
            callback starts the worker on every rank and the run's collective saves get their exit group at
            setup. False: Lightning calls the plugin on global rank 0 only (stock strategies).
        own_state_layout: the strategy builds its own state layout (sharded ``DTensor`` state dicts): the
            callback does not allocate staging buffers from the module's ``state_dict`` ahead of the first save.
    """

    all_ranks_write: bool = False
    own_state_layout: bool = False


@runtime_checkable
class AsyncSaveStrategy(Protocol):
    """A strategy of this package: it declares its capabilities, and how its state dicts are built for the
    local tier."""

    save_capabilities: ClassVar[StrategyCapabilities]

    def local_tier_state(self) -> contextlib.AbstractContextManager[None]:
        """(all ranks, while a local-tier checkpoint is built) Each rank's own shards in the state dicts."""
        ...


def capabilities_of(strategy: object) -> StrategyCapabilities:
    """The capabilities ``strategy`` declares; a stock strategy's are the defaults."""
    return strategy.save_capabilities if isinstance(strategy, AsyncSaveStrategy) else StrategyCapabilities()


@contextlib.contextmanager
def local_tier_state(strategy: object) -> Iterator[None]:
    """(all ranks) While a local-tier checkpoint is built: each rank's own shards where the strategy can give
    them (``AsyncModelParallelStrategy``, even where its persistent saves gather a full state); else nothing."""
    if isinstance(strategy, AsyncSaveStrategy):
        with strategy.local_tier_state():
            yield
    else:
        yield


class SessionInterface(Protocol):
    """What Lightning's side calls on ``AsyncCheckpointIO.session``
    (:class:`~lightning_asyncckpt.pipeline.pipeline.SaveSession`), and who calls it when."""

    settings: Settings
    history: list[SaveRecord]

    @property
    def saves_scheduled(self) -> int:
        """(any rank; the logger relay) This rank's save calls so far."""
        ...

    def saves_settled(self, mark: int, since: int = 0) -> bool | None:
        """(any rank; the logger relay) Whether the save calls ``since + 1`` to ``mark`` settled (None: pending)."""
        ...

    def hold_removals(self, held: bool) -> None:
        """(this rank; the logger relay) Top-k removals wait while held."""
        ...

    def begin_run(self, collective: bool) -> None:
        """(all ranks, together, the callback's ``setup``) Saves are finalized from now on."""
        ...

    def warmup(self, like: dict[str, object] | None = None) -> None:
        """(writing ranks, the callback's ``setup`` for fit) Starts the worker."""
        ...

    def announce(self) -> None:
        """(all ranks, as Lightning builds a checkpoint) Counts a save some rank will make."""
        ...

    def prepare(self, like: dict[str, object], distributed: bool) -> None:
        """(writing ranks, after the first optimizer step) Allocates staging buffers like ``like``."""
        ...

    def track_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """(all ranks, train start and each save) The optimizers a lazy snapshot copies behind."""
        ...

    def lazy_rule(self) -> Defer | None:
        """(the training thread, a local-tier save) Which tensors a lazy local save may copy later."""
        ...

    def wait_for_snapshot(self) -> None:
        """(all ranks, right before the optimizer step) Waits for lazy copies, persistent and local."""
        ...

    def wait_for_local_writes(self) -> None:
        """(this rank, no collectives; before a SLURM requeue) Waits for this rank's writes."""
        ...

    def is_pending(self, path: Path | str) -> bool:
        """(global rank 0, as ModelCheckpoint picks a name) Whether a save to ``path`` is in flight."""
        ...

    def finalize(self, blocking: bool = False, *, only_if_pending: bool = False) -> None:
        """(all ranks, same order) Commits finished saves; raises a failed one on every rank."""
        ...

    def abort(self) -> None:
        """(the ranks that raised; never raises) Drains what is in flight, then stops."""
        ...

    @property
    def tier(self) -> AttachedTier | None:
        """(every rank) The local tier's run, when attached."""
        ...

    def attach_tier(self, tier: AttachedTier) -> None:
        """(every rank, at setup) Attaches the local tier's run."""
        ...

    def detach_tier(self) -> AttachedTier | None:
        """(every rank, as the local tier closes) Detaches it and returns it."""
        ...

    def take_restored(self, key: Path | str) -> dict[str, object] | None:
        """(every rank, at a load) The local tier's fetched checkpoint for ``key``, once."""
        ...
