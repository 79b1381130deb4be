"""The tier's gather of small Python objects (two real gloo ranks): small objects in one collective, and an
object too large for its slot on one rank only still reaches every rank whole."""

from __future__ import annotations

from lightning_asyncckpt.collectives import SLOT, slot_for
from lightning_asyncckpt.collectives import gather_objects as all_gather_objects
from processes import two_ranks


def _gathers(rank, _root):
    import torch.distributed as dist

    small = all_gather_objects({"rank": rank, "problems": [], "crc": {rank: 0xDEADBEEF}})
    none = all_gather_objects(None)
    # only rank 1's object is too large for its slot: both ranks must take the second collective
    big = all_gather_objects(b"x" * (3 * SLOT) if rank == 1 else ("small", rank))
    edge = all_gather_objects(b"y" * (SLOT - 64 + rank * 128))  # one fits its slot, the other not
    dist.barrier()  # the ranks ran the same collectives: none is left waiting in one the other skipped
    return small, none, big, edge


def test_small_and_large_objects_reach_every_rank_whole(tmp_path):
    got = two_ranks(_gathers, tmp_path)
    for rank in (0, 1):
        assert isinstance(got[rank], tuple), got[rank]
        small, none, big, edge = got[rank]
        assert small == [{"rank": r, "problems": [], "crc": {r: 0xDEADBEEF}} for r in (0, 1)]
        assert none == [None, None]
        assert big == [("small", 0), b"x" * (3 * SLOT)]
        assert edge == [b"y" * (SLOT - 64), b"y" * (SLOT + 64)]


def test_large_worlds_get_smaller_slots_so_the_first_collective_stays_small():
    """Pure logic: every rank receives at most 4 MiB in the first collective (slots of 512 bytes at least)."""
    assert slot_for(2) == slot_for(1024) == SLOT
    assert slot_for(4096) == 1024 and slot_for(1 << 16) == 512
    assert all(w * slot_for(w) <= 4 << 20 for w in (2, 1024, 2048, 8192))
