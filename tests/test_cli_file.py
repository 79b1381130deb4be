"""The ``lightning-asyncckpt`` command on single-file checkpoints: one ``torch.save`` file, as stock Lightning's
``TorchCheckpointIO`` writes (the library's default single-writer format)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from helpers import assert_tree_equal, assert_user_error
from helpers import run_cli as run
from lightning_asyncckpt.format import dcp as dcp_format
from lightning_asyncckpt.storage import commit
from lightning_asyncckpt.tools import cli


@dataclasses.dataclass
class Config:  # an object that torch.load(weights_only=True) refuses
    name: str


def _lightning_like() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "state_dict": {
            "layer.weight": torch.randn(64, 32, generator=g),
            "layer.bias": torch.randn(64, generator=g).to(torch.bfloat16),
            "head.weight": torch.randn(10, 64, generator=g),
            "head.bias": torch.zeros(10, dtype=torch.float16),
        },
        "optimizer_states": [
            {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(64, 16, generator=g)}},
             "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999)}]},
        ],
        "global_step": 3,
        "epoch": 0,
        "hyper_parameters": {"width": 64},
    }


# name, shape, dtype, bytes: every tensor of _lightning_like(), largest first (ties by name)
TENSORS = [
    ("state_dict.layer.weight", [64, 32], "float32", 8192),
    ("optimizer_states.0.state.0.exp_avg", [64, 16], "float32", 4096),
    ("state_dict.head.weight", [10, 64], "float32", 2560),
    ("state_dict.layer.bias", [64], "bfloat16", 128),
    ("state_dict.head.bias", [10], "float16", 20),
    ("optimizer_states.0.state.0.step", [], "float32", 4),
]


@pytest.fixture
def ckpt_file(tmp_path) -> Path:
    path = tmp_path / "epoch=0-step=3.ckpt"
    TorchCheckpointIO().save_checkpoint(_lightning_like(), path)  # exactly what stock Lightning writes
    return path


def _record_at(path: Path, pos: int) -> str:
    """The name (as torch's reader names it, ``data/0``) of the zip record whose data holds byte ``pos``."""
    data = path.read_bytes()
    with zipfile.ZipFile(path) as zf:
        for m in zf.infolist():
            h = m.header_offset
            start = h + 30 + int.from_bytes(data[h + 26:h + 28], "little") + int.from_bytes(data[h + 28:h + 30], "little")
            if start <= pos < start + m.file_size:
                return m.filename.split("/", 1)[1]
    raise AssertionError(f"byte {pos} is in no record")


# -------------------------------------------------------------------------------------------------
# inspect


def test_inspect_file_json(ckpt_file, capsys):
    code, out, err = run(capsys, "inspect", ckpt_file, "--json")
    assert code == 0 and err == ""
    info = json.loads(out)
    assert info["format"] == "torch.save file" and info["status"] == "complete" and info["reason"] is None
    assert (info["global_step"], info["epoch"]) == (3, 0)
    assert info["num_tensors"] == len(TENSORS) and info["tensor_bytes"] == sum(t[3] for t in TENSORS)
    assert info["largest_tensors"] == [{"name": n, "shape": s, "dtype": d, "bytes": b} for n, s, d, b in TENSORS[:5]]
    assert info["non_tensor_keys"] == ["state_dict", "optimizer_states", "global_step", "epoch", "hyper_parameters"]
    assert info["files"] == 1 and info["file_bytes"] == ckpt_file.stat().st_size and info["notes"] == []


def test_inspect_file_text(ckpt_file, capsys):
    code, out, _ = run(capsys, "inspect", ckpt_file)
    assert code == 0
    fields = dict(line.split(":", 1) for line in out.splitlines() if not line.startswith("  ") and ":" in line)
    assert fields["format"].strip().startswith("torch.save file") and "stock Lightning" in fields["format"]
    assert fields["status"].strip() == "complete"
    assert fields["global step"].strip() == "3" and fields["epoch"].strip() == "0"
    assert fields["tensors"].strip() == "6 (14.6 KiB, 15000 bytes)"
    assert fields["size"].strip().endswith(f"({ckpt_file.stat().st_size} bytes)")
    assert "optimizer_states.0.state.0.exp_avg" in out and "[64, 16]" in out and "bfloat16" in out
    assert "engine" not in fields and "world size" not in fields  # a file does not say who wrote it


def test_inspect_leftover_file_is_incomplete(ckpt_file, tmp_path, capsys):
    leftover = tmp_path / f"{commit.INCOMPLETE_PREFIX}abc.123.x1"
    shutil.copy(ckpt_file, leftover)  # complete, never renamed
    code, out, _ = run(capsys, "inspect", leftover, "--json")
    info = json.loads(out)
    assert code == 0 and info["status"] == "incomplete" and "interrupted save" in info["reason"]
    assert info["global_step"] == 3
    os.truncate(leftover, leftover.stat().st_size // 2)  # cut short by the interruption
    code, out, _ = run(capsys, "inspect", leftover, "--json")
    info = json.loads(out)
    assert code == 0 and info["status"] == "incomplete" and info["num_tensors"] is None
    assert len(info["notes"]) == 1 and info["notes"][0].startswith("not read: ")
    code, out, _ = run(capsys, "inspect", leftover)
    assert code == 0 and "incomplete" in out


def test_inspect_truncated_file(ckpt_file, capsys):
    os.truncate(ckpt_file, ckpt_file.stat().st_size // 2)
    code, _, err = run(capsys, "inspect", ckpt_file)
    assert_user_error(code, err, 2, str(ckpt_file), "damaged or truncated")


def test_inspect_file_with_pickled_objects_needs_allow_pickle(tmp_path, capsys):
    path = tmp_path / "custom.ckpt"
    torch.save({"global_step": 4, "state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"cfg": Config("x")}}, path)
    code, out, _ = run(capsys, "inspect", path, "--json")
    info = json.loads(out)
    assert code == 0 and info["status"] == "complete" and info["num_tensors"] is None and info["global_step"] is None
    assert len(info["notes"]) == 1 and "--allow-pickle" in info["notes"][0] and "Config" in info["notes"][0]
    code, out, _ = run(capsys, "inspect", path, "--json", "--allow-pickle")
    info = json.loads(out)
    assert code == 0 and info["global_step"] == 4 and info["num_tensors"] == 1


def test_inspect_file_that_is_no_checkpoint(tmp_path, capsys):
    tensor_file = tmp_path / "tensor.pt"
    torch.save(torch.ones(3), tensor_file)
    code, _, err = run(capsys, "inspect", tensor_file)
    assert_user_error(code, err, 2, "not a checkpoint", "Tensor")


def test_inspect_legacy_torch_save_file(tmp_path, capsys):
    path = tmp_path / "legacy.ckpt"
    torch.save(_lightning_like(), path, _use_new_zipfile_serialization=False)
    code, out, _ = run(capsys, "inspect", path, "--json")
    info = json.loads(out)
    assert code == 0 and info["global_step"] == 3 and info["num_tensors"] == len(TENSORS)
    code, out, _ = run(capsys, "verify", path)
    assert code == 0 and out.startswith(f"OK {path}: torch.save file") and "legacy" in out


# -------------------------------------------------------------------------------------------------
# verify


def test_verify_file_ok(ckpt_file, capsys):
    code, out, err = run(capsys, "verify", ckpt_file)
    assert code == 0 and err == ""
    with zipfile.ZipFile(ckpt_file) as zf:
        members = zf.infolist()
    n, data_bytes = len(members), sum(m.file_size for m in members)
    assert out == (f"OK {ckpt_file}: torch.save file, {n} zip records, {data_bytes} bytes read "
                   f"({cli.human_bytes(data_bytes)}); {n} of {n} records checked against CRC32; "
                   "loads with weights_only=True\n")


def test_verify_file_detects_a_flipped_byte_in_tensor_data(tmp_path, capsys):
    path = tmp_path / "model.ckpt"
    ckpt = _lightning_like()
    torch.save(ckpt, path)
    weight = ckpt["state_dict"]["layer.weight"]
    data = bytearray(path.read_bytes())
    pos = data.find(weight.numpy().tobytes()) + weight.numel() * weight.element_size() // 2
    record = _record_at(path, pos)
    assert record.startswith("data/")
    data[pos] ^= 0x10
    path.write_bytes(bytes(data))
    # torch.load checks no CRC: it loads the changed value without an error
    assert not torch.equal(torch.load(path, weights_only=True)["state_dict"]["layer.weight"], weight)
    code, out, err = run(capsys, "verify", path)
    assert code == 1 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines == [f"FAIL {path}: corrupt: record {record!r} does not match its CRC32: its bytes changed after the save",
                     f"lightning-asyncckpt: error: {path}: verification failed: 1 problem(s)"]


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.0])
def test_verify_truncated_file(ckpt_file, keep, capsys):
    os.truncate(ckpt_file, int(ckpt_file.stat().st_size * keep))
    code, out, err = run(capsys, "verify", ckpt_file)
    assert code == 1 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"FAIL {ckpt_file}: ")
    assert ("truncated" in lines[0]) and lines[1].endswith("verification failed: 1 problem(s)")


def test_verify_leftover_file_is_incomplete(ckpt_file, tmp_path, capsys):
    leftover = tmp_path / f"{commit.INCOMPLETE_PREFIX}abc.9.x2"
    shutil.copy(ckpt_file, leftover)
    code, _, err = run(capsys, "verify", leftover)
    assert_user_error(code, err, 1, "incomplete", "never committed")


def test_verify_file_without_crc32(tmp_path, capsys):
    path = tmp_path / "nocrc.ckpt"
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(_lightning_like(), path)
    finally:
        torch.serialization.set_crc32_options(crc)
    code, out, _ = run(capsys, "verify", path)
    assert code == 0 and "no CRC32 recorded" in out


def test_verify_file_with_objects_weights_only_refuses(tmp_path, capsys):
    path = tmp_path / "custom.ckpt"
    torch.save({"global_step": 4, "hyper_parameters": {"cfg": Config("x")}}, path)
    code, out, err = run(capsys, "verify", path)
    assert code == 0 and err == "", err
    lines = out.splitlines()
    assert lines[0].startswith(f"OK {path}: torch.save file") and "weights_only=True" not in lines[0]
    assert lines[1].startswith("note: it does not load with weights_only=True") and "Config" in lines[1]


def test_verify_file_with_a_broken_pickle(ckpt_file, capsys):
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)  # so that only the load can notice
    try:
        torch.save(_lightning_like(), ckpt_file)
    finally:
        torch.serialization.set_crc32_options(crc)
    data = bytearray(ckpt_file.read_bytes())
    pkl = data.find(b"\x80\x02")  # data.pkl's PROTO opcode, the first record
    assert _record_at(ckpt_file, pkl) == "data.pkl"
    data[pkl] = 0xFF
    ckpt_file.write_bytes(bytes(data))
    code, _, err = run(capsys, "verify", ckpt_file)
    assert code == 1 and f"FAIL {ckpt_file}: does not load with weights_only=True" in err


# -------------------------------------------------------------------------------------------------
# convert


def test_convert_file_to_directory_and_back(ckpt_file, tmp_path, capsys):
    as_dir = tmp_path / "as_dir.ckpt"
    code, out, err = run(capsys, "convert", ckpt_file, as_dir)
    assert code == 0 and "checkpoint directory" in out, err
    assert commit.is_committed(as_dir)
    assert_tree_equal(dcp_format.load(as_dir, weights_only=True), _lightning_like())
    code, out, _ = run(capsys, "inspect", as_dir, "--json")
    info = json.loads(out)
    assert code == 0 and info["format"] == "DCP directory" and info["global_step"] == 3
    assert run(capsys, "verify", as_dir)[0] == 0

    back = tmp_path / "back.ckpt"
    code, out, err = run(capsys, "convert", as_dir, back)
    assert code == 0 and "torch.save" in out, err
    assert back.is_file()
    assert_tree_equal(TorchCheckpointIO().load_checkpoint(back, weights_only=True), _lightning_like())
    assert run(capsys, "verify", back)[0] == 0
    code, out, _ = run(capsys, "inspect", back, "--json")
    assert code == 0 and json.loads(out)["largest_tensors"][0]["name"] == "state_dict.layer.weight"


def test_convert_refuses_a_leftover_file(ckpt_file, tmp_path, capsys):
    leftover = tmp_path / f"{commit.INCOMPLETE_PREFIX}abc.7.x3"
    shutil.copy(ckpt_file, leftover)
    code, _, err = run(capsys, "convert", leftover, tmp_path / "out.ckpt")
    assert_user_error(code, err, 2, "incomplete")
    assert not (tmp_path / "out.ckpt").exists()
