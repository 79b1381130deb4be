"""``ckpt_path="last"`` with a local tier: the newest step complete in either tier.

Lightning resolves ``"last"`` before the process group exists, so it cannot ask the other ranks what
their local directories hold. This module makes the decision later, where every rank is up, through two
wrappers on the checkpoint connector of each trainer that uses the plugin (:func:`attach`; no other trainer's):

- ``_parse_ckpt_path``: for ``fit(ckpt_path="last")`` with a local tier, keeps the persistent
  candidate Lightning found (or None) inside a :class:`TierLast`, and silences Lightning's "no last
  checkpoint" warning (the local tier may have one);
- ``resume_start`` (every rank, after setup): first names the run
  (``TierRun.begin``): a fit with no checkpoint to resume from starts a new run, any other adopts the run
  whose local steps were written for the same persistent destination (the dirpaths of the trainer's
  ``ModelCheckpoint`` callbacks, or ``default_root_dir`` without one; :mod:`~lightning_asyncckpt.tiers.run_identity`);
  then a :class:`TierLast` becomes ``TierRun.latest(persistent, weights_only)``, the local tier's key or the
  persistent path; then Lightning loads it. ``weights_only`` is the caller's (``fit(..., weights_only=...)``):
  the local step is read as the file would be.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_asyncckpt.integration import patches, resume, tier_trainer
from lightning_asyncckpt.tiers import run_identity

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_asyncckpt.integration.io import AsyncCheckpointIO


class TierLast(str):
    """``"last"``, carrying the persistent checkpoint Lightning found for it (None: none)."""

    persistent: Path | str | None

    def __new__(cls, persistent: Path | str | None) -> TierLast:
        self = super().__new__(cls, "last")
        self.persistent = persistent
        return self


def _io_with_tier(trainer: Trainer) -> AsyncCheckpointIO | None:
    from lightning_asyncckpt.integration.io import find_async_io

    io = find_async_io(getattr(trainer, "strategy", None))
    return io if io is not None and io.local is not None else None


def destination(trainer: Trainer) -> str:
    """Where the trainer's persistent checkpoints go, as a run's record names it: the ``dirpath`` of each
    checkpoint callback (resolved at their setup), or ``default_root_dir`` where there is none."""
    dirs = [cb.dirpath for cb in getattr(trainer, "checkpoint_callbacks", []) if getattr(cb, "dirpath", None)]
    return run_identity.destination_of(dirs or [trainer.default_root_dir])


def attach(trainer: Trainer) -> None:
    """(every rank, as a Trainer that uses the plugin is made: :mod:`~lightning_asyncckpt.integration.autoattach`)
    Wraps the two methods of ``trainer``'s own checkpoint connector, for that trainer's life, as described
    above; no other trainer is touched. The wrappers pickle with the trainer (``ddp_spawn``)."""
    connector = trainer._checkpoint_connector
    patches.hook_method(connector, "_parse_ckpt_path", _parse_ckpt_path)
    patches.hook_method(connector, "resume_start", _resume_start)


def _parse_ckpt_path(original: Callable[..., Path | str | None], state_fn: object, ckpt_path: Path | str | None,
                     *args: object, **kwargs: object) -> Path | str | None:
    """Lightning's ``_parse_ckpt_path`` (``original``, bound to the connector); for ``"last"``, remote names keep
    their scheme (:func:`~lightning_asyncckpt.integration.resume.schemes_kept`), and a fit with a local tier
    gets a :class:`TierLast`."""
    if ckpt_path != "last":
        return original(state_fn, ckpt_path, *args, **kwargs)
    trainer = original.__self__.trainer
    with resume.schemes_kept(trainer):
        fitting = getattr(state_fn, "value", state_fn) == "fit"  # validate/test/predict: as Lightning has it
        if not fitting or _io_with_tier(trainer) is None:
            return original(state_fn, ckpt_path, *args, **kwargs)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*there is no last checkpoint available.*")
            return TierLast(original(state_fn, ckpt_path, *args, **kwargs))


def _resume_start(original: Callable[..., None], checkpoint_path: Path | str | None = None, *args: object,
                  **kwargs: object) -> None:
    """Lightning's ``resume_start`` (``original``, bound to the connector), after the local tier's run is named
    and a :class:`TierLast` is resolved to the newest step complete in either tier."""
    trainer = original.__self__.trainer
    io = _io_with_tier(trainer)
    last = isinstance(checkpoint_path, TierLast)
    tier = tier_trainer.start(trainer, io) if last else io.session.tier if io is not None else None
    if tier is not None:  # a fit's: the run named before any local save or restore
        tier.begin(destination(trainer), resuming=last or bool(checkpoint_path))
    if last:
        # fit(..., weights_only=...): the local step's headers are read as Lightning reads the file
        weights_only = kwargs.get("weights_only", args[0] if args else None)
        persistent = checkpoint_path.persistent
        checkpoint_path = tier.latest(persistent, weights_only) if tier is not None else persistent
    return original(checkpoint_path, *args, **kwargs)
