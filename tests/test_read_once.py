"""Read-once resume of a ``torch.save`` file (:mod:`lightning_asyncckpt.format.read_once`) on two real gloo ranks:
each rank reads its share and receives the other's, the load gives exactly what ``torch.load`` gives, a
flipped bit is caught on the exchanged bytes, and ranks that disagree on the file fall back alike.
The bytes read at the storage on 2 simulated nodes x 2 ranks: tests/test_read_once_nodes.py."""

from __future__ import annotations

import os

import torch

from lightning_asyncckpt.collectives import shares
from processes import two_ranks


def _state():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(1000, 37, generator=g), "b": torch.arange(7, dtype=torch.int16), "step": 3}


def _read(rank, root):
    from lightning_asyncckpt.format import read_once
    from lightning_asyncckpt.integration import loading

    path = os.path.join(root, "a.ckpt")
    got = read_once.read_together(path)
    loaded = loading.load(path, weights_only=True, together=True)
    expected = torch.load(path, weights_only=True)
    same = all(torch.equal(loaded[k], expected[k]) for k in ("w", "b")) and loaded["step"] == expected["step"]
    with open(path, "rb") as f:
        whole = f.read()
    # a file only one rank has: every rank falls back alike, none waits
    alone = os.path.join(root, f"only{rank}.ckpt")
    torch.save({"r": rank}, alone)
    fallback = read_once.read_together(alone)
    corrupt = None
    try:
        loading.load(os.path.join(root, "bad.ckpt"), weights_only=True, together=True)
    except Exception as e:  # noqa: BLE001 - the message is the result
        corrupt = f"{type(e).__name__}: {e}"
    return bytes(got.data) == whole, got.read, got.world, same, fallback is None, corrupt


def test_two_ranks_each_read_half_and_load_exactly_what_torch_loads(tmp_path):
    path = tmp_path / "a.ckpt"
    torch.save(_state(), path)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # inside the large tensor's record
    (tmp_path / "bad.ckpt").write_bytes(bytes(raw))
    size = path.stat().st_size
    got = two_ranks(_read, tmp_path)
    share = shares.share_of(size, 2)
    for rank in (0, 1):
        assert isinstance(got[rank], tuple), got[rank]
        whole, read, world, same, fell_back, corrupt = got[rank]
        assert whole and same and world == 2 and fell_back
        assert read == min(share, size - rank * share)
        assert corrupt is not None and "CorruptCheckpointError" in corrupt and "bad.ckpt" in corrupt, corrupt


def test_the_exchange_keeps_its_rounds_within_the_budget():
    assert shares.chunk_for(2) == shares.MAX_CHUNK
    assert shares.chunk_for(1024) * 1024 <= shares.ROUND_BUDGET
    assert shares.chunk_for(10**6) == shares.MIN_CHUNK
    assert shares.share_of(10, 4) == 3 and shares.share_of(0, 4) == 0
