"""Asynchronous, distributed and safe checkpointing for PyTorch Lightning and Fabric.

Public names are imported lazily, so that the background worker (which imports
``lightning_asyncckpt.write.worker``) starts without importing Lightning.
"""

from typing import TYPE_CHECKING, Any

from lightning_asyncckpt.version import __version__ as __version__

__all__ = [
    "AsyncCheckpointIO",
    "AsyncDDPStrategy",
    "AsyncFabricModelParallelStrategy",
    "AsyncFinalizerCallback",
    "AsyncModelParallelStrategy",
    "CheckpointWriteError",
    "FabricTiers",
    "LocalTier",
    "SaveRecord",
    "last_checkpoint",
]

if TYPE_CHECKING:
    from lightning_asyncckpt.errors import CheckpointWriteError
    from lightning_asyncckpt.integration.callback import AsyncFinalizerCallback
    from lightning_asyncckpt.integration.fabric import AsyncFabricModelParallelStrategy
    from lightning_asyncckpt.integration.io import AsyncCheckpointIO, SaveRecord
    from lightning_asyncckpt.integration.strategies import AsyncDDPStrategy, AsyncModelParallelStrategy
    from lightning_asyncckpt.integration.tier_fabric import FabricTiers
    from lightning_asyncckpt.storage.remote import last_checkpoint
    from lightning_asyncckpt.tiers.config import LocalTier

_LOCATIONS = {
    "AsyncCheckpointIO": "lightning_asyncckpt.integration.io",
    "AsyncDDPStrategy": "lightning_asyncckpt.integration.strategies",
    "AsyncFabricModelParallelStrategy": "lightning_asyncckpt.integration.fabric",
    "AsyncFinalizerCallback": "lightning_asyncckpt.integration.callback",
    "AsyncModelParallelStrategy": "lightning_asyncckpt.integration.strategies",
    "CheckpointWriteError": "lightning_asyncckpt.errors",
    "FabricTiers": "lightning_asyncckpt.integration.tier_fabric",
    "LocalTier": "lightning_asyncckpt.tiers.config",
    "SaveRecord": "lightning_asyncckpt.integration.io",
    "last_checkpoint": "lightning_asyncckpt.storage.remote",
}


def __getattr__(name: str) -> Any:
    if name in _LOCATIONS:
        import importlib

        return getattr(importlib.import_module(_LOCATIONS[name]), name)
    raise AttributeError(f"module 'lightning_asyncckpt' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(__all__ + ["__version__"])
