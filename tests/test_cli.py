"""The ``lightning-asyncckpt`` command line, on real checkpoints written by ``AsyncCheckpointIO``."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import TorchCheckpointIO

from helpers import assert_tree_equal, assert_user_error, clone_tree
from helpers import run_cli as run
from lightning_asyncckpt import AsyncCheckpointIO
from lightning_asyncckpt.format import commit
from lightning_asyncckpt.format import dcp as dcp_format
from lightning_asyncckpt.snapshot import staging
from lightning_asyncckpt.tools import cli

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Config:  # an object that torch.load(weights_only=True) refuses
    name: str


def _checkpoint(scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": "2.6.0",
        "state_dict": {
            "layer.weight": torch.randn(64, 32, generator=g) * scale,
            "layer.bias": torch.randn(64, generator=g).to(torch.bfloat16),
            "head.weight": torch.randn(10, 64, generator=g),
            "head.bias": torch.zeros(10, dtype=torch.float16),
        },
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(64, 16, generator=g)}},
                "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999)}],
            }
        ],
        "lr_schedulers": [],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 3}}}},
        "hyper_parameters": {"width": 64, "names": ["a", "b"]},
    }


def _save_dir(ckpt: dict, path: Path, thread_count: int = 2) -> None:
    io = AsyncCheckpointIO(worker="fork", thread_count=thread_count, format="dcp")
    try:
        io.save_checkpoint(ckpt, path)
        io.finalize(blocking=True)
    finally:
        io.teardown()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Real checkpoints, written once for the module: a single-writer directory (two shard files), a sharded
    one (``meta.pt``), a stock DCP one without CRC32 records, and a plain ``torch.save`` file."""
    root = tmp_path_factory.mktemp("cli")
    ckpt = _checkpoint()
    _save_dir(clone_tree(ckpt), root / "single.ckpt")
    # stock DCP, written in this thread without CRC32 records (the option does not reach the library's
    # writer threads: its checkpoints have CRCs)
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        state = {"state_dict": clone_tree(ckpt["state_dict"]), "global_step": 120, "epoch": 3}
        dcp.save(state, checkpoint_id=root / "nocrc.ckpt", no_dist=True)
    finally:
        torch.serialization.set_crc32_options(crc)
    sharded_state = {"model": {"w": torch.randn(8, 4)}, "optimizer": {"state": {"w": {"exp_avg": torch.ones(8, 4)}}}}
    meta = {"global_step": 7, "epoch": 1, "loops": {}}
    io = AsyncCheckpointIO(worker="fork")
    try:
        io.save_checkpoint_sharded(clone_tree(sharded_state), root / "sharded.ckpt", meta=meta)
        io.finalize(blocking=True)
    finally:
        io.teardown()
    torch.save(_checkpoint(scale=2.0), root / "plain.ckpt")
    return SimpleNamespace(
        root=root, ckpt=ckpt, single=root / "single.ckpt", nocrc=root / "nocrc.ckpt",
        sharded=root / "sharded.ckpt", sharded_state=sharded_state, meta=meta, plain=root / "plain.ckpt",
    )


def _item(path: Path, fqn: str):
    """(shard file, storage info) of the item ``fqn`` of a checkpoint directory."""
    for index, info in dcp_format.read_metadata(path).storage_data.items():
        if index.fqn == fqn:
            return path / info.relative_path, info
    raise KeyError(fqn)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# -------------------------------------------------------------------------------------------------
# inspect


def test_inspect_json_reports_the_checkpoint(ckpts, capsys):
    code, out, err = run(capsys, "inspect", ckpts.single, "--json")
    assert code == 0, err
    info = json.loads(out)
    _, tensors = staging.split(ckpts.ckpt)
    sizes = sorted(((t.numel() * t.element_size(), name, list(t.shape), str(t.dtype)[6:])
                    for name, t in tensors.items()), key=lambda s: (-s[0], s[1]))
    assert info["status"] == "committed" and info["reason"] is None and info["layout"] == "single-writer"
    assert (info["global_step"], info["epoch"]) == (120, 3)
    # who wrote it, from the .asyncckpt.json the library writes beside .metadata
    assert (info["engine"], info["worker"], info["world_size"], info["writer_ranks"]) == ("nvrx", "fork", 1, 1)
    assert info["engine_version"] and info["written_by"].startswith("lightning-asyncckpt ")
    assert info["num_tensors"] == len(tensors) == 6
    assert info["tensor_bytes"] == sum(s[0] for s in sizes)
    assert info["largest_tensors"] == [{"name": n, "shape": s, "dtype": d, "bytes": b} for b, n, s, d in sizes[:5]]
    assert info["largest_tensors"][0] == {"name": "state_dict.layer.weight", "shape": [64, 32], "dtype": "float32",
                                          "bytes": 8192}
    assert info["non_tensor_keys"] == list(ckpts.ckpt)
    assert info["files"] == 5 and info["file_bytes"] == sum(p.stat().st_size for p in ckpts.single.iterdir())


def test_inspect_text(ckpts, capsys):
    code, out, _ = run(capsys, "inspect", ckpts.single)
    assert code == 0
    fields = dict(line.split(":", 1) for line in out.splitlines() if not line.startswith("  ") and ":" in line)
    assert fields["status"].strip() == "committed"
    assert fields["global step"].strip() == "120" and fields["epoch"].strip() == "3"
    assert fields["tensors"].strip().startswith("6 (")
    assert "state_dict.layer.weight" in out and "[64, 32]" in out and "bfloat16" in out
    assert fields["engine"].strip().startswith("nvrx ") and "fork worker" in fields["engine"]
    assert fields["world size"].strip().startswith("1")


def test_inspect_sharded_reads_step_from_meta(ckpts, capsys):
    code, out, _ = run(capsys, "inspect", ckpts.sharded, "--json")
    info = json.loads(out)
    assert code == 0 and info["layout"] == "sharded"
    assert (info["global_step"], info["epoch"]) == (7, 1)
    assert info["non_tensor_keys"] == list(ckpts.meta)
    assert info["num_tensors"] == 2 and info["tensor_bytes"] == 2 * 8 * 4 * 4


def test_inspect_stock_dcp_checkpoint(ckpts, capsys):
    code, out, _ = run(capsys, "inspect", ckpts.nocrc, "--json")
    info = json.loads(out)
    assert code == 0 and info["layout"] == "dcp" and info["status"] == "committed"
    assert (info["global_step"], info["epoch"]) == (120, 3)
    assert info["non_tensor_keys"] == ["global_step", "epoch"] and info["num_tensors"] == 4
    assert info["engine"] == "unknown" and info["world_size"] == "unknown"  # not written by this library


def test_inspect_incomplete(ckpts, tmp_path, capsys):
    no_meta = _copy(ckpts.single, tmp_path / "a.ckpt")
    (no_meta / ".metadata").unlink()
    code, out, _ = run(capsys, "inspect", no_meta, "--json")
    info = json.loads(out)
    assert code == 0 and info["status"] == "incomplete" and "no .metadata" in info["reason"]
    assert info["num_tensors"] is None and info["writer_ranks"] == 1 and info["files"] == 4  # 2 shard files, .asyncckpt.json, skeleton

    leftover = _copy(ckpts.single, tmp_path / f"{commit.INCOMPLETE_PREFIX}123-1")  # complete, never renamed
    code, out, _ = run(capsys, "inspect", leftover, "--json")
    info = json.loads(out)
    assert code == 0 and info["status"] == "incomplete" and "interrupted save" in info["reason"]
    assert info["global_step"] == 120

    code, out, _ = run(capsys, "inspect", no_meta)
    assert code == 0 and "incomplete" in out


# -------------------------------------------------------------------------------------------------
# verify


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
    # the library's reader (DCP, torch.load) checks no CRC: it loads the changed value without an error
    assert not torch.equal(dcp_format.load(path, weights_only=True)["state_dict"]["layer.weight"], weight)
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


# -------------------------------------------------------------------------------------------------
# convert


def test_convert_directory_to_a_file_that_stock_lightning_loads(ckpts, tmp_path, capsys):
    out = tmp_path / "out" / "model.ckpt"
    code, stdout, err = run(capsys, "convert", ckpts.single, out)
    assert code == 0 and "converted" in stdout, err
    assert_tree_equal(TorchCheckpointIO().load_checkpoint(out, weights_only=True), ckpts.ckpt)
    assert os.listdir(out.parent) == ["model.ckpt"]  # no temporary file left

    before = out.read_bytes()
    code, _, err = run(capsys, "convert", ckpts.single, out)
    assert_user_error(code, err, 2, str(out), "exists", "--force")
    assert out.read_bytes() == before
    code, _, err = run(capsys, "convert", ckpts.sharded, out, "--force")
    assert code == 0, err
    loaded = TorchCheckpointIO().load_checkpoint(out, weights_only=True)
    assert_tree_equal(loaded, {**ckpts.sharded_state, **ckpts.meta})  # Lightning's consolidated layout

    code, _, err = run(capsys, "convert", ckpts.single, ckpts.sharded, "--force")  # a directory: never replaced
    assert_user_error(code, err, 2, "not a regular file")
    assert commit.is_committed(ckpts.sharded)


def test_convert_file_to_a_directory_round_trip(ckpts, tmp_path, capsys):
    out = tmp_path / "restored.ckpt"
    in_flight = commit.tmp_for(tmp_path / "other.ckpt", "77-1")  # a training job's save in progress
    in_flight.mkdir()
    (in_flight / "__0_0.distcp").write_bytes(b"partial")
    code, _, err = run(capsys, "convert", ckpts.plain, out)
    assert code == 0, err
    expected = torch.load(ckpts.plain, weights_only=True)
    assert_tree_equal(dcp_format.load(out, weights_only=True), expected)
    assert sorted(os.listdir(tmp_path)) == sorted([in_flight.name, "restored.ckpt"])  # committed; nothing else touched
    shutil.rmtree(in_flight)
    assert run(capsys, "verify", out)[0] == 0

    code, _, err = run(capsys, "convert", ckpts.plain, out)
    assert_user_error(code, err, 2, "exists", "--force")
    back = tmp_path / "back.ckpt"
    assert run(capsys, "convert", ckpts.single, back)[0] == 0
    code, _, err = run(capsys, "convert", back, out, "--force")  # replaces the checkpoint directory
    assert code == 0, err
    assert_tree_equal(dcp_format.load(out, weights_only=True), ckpts.ckpt)

    other = tmp_path / "data"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    code, _, err = run(capsys, "convert", ckpts.plain, other, "--force")
    assert_user_error(code, err, 2, "not a checkpoint directory")
    assert os.listdir(other) == ["keep.txt"]


def test_convert_refuses_pickled_objects_unless_allowed(tmp_path, capsys):
    src = tmp_path / "custom.ckpt"
    torch.save({"global_step": 4, "state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"cfg": Config("x")}}, src)
    out = tmp_path / "custom_dir.ckpt"
    code, _, err = run(capsys, "convert", src, out)
    assert_user_error(code, err, 2, "weights_only=True", "--allow-pickle")
    assert not out.exists()
    code, _, err = run(capsys, "convert", src, out, "--allow-pickle")
    assert code == 0, err

    code, stdout, _ = run(capsys, "inspect", out, "--json")  # tensors listed; the state needs --allow-pickle
    info = json.loads(stdout)
    assert code == 0 and info["num_tensors"] == 1 and info["global_step"] == 4  # a plain item of its own
    assert any("--allow-pickle" in note for note in info["notes"])
    code, stdout, _ = run(capsys, "inspect", out, "--json", "--allow-pickle")
    assert code == 0 and json.loads(stdout)["global_step"] == 4

    code, _, err = run(capsys, "convert", out, tmp_path / "again.ckpt")
    assert_user_error(code, err, 2, "--allow-pickle")


def test_convert_bad_input(ckpts, tmp_path, capsys):
    tensor_file = tmp_path / "tensor.pt"
    torch.save(torch.ones(3), tensor_file)
    code, _, err = run(capsys, "convert", tensor_file, tmp_path / "x")
    assert_user_error(code, err, 2, "not a checkpoint")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    code, _, err = run(capsys, "convert", text, tmp_path / "y")
    assert_user_error(code, err, 2, str(text))
    no_meta = _copy(ckpts.single, tmp_path / "a.ckpt")
    (no_meta / ".metadata").unlink()
    code, _, err = run(capsys, "convert", no_meta, tmp_path / "z.ckpt")
    assert_user_error(code, err, 2, "incomplete")
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "notes.txt", "tensor.pt"]


# -------------------------------------------------------------------------------------------------
# clean


def test_clean_lists_then_removes_only_leftovers(ckpts, tmp_path, capsys):
    real = _copy(ckpts.single, tmp_path / "last.ckpt")
    leftover = commit.tmp_for(tmp_path / "epoch=1.ckpt", "4242-3")
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"x" * 1000)
    aside = tmp_path / f"{commit.INCOMPLETE_PREFIX}4242-1-replaced"
    aside.write_bytes(b"y" * 10)
    (tmp_path / "notes.txt").write_text("keep")

    code, out, err = run(capsys, "clean", tmp_path)
    assert code == 0 and err == ""
    assert f"would remove {leftover} (1.0 kB," in out and f"would remove {aside} (10 B," in out
    assert "2 leftover(s)" in out and "--yes" in out
    assert leftover.exists() and aside.exists()

    code, out, err = run(capsys, "clean", tmp_path, "--yes")
    assert code == 0 and err == ""
    assert f"removed {leftover}" in out and "removed 2 leftover(s), 1.0 kB" in out
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "notes.txt"]
    assert run(capsys, "verify", real)[0] == 0

    code, out, _ = run(capsys, "clean", tmp_path, "--yes")
    assert code == 0 and out.strip() == f"no leftovers of interrupted saves in {tmp_path}"


# -------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("command", [["inspect"], ["verify"], ["convert"], ["clean"]])
def test_missing_path(command, tmp_path, capsys):
    missing = tmp_path / "nope.ckpt"
    args = [*command, missing] + ([tmp_path / "out.ckpt"] if command == ["convert"] else [])
    code, _, err = run(capsys, *args)
    assert_user_error(code, err, 2, str(missing), "no such file or directory")


@pytest.mark.parametrize("command", ["inspect", "verify", "convert"])
def test_not_a_checkpoint(command, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    extra = [tmp_path / "out.ckpt"] if command == "convert" else []
    code, _, err = run(capsys, command, empty, *extra)
    assert_user_error(code, err, 2, str(empty), "not a checkpoint directory")
    if command != "convert":
        file = tmp_path / "file.ckpt"
        file.write_bytes(b"data")
        code, _, err = run(capsys, command, file)
        assert_user_error(code, err, 2, str(file), "not a checkpoint")
    code, _, err = run(capsys, "clean", tmp_path / "file.ckpt") if command == "inspect" else (2, "", "")
    if command == "inspect":
        assert_user_error(code, err, 2, "not a directory")


@pytest.mark.parametrize("command, expected_code", [("inspect", 2), ("verify", 1), ("convert", 2)])
def test_garbage_metadata(command, expected_code, tmp_path, capsys):
    bad = tmp_path / "bad.ckpt"
    bad.mkdir()
    (bad / ".metadata").write_bytes(b"\x00garbage, not a pickle")
    (bad / "__0_0.distcp").write_bytes(b"")
    extra = [tmp_path / "out.ckpt"] if command == "convert" else []
    code, _, err = run(capsys, command, bad, *extra)
    if command == "verify":
        assert code == 1 and "Traceback" not in err
        assert f"FAIL cannot read {bad / '.metadata'}" in err
    else:
        assert_user_error(code, err, expected_code, f"cannot read {bad / '.metadata'}")
    assert not (tmp_path / "out.ckpt").exists()


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_metadata_that_would_run_code_is_refused(ckpts, tmp_path, capsys):
    path = _copy(ckpts.single, tmp_path / "a.ckpt")
    marker = tmp_path / "code-ran"
    metadata = dcp_format.read_metadata(path)
    metadata.planner_data = _RunsCode(marker)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    for command in (["inspect", path], ["convert", path, tmp_path / "out.ckpt"]):
        code, _, err = run(capsys, *command)
        assert_user_error(code, err, 2, "posix.mkdir", "--allow-pickle")
        assert not marker.exists()
    assert run(capsys, "verify", path)[0] == 1 and not marker.exists()


def test_usage_errors(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "usage: lightning-asyncckpt" in err
    code, _, err = run(capsys, "inspect")
    assert code == 2 and "PATH" in err
    code, out, _ = run(capsys, "--help")
    assert code == 0 and all(c in out for c in ("inspect", "verify", "convert", "clean"))


# -------------------------------------------------------------------------------------------------
# the installed command


def test_python_dash_m(ckpts, tmp_path):
    cmd = [sys.executable, "-m", "lightning_asyncckpt"]
    done = subprocess.run([*cmd, "inspect", "--json", str(ckpts.single)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["global_step"] == 120
    missing = tmp_path / "missing.ckpt"
    done = subprocess.run([*cmd, "verify", str(missing)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"lightning-asyncckpt: error: {missing}: no such file or directory\n"


def test_console_script_is_declared():
    pyproject = (ROOT / "pyproject.toml").read_text()  # (no tomllib: Python 3.10 is supported)
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?:^\[|\Z)", pyproject, re.M | re.S)
    assert section is not None
    declared = re.search(r'^lightning-asyncckpt = "([\w.]+):(\w+)"$', section.group(1), re.M)
    assert declared is not None
    assert getattr(importlib.import_module(declared.group(1)), declared.group(2)) is cli.main
