"""zip_crc: a torch.save file recorded with CRC32 off and filled in afterwards is byte for byte the file
torch.save writes with CRC32 on, with every CRC32 implementation the writer may use, and ``verify``
still catches a flipped byte in it."""

from __future__ import annotations

import io
import zlib
from pathlib import Path

import pytest
import torch

from lightning_asyncckpt.snapshot import staging
from lightning_asyncckpt.tools import verify
from lightning_asyncckpt.write import direct_io, torch_file, zip_crc


def _states() -> dict[str, dict]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(40, 40, generator=g)
    return {
        "lightning-like": {
            "state_dict": {"w": torch.randn(300, 300, generator=g), "b": torch.zeros(300, dtype=torch.bfloat16)},
            "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "m": torch.randn(70_000, generator=g)}}}],
            "global_step": 3, "hyper_parameters": {"lr": 0.1},
        },
        "empty-and-0-dim": {"e": torch.empty(0), "s": torch.tensor(1.5), "i": torch.arange(70_000), "e2": torch.empty(0, 3)},
        "many-small": {f"t{i}": torch.full((i % 7 + 1,), float(i)) for i in range(300)},
        "tied": {"a": shared, "b": shared, "c": shared.detach()},
        "no-tensors": {"step": 7, "name": "run"},
    }


def _recorded(state: dict) -> direct_io.Recorded:
    _, tensors = staging.split(state)
    recorder = direct_io.Recorder(direct_io.storage_regions(tensors.values()))
    with zip_crc.crc32_off():
        torch.save(state, recorder, pickle_protocol=2)
    return recorder.recorded


def _stock(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf, pickle_protocol=2)
    return buf.getvalue()


def _implementations() -> list:
    out = [pytest.param(zlib.crc32, id="zlib")]
    if zip_crc.IMPLEMENTATION != "zlib":
        out.append(pytest.param(zip_crc.crc32, id=zip_crc.IMPLEMENTATION))
    return out


@pytest.mark.parametrize("implementation", _implementations())
@pytest.mark.parametrize("name", list(_states()))
def test_filled_file_is_byte_for_byte_torch_save_with_crc32(name, implementation, monkeypatch):
    monkeypatch.setattr(zip_crc, "crc32", implementation)
    state = _states()[name]
    recorded = _recorded(state)
    assert recorded.read(0, recorded.size) != _stock(state)  # CRC32 fields (and the id) still zero
    released: list[int] = []
    count = zip_crc.fill(recorded, released.append)
    assert recorded.read(0, recorded.size) == _stock(state)
    assert count == len(zip_crc.records(recorded)) and released == sorted(released)
    assert all(0 < r < recorded.size for r in released) and len(released) == count - 1


def test_the_writer_uses_a_faster_crc32_than_torch_when_installed():
    """``make test`` installs ``isal`` (a dependency on common platforms): the fast path is what CI runs."""
    assert zip_crc.IMPLEMENTATION in ("isal", "zlib-ng")


def test_verify_catches_a_flipped_byte_in_a_written_file(tmp_path):
    state = _states()["lightning-like"]
    skeleton, tensors = staging.split(state)
    path = tmp_path / "ours.ckpt"
    torch_file.write_file(skeleton, tensors, path)
    assert path.read_bytes() == _stock(state)
    assert verify.verify_file(path).crc_checked > 0
    data = bytearray(path.read_bytes())
    weight = state["state_dict"]["w"]
    data[data.find(weight.numpy().tobytes()) + 1001] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match its CRC32"):
        verify.check_torch_zip(path.read_bytes())


def test_a_file_that_is_not_a_stored_zip_is_refused_clearly():
    recorder = direct_io.Recorder([])
    recorder.write(b"not a zip archive" * 10)
    with pytest.raises(ValueError, match="not a zip archive"):
        zip_crc.fill(recorder.recorded)
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("archive/data.pkl", b"x" * 1000)
    recorder = direct_io.Recorder([])
    recorder.write(buf.getvalue())
    with pytest.raises(ValueError, match="compressed: not written by torch.save"):
        zip_crc.fill(recorder.recorded)


def test_patching_never_changes_a_staged_tensor():
    big = torch.zeros(100_000, dtype=torch.uint8)
    recorder = direct_io.Recorder([(big.data_ptr(), big.numel())])
    recorder.write(b"header")
    recorder.write(memoryview(big.numpy()))
    recorder.recorded.patch(2, b"AD")
    assert recorder.recorded.read(0, 6) == b"heADer"
    with pytest.raises(ValueError, match="lies in a staged tensor"):
        recorder.recorded.patch(10, b"\xff")
    assert int(big.sum()) == 0


def test_filled_file_written_with_o_direct_holds_the_patched_bytes(tmp_path):
    """With ``hold=True`` the writer threads start only on released bytes, so patches made before the
    release reach the disk (small chunks: many chunks, written while fill runs)."""
    state = _states()["many-small"] | {"big": torch.randn(200_000)}
    _, tensors = staging.split(state)
    regions = direct_io.storage_regions(tensors.values())
    path = Path(tmp_path / "f.pt")
    with direct_io.DirectFile(str(path), regions, threads=3, chunk=8192, hold=True) as f:
        with zip_crc.crc32_off():
            torch.save(state, f, pickle_protocol=2)
        zip_crc.fill(f.recorded, f.release)
    assert path.read_bytes() == _stock(state)


@pytest.mark.slow
def test_zip64_records_over_4_gib_are_filled_as_torch_writes_them(tmp_path):
    """A record larger than 4 GiB and records past byte 2**32 take zip64 fields (sizes and offsets in
    extras, 8-byte sizes in the data descriptor): the filled file is still torch.save's own, byte for byte.
    About 9 GiB of disk and 5 GiB of memory."""
    big = torch.empty((4 << 30) + 4096 * 3 + 5, dtype=torch.uint8)
    big[:: 1 << 20] = 7  # not all zeros: a wrong CRC32 range would show
    state = {"big": big, "after": torch.arange(1000), "meta": {"step": 1}}
    skeleton, tensors = staging.split(state)
    ours, stock = tmp_path / "ours.ckpt", tmp_path / "stock.ckpt"
    torch_file.write_file(skeleton, tensors, ours)
    with open(stock, "wb") as f:  # a file object, as stock Lightning's writer: records named "archive/..."
        torch.save(state, f, pickle_protocol=2)  # torch's own writer, CRC32 on
    assert ours.stat().st_size == stock.stat().st_size > 1 << 32
    with open(ours, "rb") as a, open(stock, "rb") as b:
        while True:
            x, y = a.read(64 << 20), b.read(64 << 20)
            assert x == y
            if not x:
                break
