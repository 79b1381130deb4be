"""``ckpt_path="last"`` with a local tier: the newest step complete in either tier.

Lightning resolves ``"last"`` before the process group exists, so it cannot ask the other ranks what
their local directories hold. This module makes the decision later, where every rank is up:

- ``_CheckpointConnector._parse_ckpt_path``: for ``fit(ckpt_path="last")`` with a local tier, keeps the persistent
  candidate Lightning found (or None) inside a :class:`TierLast`, and silences Lightning's "no last
  checkpoint" warning (the local tier may have one);
- ``_CheckpointConnector.resume_start`` (every rank, after setup): first names the run
  (``TierRun.begin``): a fit with no checkpoint to resume from starts a new run, any other adopts the run
  whose local steps were written for the same persistent destination (the dirpaths of the trainer's
  ``ModelCheckpoint`` callbacks, or ``default_root_dir`` without one; :mod:`~lightning_asyncckpt.tiers.run_identity`);
  then a :class:`TierLast` becomes ``TierRun.latest(persistent, weights_only)``, the local tier's key or the
  persistent path; then Lightning loads it. ``weights_only`` is the caller's (``fit(..., weights_only=...)``):
  the local step is read as the file would be.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning_asyncckpt.integration import patches, tier_trainer
from lightning_asyncckpt.tiers import run_identity


class TierLast(str):
    """``"last"``, carrying the persistent checkpoint Lightning found for it (None: none)."""

    persistent: Any

    def __new__(cls, persistent: Any) -> TierLast:
        self = super().__new__(cls, "last")
        self.persistent = persistent
        return self


def _io_with_tier(trainer: Any) -> Any:
    from lightning_asyncckpt.integration.io import find_async_io

    io = find_async_io(getattr(trainer, "strategy", None))
    return io if io is not None and io.local is not None else None


def destination(trainer: Any) -> str:
    """Where the trainer's persistent checkpoints go, as a run's record names it: the ``dirpath`` of each
    checkpoint callback (resolved at their setup), or ``default_root_dir`` where there is none."""
    dirs = [cb.dirpath for cb in getattr(trainer, "checkpoint_callbacks", []) if getattr(cb, "dirpath", None)]
    return run_identity.destination_of(dirs or [trainer.default_root_dir])


def install() -> None:
    """(any process, idempotent) Wraps the two methods as described above."""
    from lightning_asyncckpt.integration.lightning_api import trainer_module

    connector = trainer_module("trainer.connectors.checkpoint_connector")._CheckpointConnector

    def make_parse(original: Any) -> Any:
        def _parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
            fitting = getattr(state_fn, "value", state_fn) == "fit"  # validate/test/predict: as Lightning has it
            if ckpt_path != "last" or not fitting or _io_with_tier(self.trainer) is None:
                return original(self, state_fn, ckpt_path, *args, **kwargs)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*there is no last checkpoint available.*")
                return TierLast(original(self, state_fn, ckpt_path, *args, **kwargs))

        return _parse_ckpt_path

    def make_resume(original: Any) -> Any:
        def resume_start(self: Any, checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> Any:
            io = _io_with_tier(self.trainer)
            last = isinstance(checkpoint_path, TierLast)
            tier = tier_trainer.start(self.trainer, io) if last else io.session.tier if io is not None else None
            if tier is not None:  # a fit's: the run named before any local save or restore
                tier.begin(destination(self.trainer), resuming=last or bool(checkpoint_path))
            if last:
                # fit(..., weights_only=...): the local step's headers are read as Lightning reads the file
                weights_only = kwargs.get("weights_only", args[0] if args else None)
                persistent = checkpoint_path.persistent
                checkpoint_path = tier.latest(persistent, weights_only) if tier is not None else persistent
            return original(self, checkpoint_path, *args, **kwargs)

        return resume_start

    patches.wrap_class(connector, "_parse_ckpt_path", make_parse)
    patches.wrap_class(connector, "resume_start", make_resume)
