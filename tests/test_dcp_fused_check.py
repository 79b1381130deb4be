"""A DCP load checks a large tensor's CRC32 as it copies it (``format/dcp_reader.py``'s ``_Fused``: 1 MiB chunks,
each checked right after the copy wrote it): the state gets the saved bytes, and a bit flipped anywhere in such a
tensor (its first, a middle or its last chunk, a short one) is refused naming the file, the item and the record,
as the check in place refused it; a target the fused copy cannot take (not contiguous) is checked in place.
Real files of stock ``dcp.save``; one process."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_asyncckpt.format import dcp_reader
from lightning_asyncckpt.format.dcp import read_into
from lightning_asyncckpt.format.metadata import read_metadata
from lightning_asyncckpt.storage.regular_files import CorruptCheckpointError

BIG = (3 << 18) + 5  # float32: 3 MiB and 20 bytes, so its last chunk is short


def _saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    state = {"big": torch.randn(BIG, generator=g), "matrix": torch.randn(1024, 512, generator=g),
             "small": torch.randn(7, generator=g), "step": torch.tensor(3)}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt")
    return tmp_path / "ckpt", state


def _data_record(path: Path, fqn: str) -> tuple[str, int, int]:
    """(file, offset of the item's tensor bytes in it, their size) of item ``fqn``."""
    md = read_metadata(path)
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn == fqn)
    with open(path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        item = f.read(info.length)
    with zipfile.ZipFile(io.BytesIO(item)) as zf:
        record = next(m for m in zf.infolist() if m.filename.split("/", 1)[-1].startswith("data/"))
    # where torch reads the bytes (the local header's extra field pads them to 64 bytes: not the directory's)
    start = torch._C.PyTorchFileReader(io.BytesIO(item)).get_record_offset(record.filename.split("/", 1)[-1])
    return info.relative_path, info.offset + start, record.file_size


def _flip(path: Path, rel: str, at: int) -> None:
    with open(path / rel, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


@pytest.fixture
def fused_copies(monkeypatch):
    """How many records the fused copy took (the real method, counted)."""
    calls = []
    real = dcp_reader._Fused.copy_checked
    monkeypatch.setattr(dcp_reader._Fused, "copy_checked", lambda self, r, t: (calls.append(r.name), real(self, r, t))[1])
    return calls


def _empty(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def test_a_checked_load_copies_the_large_tensors_once_and_gives_the_saved_bytes(tmp_path, fused_copies):
    path, state = _saved(tmp_path)
    back = _empty(state)
    read_into(path, read_metadata(path), back)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert len(fused_copies) == 2  # big and matrix; the small ones are checked in place


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_bit_flipped_in_a_large_tensor_is_refused_naming_file_item_and_record(tmp_path, where, fused_copies):
    path, state = _saved(tmp_path)
    rel, offset, size = _data_record(path, "big")
    _flip(path, rel, offset + {"first": 0, "middle": size // 2, "last": size - 1}[where])
    with pytest.raises(CorruptCheckpointError, match=rf"{path / rel}: item 'big': corrupt: record 'data/\d+' does not"
                       " match its CRC32: its bytes changed after the save"):
        read_into(path, read_metadata(path), _empty(state))
    assert fused_copies  # refused by the fused check, not before it
    read_into(path, read_metadata(path), _empty(state), verify=False)  # verify_on_load=False: loads, unchecked


def test_a_target_the_fused_copy_cannot_take_is_checked_in_place(tmp_path, fused_copies):
    path, state = _saved(tmp_path)
    back = _empty(state)
    back["matrix"] = torch.zeros(512, 1024).t()  # not contiguous: copied by torch, checked before
    read_into(path, read_metadata(path), back)
    assert torch.equal(back["matrix"], state["matrix"])
    assert len(fused_copies) == 1  # big's only
    rel, offset, size = _data_record(path, "matrix")
    _flip(path, rel, offset + size // 3)
    with pytest.raises(CorruptCheckpointError, match=r"item 'matrix': corrupt: record 'data/\d+' does not match"):
        read_into(path, read_metadata(path), back)
