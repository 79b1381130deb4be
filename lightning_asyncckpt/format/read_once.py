"""Read-once resume of a ``torch.save`` file: with ``W`` ranks loading the same file together (Lightning's
resume and Fabric's ``load`` run on every rank), each rank reads about ``1/W`` of its bytes from the shared
storage (one contiguous byte range, ``os.preadv`` straight into the final buffer) and the ranks exchange the
rest over the job's process group (:mod:`~lightning_asyncckpt.collectives.shares`). The shared storage serves
each byte once per resume instead of ``W`` times.

What every rank then holds is the whole file in memory: the load goes on from those bytes as from the file
(the CRC32 of every record checked on them, ``weights_only`` as asked). Where the exchange cannot run, the
caller reads the file as before, after one log line saying why: no process group, a world of one, ranks that
disagree on the path or the file's size (or cannot open it), or a rank whose read of its share failed.

Memory: each rank holds the file's bytes (plus under ``W`` bytes of padding) and one round's chunks
(:func:`~lightning_asyncckpt.collectives.shares.chunk_for`); the load then builds the state from them, so the
peak while loading is the file plus the state, as for a load from any in-memory buffer.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from lightning_asyncckpt.collectives import groups, shares
from lightning_asyncckpt.format.regular_files import CorruptCheckpointError, open_regular

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedRead:
    """The file's bytes on this rank after a read-once exchange.

    Attributes:
        data: the file's bytes, in memory.
        read: the bytes this rank read from the storage itself (its share).
        world: the ranks that shared the read.
        rounds: the exchange's rounds.
    """

    data: memoryview
    read: int
    world: int
    rounds: int


def read_together(path: Path) -> SharedRead | None:
    """(all ranks of the default group, together, the same ``path``: a load that Lightning or Fabric runs on
    every rank) The file's bytes, each rank reading its share once and receiving the others'; None, after one
    log line saying why, where the exchange cannot run (then every rank returns None alike and reads the
    file as before). An error of the process group during the exchange (a rank gone) is raised on the ranks
    left, within the group's timeout.

    Args:
        path: a local ``torch.save`` file (a regular file: checked as it is opened).

    Returns:
        the bytes and what this rank read, or None."""
    world = groups.world_size() if groups.is_distributed() else 1
    if world <= 1:
        why = "no process group" if not groups.is_distributed() else "a world of one rank"
        log.info("lightning-asyncckpt: %s read by this rank alone (%s)", path, why)
        return None
    try:
        f = open_regular(path)
    except (OSError, CorruptCheckpointError) as e:
        f, identity = None, (os.fspath(path), f"cannot open: {type(e).__name__}")
    else:
        identity = (os.fspath(path), os.fstat(f.fileno()).st_size)
    try:
        seen = shares.all_same(identity)
        if any(other != identity for other in seen):
            log.warning("lightning-asyncckpt: %s read by every rank alone: the ranks disagree on the file (%s)",
                        path, shares.describe(seen))
            return None
        assert f is not None  # every rank opened it: all identities hold a size
        size = identity[1]
        share = shares.share_of(size, world)
        buffer = bytearray(world * share)
        me = groups.rank()
        start, end = min(me * share, size), min((me + 1) * share, size)
        problem = _read_range(f, memoryview(buffer)[start:end], start)
        if shares.any_failed(problem is not None):
            log.warning("lightning-asyncckpt: %s read by every rank alone: a rank could not read its share%s",
                        path, f" (this rank: {problem})" if problem else "")
            return None
        rounds = shares.exchange(buffer, size)
        return SharedRead(memoryview(buffer)[:size], end - start, world, rounds)
    finally:
        if f is not None:
            f.close()


def _read_range(f: object, into: memoryview, offset: int) -> str | None:
    """Reads ``len(into)`` bytes of the open file ``f`` at ``offset`` into ``into``; what went wrong, or None."""
    fd = f.fileno()  # type: ignore[attr-defined]  # an open file
    done = 0
    try:
        while done < len(into):
            n = os.preadv(fd, [into[done:]], offset + done)
            if n == 0:
                return f"the file ended at byte {offset + done}, before its agreed size"
            done += n
    except OSError as e:
        return f"{e.strerror or e}"
    return None
