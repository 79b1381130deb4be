"""Read-once resume of a ``torch.save`` file (:mod:`lightning_asyncckpt.storage.read_once`) on two real gloo ranks:
each rank reads its share and receives the other's, the load gives exactly what ``torch.load`` gives, a
flipped bit is caught on the exchanged bytes, and ranks that disagree on the file fall back alike.
The bytes read at the storage on 2 simulated nodes x 2 ranks: tests/test_read_once_nodes.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_asyncckpt.collectives import shares
from processes import two_ranks


def _state():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(1000, 37, generator=g), "b": torch.arange(7, dtype=torch.int16), "step": 3}


def _read(rank, root):
    from lightning_asyncckpt.integration import loading
    from lightning_asyncckpt.storage import read_once

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


def _read_directory(rank, root):
    from lightning_asyncckpt.integration import loading
    from lightning_asyncckpt.storage import read_once

    path = os.path.join(root, "d")
    files = read_once.read_directory_together(Path(path))
    whole = {n: bytes(v) == Path(path, n).read_bytes() for n, v in files.files.items()}
    loaded = loading.load(path, weights_only=True, together=True)
    expected = loading.load(path, weights_only=True)  # this rank alone, as before
    same = sorted(loaded) == sorted(expected) and all(torch.equal(loaded[k], expected[k]) for k in ("w", "b"))
    corrupt = None
    try:
        loading.load(os.path.join(root, "bad"), weights_only=True, together=True)
    except Exception as e:  # noqa: BLE001 - the message is the result
        corrupt = f"{type(e).__name__}: {e}"
    return whole, files.read, same, corrupt


def test_two_ranks_read_a_checkpoint_directory_once_and_load_it_exactly(tmp_path):
    import shutil

    import torch.distributed.checkpoint as dcp

    dcp.save(_state(), checkpoint_id=str(tmp_path / "d"), no_dist=True)
    shutil.copytree(tmp_path / "d", tmp_path / "bad")
    shard = next(p for p in (tmp_path / "bad").iterdir() if p.suffix == ".distcp")
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    shard.write_bytes(bytes(raw))
    total = sum(p.stat().st_size for p in (tmp_path / "d").iterdir())
    got = two_ranks(_read_directory, tmp_path)
    assert isinstance(got[0], tuple) and isinstance(got[1], tuple), got
    assert got[0][1] + got[1][1] == total  # each byte read once, by one rank
    for rank in (0, 1):
        whole, _, same, corrupt = got[rank]
        assert whole and all(whole.values()) and same
        # the damaged item is named in the checkpoint, not in the local copy the reader ran on
        assert corrupt is not None and "CorruptCheckpointError" in corrupt and str(tmp_path / "bad") in corrupt \
            and "asyncckpt-read-once" not in corrupt, corrupt


def test_the_exchange_keeps_its_rounds_within_the_budget():
    assert shares.chunk_for(2) == shares.MAX_CHUNK
    assert shares.chunk_for(1024) * 1024 <= shares.ROUND_BUDGET
    assert shares.chunk_for(10**6) == shares.MIN_CHUNK
    assert shares.share_of(10, 4) == 3 and shares.share_of(0, 4) == 0


def _dies_in_the_exchange(rank, port, path, q):
    """One rank of a gloo group of two reading ``path`` together; rank 1 dies (``os._exit``) in the exchange's
    third round. Rank 0 puts what its read did on ``q``."""
    import datetime

    import torch.distributed as dist

    from lightning_asyncckpt.collectives import shares
    from lightning_asyncckpt.storage import read_once

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    shares.MAX_CHUNK = shares.MIN_CHUNK  # a round per 64 KiB: several rounds
    if rank == 1:
        gather, calls = dist.all_gather, []

        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:  # two rounds of the exchange, then gone
                os._exit(3)
            return gather(*args, **kwargs)

        dist.all_gather = dying  # this forked process only
    try:
        read_once.read_together(path)
        q.put("returned")
    except Exception as e:  # noqa: BLE001 - the error is the result
        q.put(f"{type(e).__name__}: {e}"[:500])


def test_a_rank_that_dies_in_the_exchange_fails_the_others_instead_of_hanging(tmp_path):
    import multiprocessing as mp

    from processes import free_port

    path = tmp_path / "a.ckpt"
    torch.save({"w": torch.randn(256, 1024)}, path)  # 1 MiB: 8 rounds of 64 KiB per rank
    ctx = mp.get_context("fork")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_dies_in_the_exchange, args=(r, port, str(path), q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = q.get(timeout=120)  # hard bound; the group's own timeout is 60 s, a closed peer fails at once
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert procs[1].exitcode == 3
    assert got != "returned" and ("Connection" in got or "closed" in got or "Timeout" in got or "Gloo" in got), got


def test_only_a_strategys_load_reads_together(tmp_path, monkeypatch):
    """Lightning's resume and Fabric's ``load`` call the plugin from a strategy's ``load_checkpoint`` on every
    rank: those loads read together. A direct call (a user's, on one rank) must not wait for other ranks."""
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_asyncckpt import AsyncCheckpointIO
    from lightning_asyncckpt.integration import loading

    path = tmp_path / "a.ckpt"
    torch.save({"x": 1}, path)
    seen = []
    monkeypatch.setattr(loading, "load", lambda *a, together=False, **k: seen.append(together) or {"x": 1})
    with AsyncCheckpointIO() as io:
        for strategy in (DDPStrategy(checkpoint_io=io), FabricDDP(checkpoint_io=io)):
            strategy.load_checkpoint(path, weights_only=True)
        io.load_checkpoint(path, weights_only=True)
    assert seen == [True, True, False]


def _read_url(rank, root):
    from lightning_asyncckpt.integration import loading
    from lightning_asyncckpt.storage import read_once

    url = "memory://read-once/a.ckpt"  # written by the parent before the fork: both ranks see it
    got = read_once.read_url_together(url)
    loaded = loading.load(url, weights_only=True, together=True)
    expected = torch.load(os.path.join(root, "a.ckpt"), weights_only=True)
    same = all(torch.equal(loaded[k], expected[k]) for k in ("w", "b"))
    return bytes(got.data) == Path(root, "a.ckpt").read_bytes(), got.read, same


def test_two_ranks_read_a_file_at_an_fsspec_url_once(tmp_path):
    import fsspec

    path = tmp_path / "a.ckpt"
    torch.save(_state(), path)
    fs = fsspec.filesystem("memory")
    fs.pipe("/read-once/a.ckpt", path.read_bytes())
    try:
        got = two_ranks(_read_url, tmp_path)
    finally:
        fs.rm("/read-once", recursive=True)
    assert isinstance(got[0], tuple) and isinstance(got[1], tuple), got
    assert got[0][1] + got[1][1] == path.stat().st_size
    assert all(got[r][0] and got[r][2] for r in (0, 1)), got


def _read_s3(rank, root):
    from lightning_asyncckpt.integration import loading
    from lightning_asyncckpt.storage import read_once

    url = "s3://ckpt/read-once/a.ckpt"
    got = read_once.read_url_together(url)
    loaded = loading.load(url, weights_only=True, together=True)
    expected = torch.load(os.path.join(root, "a.ckpt"), weights_only=True)
    return bytes(got.data) == Path(root, "a.ckpt").read_bytes(), got.read, \
        all(torch.equal(loaded[k], expected[k]) for k in ("w", "b"))


@pytest.mark.slow  # make test-all: the memory:// case above runs the same code in make test
def test_two_ranks_read_a_file_on_an_s3_server_once_with_ranged_gets(tmp_path, s3):
    path = tmp_path / "a.ckpt"
    torch.save(_state(), path)
    s3.fs.pipe("ckpt/read-once/a.ckpt", path.read_bytes())
    got = two_ranks(_read_s3, tmp_path)
    assert isinstance(got[0], tuple) and isinstance(got[1], tuple), got
    assert got[0][1] + got[1][1] == path.stat().st_size
    assert all(got[r][0] and got[r][2] for r in (0, 1)), got
