"""NVIDIA Resiliency Extension's async checkpoint queue (0.4.1 to 0.7.x, detected by feature)."""

from __future__ import annotations

from lightning_asyncckpt.engines.base import Engine, engine_version


class NvrxEngine(Engine):
    name = "nvrx"
    pip_extra = "nvidia-resiliency-ext"

    def __init__(self, worker: str, rank: int = 0, nice: int = 0, scratch_dir: str | None = None):
        from nvidia_resiliency_ext.checkpointing.async_ckpt import core, filesystem_async

        super().__init__(core, filesystem_async, worker, rank, nice, scratch_dir)
        self.version = engine_version("nvidia-resiliency-ext")
