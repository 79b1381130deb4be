"""``Settings``: what ``AsyncCheckpointIO``'s arguments decide, validated once, frozen.

Made on every rank when the plugin is made (and again, validated again, when a setting is assigned);
read by the pipeline's functions, which get this value, never the plugin itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_asyncckpt import engines
from lightning_asyncckpt.snapshot.lazy import SNAPSHOT_MODES

FORMATS = ("auto", "dcp")
SNAPSHOTS = SNAPSHOT_MODES


@dataclass(frozen=True)
class Settings:
    """Attributes:
        engine_name: the engine ``strategy`` resolved to.
        worker_mode: one persistent worker per writing rank, or a process forked per save.
        thread_count: shard files (and writer threads) per rank and save.
        timeout_s: a write still running after this long fails its save (its worker is killed).
        max_pending: saves in flight per rank; the next save first waits for the oldest write.
        poll_interval_s: the sleep between checks while a blocking wait polls.
        drain_timeout_s: how long the saves in flight may take to land on the way out of an exception.
        format: ``"auto"`` (stock's formats) or ``"dcp"`` (single-writer saves as DCP directories too).
        snapshot: ``"eager"`` or ``"lazy"`` (the parameters and optimizer state copied in the background).
        worker_nice: the writer processes' nice value, 0 to 19.
    """

    engine_name: engines.EngineName
    worker_mode: engines.WorkerMode
    thread_count: int = 1
    timeout_s: float = 1800.0
    max_pending: int = 2
    poll_interval_s: float = 0.02
    drain_timeout_s: float = 300.0
    format: str = "auto"
    snapshot: str = "eager"
    worker_nice: int = 0

    def __post_init__(self) -> None:
        for name, ok, want in (
            ("thread_count", self.thread_count >= 1, "at least 1"), ("max_pending", self.max_pending >= 1, "at least 1"),
            ("timeout_s", self.timeout_s > 0, "positive"), ("drain_timeout_s", self.drain_timeout_s >= 0, "at least 0"),
            ("poll_interval_s", self.poll_interval_s > 0, "positive"),
        ):
            if not ok:
                raise ValueError(f"`AsyncCheckpointIO({name}={getattr(self, name)})` must be {want}.")
        if self.format not in FORMATS:
            raise ValueError(
                f"`AsyncCheckpointIO(format={self.format!r})` is not valid; choose one of {', '.join(map(repr, FORMATS))}."
            )
        nice = self.worker_nice
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ValueError(
                f"`AsyncCheckpointIO(worker_nice={nice!r})` must be an integer nice value from 0 (the trainer's "
                "priority) to 19 (the lowest)."
            )
        if self.snapshot not in SNAPSHOTS:
            raise ValueError(
                f"`AsyncCheckpointIO(snapshot={self.snapshot!r})` is not valid; choose one of "
                f"{', '.join(map(repr, SNAPSHOTS))}."
            )
        object.__setattr__(self, "timeout_s", float(self.timeout_s))
        object.__setattr__(self, "drain_timeout_s", float(self.drain_timeout_s))

    @property
    def engine(self) -> str:
        """``"nvrx"`` or ``"mcore"``."""
        return self.engine_name.value

    @property
    def worker(self) -> str:
        """``"persistent"`` or ``"fork"``."""
        return self.worker_mode.value
