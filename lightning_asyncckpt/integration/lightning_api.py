"""Which Lightning this process uses, and every Lightning class the package builds on, from one place.

Lightning ships as two distributions with the same code under different names:

- ``pip install lightning``: ``lightning.pytorch`` and ``lightning.fabric``;
- ``pip install pytorch-lightning``: ``pytorch_lightning`` and ``lightning_fabric`` (no ``lightning``).

Their classes are distinct: a ``pytorch_lightning.Trainer`` accepts only ``lightning_fabric``'s
``CheckpointIO`` and ``pytorch_lightning``'s callbacks and strategies. The package builds on ``lightning``
when it is installed, else on ``pytorch_lightning``; ``LIGHTNING_ASYNCCKPT_LIGHTNING=pytorch_lightning``
picks the standalone one where both are installed (set it before the package is imported). Where both are
installed, ``AsyncCheckpointIO`` is also registered as the other distribution's ``CheckpointIO`` (an
abstract base class), so that either Trainer accepts it as a plugin.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import FrameType, ModuleType

ENV_VAR = "LIGHTNING_ASYNCCKPT_LIGHTNING"
# distribution -> (its package on PyPI, the trainer package, the fabric package)
DISTRIBUTIONS = {
    "lightning": ("lightning", "lightning.pytorch", "lightning.fabric"),
    "pytorch_lightning": ("pytorch-lightning", "pytorch_lightning", "lightning_fabric"),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _choose() -> str:
    wanted = os.environ.get(ENV_VAR, "").strip()
    if wanted:
        if wanted not in DISTRIBUTIONS:
            raise ValueError(f"{ENV_VAR}={wanted!r} is not valid; choose one of {', '.join(DISTRIBUTIONS)}.")
        if not _installed(DISTRIBUTIONS[wanted][1]):
            raise ImportError(f"{ENV_VAR}={wanted} but {wanted} is not installed. Fix: pip install {DISTRIBUTIONS[wanted][0]}")
        return wanted
    for name, (_, trainer_pkg, _fabric) in DISTRIBUTIONS.items():
        if _installed(trainer_pkg):
            return name
    raise ImportError(
        "lightning-asyncckpt needs Lightning: neither `lightning` nor `pytorch_lightning` is installed."
        " Fix: pip install lightning (or pip install pytorch-lightning)"
    )


NAME = _choose()
PACKAGE, _TRAINER, _FABRIC = DISTRIBUTIONS[NAME]
OTHER = next((n for n in DISTRIBUTIONS if n != NAME and _installed(DISTRIBUTIONS[n][1])), None)


def trainer_module(sub: str = "") -> ModuleType:
    """``lightning.pytorch[.sub]`` or ``pytorch_lightning[.sub]``."""
    return importlib.import_module(_TRAINER + (f".{sub}" if sub else ""))


def fabric_module(sub: str = "") -> ModuleType:
    """``lightning.fabric[.sub]`` or ``lightning_fabric[.sub]``."""
    return importlib.import_module(_FABRIC + (f".{sub}" if sub else ""))


_plugins = fabric_module("plugins")
CheckpointIO = _plugins.CheckpointIO
TorchCheckpointIO = _plugins.TorchCheckpointIO
FabricModelParallelStrategy = fabric_module("strategies").ModelParallelStrategy

_pl = trainer_module()
Callback = _pl.Callback
LightningModule = _pl.LightningModule
Trainer = _pl.Trainer
DDPStrategy = trainer_module("strategies").DDPStrategy
ModelParallelStrategy = trainer_module("strategies").ModelParallelStrategy
ModelCheckpoint = trainer_module("callbacks").ModelCheckpoint


def dump_checkpoint(trainer: Trainer) -> dict:
    """(all ranks) The checkpoint ``ModelCheckpoint`` would save now: the Trainer's own
    ``_checkpoint_connector.dump_checkpoint`` (Lightning has no public way to build it without writing it),
    with every callback's ``on_save_checkpoint`` run. Used by the local tier's saves
    (:mod:`~lightning_asyncckpt.integration.tier_trainer`)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def register_with_the_other(cls: type) -> None:
    """(at import) Where both distributions are installed, makes ``cls`` (a ``CheckpointIO``) count as the
    other distribution's ``CheckpointIO`` too, so that either Trainer accepts it."""
    if OTHER is not None:
        other_io = importlib.import_module(DISTRIBUTIONS[OTHER][2] + ".plugins").CheckpointIO
        other_io.register(cls)


# the modules of the strategies' base classes, in both distributions: whose ``load_checkpoint`` runs on every rank
_STRATEGY_BASES = {f"{package}.strategies.strategy" for names in DISTRIBUTIONS.values() for package in names[1:]}


def is_strategy_load(frame: FrameType | None) -> bool:
    """(any rank, local) Whether ``frame`` is a Lightning strategy's ``load_checkpoint`` (the Trainer's or Fabric's,
    either distribution, or a subclass's), the caller of ``CheckpointIO.load_checkpoint`` that every rank runs
    together: Lightning's resume (``fit(ckpt_path=...)``) and Fabric's ``load`` (documented: all processes).
    Anything else may be a single rank's call (a user's, in a callback on rank 0), which must not wait for the
    other ranks."""
    if frame is None or frame.f_code.co_name != "load_checkpoint":
        return False
    owner = frame.f_locals.get("self")
    return owner is not None and any(c.__name__ == "Strategy" and c.__module__ in _STRATEGY_BASES
                                     for c in type(owner).__mro__)
