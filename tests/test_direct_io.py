"""direct_io: a file recorded from a serializer and written in aligned chunks holds exactly the bytes written
to it, through O_DIRECT or the page cache, and a failed write is raised with its errno."""

import errno
import os

import pytest
import torch

from lightning_asyncckpt.pipeline import dcp_plan
from lightning_asyncckpt.write import direct_io


def _writes(big: torch.Tensor) -> list:
    """A serializer's writes: small headers (copied), slices of ``big`` (kept as references), odd sizes."""
    raw = memoryview(big.numpy()).cast("B")
    return [b"PK\3\4header", raw[: 100_000], b"x" * 37, raw[100_000: 300_001], bytearray(b"tail" * 1000), raw[300_001:]]


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("chunk", [8192, 1 << 20], ids=["many-chunks", "one-chunk"])
def test_file_holds_exactly_the_written_bytes(tmp_path, direct, chunk):
    big = torch.randint(0, 255, (500_003,), dtype=torch.uint8)
    regions = [(big.data_ptr(), big.numel())]
    path = tmp_path / "f.bin"
    path.write_bytes(b"old content, longer than nothing" * 100_000)  # truncated, not overwritten in place
    expected = b"".join(bytes(w) for w in _writes(big))
    with direct_io.DirectFile(str(path), regions, threads=3, chunk=chunk, direct=direct) as f:
        for w in _writes(big):
            assert f.write(w) == len(w)
        assert f.tell() == len(expected)
    assert path.read_bytes() == expected
    if not direct:
        assert f.direct is False
    refs = [p for p in f.recorded.parts if not isinstance(p, bytes)]
    assert len(refs) == 3  # the large slices were not copied


def test_torch_save_through_it_loads(tmp_path):
    state = {"w": torch.randn(300, 300), "i": torch.arange(70_000), "meta": {"step": 3}}
    regions = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in (state["w"], state["i"])]
    path = tmp_path / "s.pt"
    with direct_io.DirectFile(str(path), regions, chunk=1 << 16) as f:
        torch.save(state, f)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["i"], state["i"]) and loaded["meta"] == {"step": 3}
    assert os.path.getsize(path) == f.tell()


def test_a_failed_write_is_raised_with_its_errno(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    with pytest.raises(OSError) as info:
        with direct_io.DirectFile("/dev/full", [], chunk=8192) as f:
            f.write(b"x" * 100_000)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == "/dev/full"  # the message names the file


def test_an_error_in_the_serializer_propagates_and_stops_the_writers(tmp_path):
    with pytest.raises(ValueError, match="pickling failed"):
        with direct_io.DirectFile(str(tmp_path / "f.bin"), [], threads=2, chunk=8192) as f:
            f.write(b"x" * 20_000)
            raise ValueError("pickling failed")


def test_seeking_is_refused_clearly(tmp_path):
    with direct_io.DirectFile(str(tmp_path / "f.bin"), []) as f:
        with pytest.raises(OSError, match="seeking is not supported"):
            f.seek(0)


@pytest.mark.parametrize("engine", ["nvrx", "mcore"])
def test_dcp_shards_are_the_engines_own_bytes_and_results(tmp_path, engine):
    """The worker's DCP write (``write_job``) produces the shard files and write results that the engine's
    ``write_preloaded_data`` produces for the same plan: only how the bytes reach the disk differs."""
    import pickle
    import queue
    from pathlib import Path

    from lightning_asyncckpt import engines
    from lightning_asyncckpt.snapshot import staging
    from lightning_asyncckpt.write import dcp_writer
    from lightning_asyncckpt.write.jobs import DcpJob

    state = {"w": torch.randn(256, 300), "b": torch.arange(10_000, dtype=torch.int64), "step": 7, "name": "x"}
    snap = staging.Stager(shared=False, copy_cpu=True).snapshot(state)
    eng = engines.create(engines.EngineName(engine), engines.WorkerMode("fork"), 0)
    written = {}
    for how in ("engine", "worker"):
        out = tmp_path / how
        plan = dcp_plan.plan_local_save(snap, out, eng.writer_cls, 2, eng.split_by_size)
        os.makedirs(out, exist_ok=True)
        if how == "engine":
            import inspect

            params = inspect.signature(eng.writer_cls.write_preloaded_data).parameters
            results = []
            for i, bucket in enumerate(plan.buckets):
                outcomes, count = queue.Queue(), queue.Queue()
                count.put(i)
                eng.writer_cls.write_preloaded_data(**dcp_writer.write_call_kwargs(params, plan.transforms, i, bucket, outcomes, count))
                idx, res = outcomes.get()
                assert not isinstance(res, BaseException), res
                results.extend(res)
        else:
            dcp_writer.write_job(DcpJob(eng.writer_cls, plan.transforms, plan.buckets, str(tmp_path / "result")))
            with open(tmp_path / "result", "rb") as f:
                outcome = pickle.load(f)
            assert outcome["ok"], outcome
            results = outcome["results"]
        files = {p.name: p.read_bytes() for p in sorted(Path(out).iterdir())}
        written[how] = (files, sorted((str(r.index), r.size_in_bytes, r.storage_data) for r in results))
    assert len(written["engine"][0]) == 2  # thread_count=2: two shard files
    assert written["worker"] == written["engine"]


def _resident_fraction(path: str) -> float:
    """The fraction of ``path``'s pages in the page cache (``mincore`` over a private mapping, not read)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    page = mmap.PAGESIZE
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        pages = -(-size // page)
        vec = (ctypes.c_ubyte * pages)()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
        return sum(v & 1 for v in vec) / pages
    finally:
        del addr
        mm.close()


@pytest.mark.parametrize("engine, fmt", [("nvrx", "auto"), pytest.param("nvrx", "dcp", marks=pytest.mark.slow),
                                         ("mcore", "dcp")],
                         ids=["nvrx-file", "nvrx-dcp-shards", "mcore-dcp-shards"])
def test_checkpoint_bytes_go_to_the_disk_around_the_page_cache(tmp_path, engine, fmt):
    """Both formats' tensor bytes are written with O_DIRECT from the staged copies (the DCP shards through
    the engine's own writer, given our file object): after the commit, almost none of the checkpoint's
    pages are in the page cache. A buffered writer leaves all of them there."""
    from lightning_asyncckpt import AsyncCheckpointIO

    with direct_io.DirectFile(str(tmp_path / "probe"), []) as probe:
        probe.write(b"x")
    if not probe.direct:
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    state = {"w": torch.randn(4 << 20), "m": torch.randn(2 << 20), "step": 3}
    path = tmp_path / "c.ckpt"
    with AsyncCheckpointIO(engine, format=fmt) as io:
        io.save_checkpoint(state, path)
        io.finalize(blocking=True)
    files = [str(path)] if path.is_file() else [str(p) for p in path.iterdir() if p.stat().st_size > 1 << 20]
    assert files and all(_resident_fraction(f) < 0.05 for f in files), [(f, _resident_fraction(f)) for f in files]
    cold = tmp_path / "buffered.bin"
    cold.write_bytes(os.urandom(4 << 20))
    assert _resident_fraction(str(cold)) > 0.9  # the measure sees a buffered write
    loaded = AsyncCheckpointIO("nvrx").load_checkpoint(path)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["m"], state["m"]) and loaded["step"] == 3


def test_the_opener_writes_only_the_shards_it_knows_directly(tmp_path):
    """What the engines' writers get as ``open``: a DirectFile for a known shard opened ``"wb"`` (relative or
    absolute path alike); the builtin ``open`` for every other file and mode."""
    shard, other = tmp_path / "__0_0.distcp", tmp_path / "notes.txt"
    opener = direct_io.Opener({str(shard): []})
    with opener(os.path.relpath(shard), "wb") as f:
        assert isinstance(f, direct_io.DirectFile)
        f.write(b"x" * 10_000)
        os.fsync(f.fileno())  # as the engines do before closing: harmless
    assert shard.read_bytes() == b"x" * 10_000
    with opener(other, "w") as f:
        assert not isinstance(f, direct_io.DirectFile)
        f.write("plain")
    with opener(shard, "rb") as f:
        assert f.read(3) == b"xxx"
    assert other.read_text() == "plain"
