"""Asynchronous, distributed and safe checkpointing for PyTorch Lightning and Fabric.

Public names are imported lazily, so that the background worker (which imports
``lightning_asyncckpt._worker``) starts without importing Lightning.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"
__all__ = [
    "AsyncCheckpointIO",
    "AsyncDDPStrategy",
    "AsyncFabricModelParallelStrategy",
    "AsyncFinalizerCallback",
    "AsyncModelParallelStrategy",
    "CheckpointWriteError",
    "SaveRecord",
    "last_checkpoint",
]

if TYPE_CHECKING:
    from lightning_asyncckpt.callback import AsyncFinalizerCallback
    from lightning_asyncckpt.errors import CheckpointWriteError
    from lightning_asyncckpt.fabric import AsyncFabricModelParallelStrategy
    from lightning_asyncckpt.io import AsyncCheckpointIO, SaveRecord
    from lightning_asyncckpt.remote import last_checkpoint
    from lightning_asyncckpt.strategies import AsyncDDPStrategy, AsyncModelParallelStrategy

_LOCATIONS = {
    "AsyncCheckpointIO": "lightning_asyncckpt.io",
    "AsyncDDPStrategy": "lightning_asyncckpt.strategies",
    "AsyncFabricModelParallelStrategy": "lightning_asyncckpt.fabric",
    "AsyncFinalizerCallback": "lightning_asyncckpt.callback",
    "AsyncModelParallelStrategy": "lightning_asyncckpt.strategies",
    "CheckpointWriteError": "lightning_asyncckpt.errors",
    "SaveRecord": "lightning_asyncckpt.io",
    "last_checkpoint": "lightning_asyncckpt.remote",
}


def __getattr__(name: str) -> Any:
    if name in _LOCATIONS:
        import importlib

        return getattr(importlib.import_module(_LOCATIONS[name]), name)
    raise AttributeError(f"module 'lightning_asyncckpt' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(__all__ + ["__version__"])
