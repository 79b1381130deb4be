"""``lightning-asyncckpt verify`` on real checkpoints damaged on purpose: a truncated shard, a broken zip
header, flipped tensor bytes (found by CRC32, and missed where none was recorded), a broken pickle, missing
files, and a ``.metadata`` that does not match the data. Each problem is a ``FAIL`` line naming the file and the
item, and the exit status is 1."""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from cli_checkpoints import ckpts_fixture  # noqa: F401 - the fixture ckpts
from cli_checkpoints import copy_dir as _copy

from helpers import assert_user_error
from helpers import run_cli as run
from lightning_asyncckpt.format import dcp as dcp_format
from lightning_asyncckpt.format.integrity import CorruptCheckpointError
from lightning_asyncckpt.storage import commit


def _item(path: Path, fqn: str):
    """(shard file, storage info) of the item ``fqn`` of a checkpoint directory."""
    for index, info in dcp_format.read_metadata(path).storage_data.items():
        if index.fqn == fqn:
            return path / info.relative_path, info
    raise KeyError(fqn)


def test_verify_ok_is_one_line(ckpts, capsys):
    code, out, err = run(capsys, "verify", ckpts.single)
    assert code == 0 and err == ""
    items = len(dcp_format.read_metadata(ckpts.single).state_dict_metadata)  # tensors and the other leaves
    assert out.count("\n") == 1 and out.startswith(f"OK {ckpts.single}: {items} items in 2 shard files")
    assert f"{items} of {items} items checked against CRC32" in out
    code, out, _ = run(capsys, "verify", ckpts.sharded)
    assert code == 0 and out.startswith("OK ")


def test_verify_truncated_shard_names_file_and_item(ckpts, tmp_path, capsys):
    path = _copy(ckpts.single, tmp_path / "a.ckpt")
    metadata = dcp_format.read_metadata(path)
    shard = max((path / s.relative_path for s in metadata.storage_data.values()), key=lambda p: p.stat().st_size)
    last_index, last = max(((i, s) for i, s in metadata.storage_data.items() if path / s.relative_path == shard),
                           key=lambda e: e[1].offset)
    os.truncate(shard, last.offset + last.length // 2)
    code, out, err = run(capsys, "verify", path)
    assert code == 1 and out == "" and "Traceback" not in err
    bad = [line for line in err.splitlines() if line.startswith("FAIL")]
    assert len(bad) == 1, err  # only the item cut short
    assert bad[0].startswith(f"FAIL {shard}: item {last_index.fqn!r}: truncated (needs bytes {last.offset}.."), bad[0]
    assert err.strip().splitlines()[-1] == f"lightning-asyncckpt: error: {path}: verification failed: 1 problem(s)"


def test_verify_broken_zip_header_of_an_item(ckpts, tmp_path, capsys):
    path = _copy(ckpts.single, tmp_path / "a.ckpt")
    shard, info = _item(path, "state_dict.head.weight")
    with open(shard, "r+b") as f:
        f.seek(info.offset)
        f.write(b"XXXX")  # the item's zip local header
    code, _, err = run(capsys, "verify", path)
    assert code == 1
    assert f"FAIL {shard}: item 'state_dict.head.weight': corrupt (not a torch.save payload: no zip header)" in err


def _flip_tensor_data(path: Path, fqn: str, tensor: torch.Tensor) -> None:
    """Flips one byte in the middle of the raw data of the tensor item ``fqn``."""
    shard, info = _item(path, fqn)
    data = bytearray(shard.read_bytes())
    start = data.find(tensor.numpy().tobytes(), info.offset, info.offset + info.length)
    assert start > 0
    data[start + tensor.numel() * tensor.element_size() // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def test_verify_detects_flipped_tensor_data_by_crc32(ckpts, tmp_path, capsys):
    path = _copy(ckpts.single, tmp_path / "a.ckpt")
    weight = ckpts.ckpt["state_dict"]["layer.weight"]
    _flip_tensor_data(path, "state_dict.layer.weight", weight)
    # DCP and torch.load check no CRC: without the library's check the changed value loads without an error;
    # with it (the default) the load refuses, naming the shard and the item, as verify does
    assert not torch.equal(dcp_format.load(path, weights_only=True, verify=False)["state_dict"]["layer.weight"], weight)
    with pytest.raises(CorruptCheckpointError, match=r"\.distcp: item 'state_dict.layer.weight': corrupt: record"):
        dcp_format.load(path, weights_only=True)
    code, _, err = run(capsys, "verify", path)
    assert code == 1
    assert "item 'state_dict.layer.weight': corrupt: record 'data/0' does not match its CRC32" in err


def test_verify_without_crc32_misses_flipped_tensor_data(ckpts, tmp_path, capsys):
    """The limit of verify: a checkpoint written without CRC32 (``set_crc32_options(False)``) has nothing
    that changed tensor bytes can be checked against."""
    path = _copy(ckpts.nocrc, tmp_path / "a.ckpt")
    code, out, _ = run(capsys, "verify", path)
    assert code == 0 and "no CRC32 recorded" in out
    _flip_tensor_data(path, "state_dict.layer.weight", ckpts.ckpt["state_dict"]["layer.weight"])
    code, out, _ = run(capsys, "verify", path)
    assert code == 0 and "no CRC32 recorded" in out


def test_verify_without_crc32_still_detects_a_broken_pickle(ckpts, tmp_path, capsys):
    path = _copy(ckpts.nocrc, tmp_path / "a.ckpt")
    shard, info = _item(path, "state_dict.head.weight")
    data = bytearray(shard.read_bytes())
    item = bytes(data[info.offset:info.offset + info.length])
    with zipfile.ZipFile(__import__("io").BytesIO(item)) as zf:
        member = next(m for m in zf.infolist() if m.filename.endswith("/data.pkl"))
    name_len = int.from_bytes(item[member.header_offset + 26:member.header_offset + 28], "little")
    extra_len = int.from_bytes(item[member.header_offset + 28:member.header_offset + 30], "little")
    pkl = info.offset + member.header_offset + 30 + name_len + extra_len
    assert data[pkl] == 0x80  # pickle's PROTO opcode
    data[pkl] = 0xFF
    shard.write_bytes(bytes(data))
    code, _, err = run(capsys, "verify", path)
    assert code == 1 and "item 'state_dict.head.weight': does not deserialize" in err


def test_verify_incomplete_and_missing_files(ckpts, tmp_path, capsys):
    path = _copy(ckpts.single, tmp_path / "a.ckpt")
    (path / "__0_1.distcp").unlink()
    code, _, err = run(capsys, "verify", path)
    assert code == 1 and f"FAIL {path / '__0_1.distcp'}: No such file or directory" in err

    (path / ".metadata").unlink()
    code, _, err = run(capsys, "verify", path)
    assert_user_error(code, err, 1, "incomplete", "no .metadata")

    leftover = _copy(ckpts.single, tmp_path / f"{commit.INCOMPLETE_PREFIX}9-1")
    code, _, err = run(capsys, "verify", leftover)
    assert_user_error(code, err, 1, "incomplete", "never committed")


def _edit_metadata(path: Path, edit) -> None:
    metadata = dcp_format.read_metadata(path)
    edit(metadata)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def test_verify_metadata_that_does_not_match_the_data(ckpts, tmp_path, capsys):
    dtype = _copy(ckpts.single, tmp_path / "dtype.ckpt")
    # the item holds float32
    _edit_metadata(dtype, lambda m: setattr(m.state_dict_metadata["state_dict.head.weight"].properties, "dtype",
                                            torch.float64))
    code, _, err = run(capsys, "verify", dtype)
    assert code == 1 and "item 'state_dict.head.weight': holds float32[10, 64], the metadata says float64[10, 64]" in err

    # a size that its one chunk does not fill: DCP's load would return a bigger tensor, partly uninitialized
    size = _copy(ckpts.single, tmp_path / "size.ckpt")
    _edit_metadata(size, lambda m: setattr(m.state_dict_metadata["state_dict.head.weight"], "size", torch.Size([11, 64])))
    code, _, err = run(capsys, "verify", size)
    assert code == 1 and "item 'state_dict.head.weight': its chunks [[10, 64]] at [[0, 0]] do not fill its size [11, 64]" in err

    unstored = _copy(ckpts.single, tmp_path / "unstored.ckpt")
    _edit_metadata(unstored, lambda m: [m.storage_data.pop(i) for i in list(m.storage_data) if i.fqn == "state_dict.head.bias"])
    code, _, err = run(capsys, "verify", unstored)
    assert code == 1 and "item 'state_dict.head.bias' chunk at [0] has no storage entry in .metadata" in err
