"""``Settings``: what ``AsyncCheckpointIO``'s arguments decide, validated once, frozen.

Made on every rank when the plugin is made (and again, validated again, when a setting is assigned);
read by the pipeline's functions, which get this value, never the plugin itself.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass

from lightning_asyncckpt import engines


class SaveFormat(str, enum.Enum):
    """``format=``: what a single-writer save writes."""

    AUTO = "auto"  # stock's formats: a torch.save file where stock writes one
    DCP = "dcp"  # a DCP directory for every save


class SnapshotMode(str, enum.Enum):
    """``snapshot=``: when the state is copied."""

    EAGER = "eager"  # inside the save call
    LAZY = "lazy"  # the tracked optimizers' parameters and state in the background, before the next step


FORMATS = tuple(f.value for f in SaveFormat)
SNAPSHOTS = tuple(m.value for m in SnapshotMode)  # as snapshot.lazy.SNAPSHOT_MODES
# Every wait has a bound, and one a thread can wait for: `threading` refuses timeouts past about 292 years
# (OverflowError), and a save that may take longer than a year never ends in practice.
LONGEST_S = 365 * 24 * 3600.0
LONGEST_POLL_S = 60.0  # a blocking wait checks at least once a minute


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
        for name, minimum in (("thread_count", 1), ("max_pending", 1)):
            object.__setattr__(self, name, _integer(name, getattr(self, name), minimum))
        for name, positive, longest in (("timeout_s", True, LONGEST_S), ("drain_timeout_s", False, LONGEST_S),
                                        ("poll_interval_s", True, LONGEST_POLL_S)):
            object.__setattr__(self, name, _seconds(name, getattr(self, name), positive, longest))
        if not isinstance(self.format, str) or self.format not in FORMATS:
            raise ValueError(
                f"`AsyncCheckpointIO(format={self.format!r})` is not valid; choose one of {', '.join(map(repr, FORMATS))}."
            )
        nice = self.worker_nice
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ValueError(
                f"`AsyncCheckpointIO(worker_nice={nice!r})` must be an integer nice value from 0 (the trainer's "
                "priority) to 19 (the lowest)."
            )
        if not isinstance(self.snapshot, str) or self.snapshot not in SNAPSHOTS:
            raise ValueError(
                f"`AsyncCheckpointIO(snapshot={self.snapshot!r})` is not valid; choose one of "
                f"{', '.join(map(repr, SNAPSHOTS))}."
            )

    @property
    def save_format(self) -> SaveFormat:
        return SaveFormat(self.format)

    @property
    def snapshot_mode(self) -> SnapshotMode:
        return SnapshotMode(self.snapshot)

    @property
    def engine(self) -> str:
        """``"nvrx"`` or ``"mcore"``."""
        return self.engine_name.value

    @property
    def worker(self) -> str:
        """``"persistent"`` or ``"fork"``."""
        return self.worker_mode.value


def _given(name: str, value: object) -> str:
    return f"`AsyncCheckpointIO({name}={value!r})`"


def _as_string_hint(value: object) -> str:
    """The fix for a number given as a string (from a config file or the command line)."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return f" Fix: pass the number {value.strip()}, not a string."
    return ""


def _integer(name: str, value: object, minimum: int) -> int:
    """``value`` as an ``int`` (numpy's integers too), or a ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{_given(name, value)} must be an integer, at least {minimum}; got {type(value).__name__}."
                        + (_as_string_hint(value) or f" Fix: pass e.g. {name}={max(minimum, 2)}."))
    if value < minimum:
        raise ValueError(f"{_given(name, value)} must be an integer, at least {minimum}.")
    return int(value)


def _seconds(name: str, value: object, positive: bool, longest: float) -> float:
    """``value`` as a ``float`` number of seconds, finite, positive (or at least 0) and at most ``longest``."""
    bound = f"{'>' if positive else '>='} 0 and at most {longest:.0f}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{_given(name, value)} must be a number of seconds {bound}; got {type(value).__name__}."
                        + _as_string_hint(value))
    seconds = float(value)
    if not math.isfinite(seconds) or not (seconds > 0 if positive else seconds >= 0) or seconds > longest:
        raise ValueError(f"{_given(name, value)} must be a number of seconds {bound} (every wait has a bound).")
    return seconds
