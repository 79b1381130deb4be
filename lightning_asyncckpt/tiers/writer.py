"""The background thread that writes a packed share and replicates it to the clique.

One share at a time: the next local save first waits for this one (:meth:`ShareWriter.wait`). The thread
talks only over the clique's own gloo group, never the training's, so it runs beside training steps.
A failure is kept as text and raised on every rank at the next step boundary, never in this thread.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from lightning_asyncckpt.tiers.packing import Packed, crc32
from lightning_asyncckpt.tiers.store import LocalStore


class ShareWriter:
    """(one rank) Writes its own share and, with replication, the shares of its clique peers."""

    def __init__(self, store: LocalStore, rank: int, group: dist.ProcessGroup | None, topology: tuple) -> None:
        self.store, self.rank, self.group, self.topology = store, rank, group, topology
        self.newest_done = -1  # the newest step whose shares this rank holds in full
        self.error: str | None = None
        self.last_write_s: float | None = None
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: float) -> bool:
        """Waits for the share being written; False if it is still running after ``timeout_s``."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return not self.busy

    def submit(self, step: int, packed: Packed) -> None:
        assert not self.busy, "a share is still being written"
        self._thread = threading.Thread(target=self._job, args=(step, packed), name=f"asyncckpt-local-{step}",
                                        daemon=True)
        self._thread.start()

    def _job(self, step: int, packed: Packed) -> None:
        start = time.perf_counter()
        try:
            from lightning_asyncckpt.tiers.replication import (  # nvidia-resiliency-ext
                ShareStateDict,
                replicate,
            )

            parts = [packed.prefix(), packed.flat]
            own = ShareStateDict(step, self.rank, crc32(parts), parts)
            received = replicate(own, self.group) if self.group is not None else [own]
            # a replica keeps its owner's CRC32, checked before any use (recovery): not computed again here
            for sd in received:
                self.store.write(step, sd.owner, list(sd.tensors), sd.crc32, self.topology, packed.mode)
            del own, received, parts
            self.newest_done = step
        except BaseException as e:  # noqa: BLE001 - kept, and raised on every rank at the next boundary
            self.error = f"local save of step {step}: {type(e).__name__}: {e}"
        finally:
            self.last_write_s = time.perf_counter() - start
