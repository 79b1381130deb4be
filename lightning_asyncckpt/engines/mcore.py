"""Megatron-Core's async checkpoint queue, for users who have not moved to nvrx."""

from __future__ import annotations

from lightning_asyncckpt.engines.base import Engine, engine_version


class McoreEngine(Engine):
    name = "mcore"
    pip_extra = "lightning-asyncckpt[mcore]"

    def __init__(self, worker: str, rank: int = 0, nice: int = 0, scratch_dir: str | None = None):
        from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async

        super().__init__(async_utils, filesystem_async, worker, rank, nice, scratch_dir)
        self.version = engine_version("megatron-core")
