"""``lightning-asyncckpt convert`` between a checkpoint directory and the single ``torch.save`` file that
stock Lightning loads, both ways: the result loads equal to its source, an existing target is replaced only with
``--force`` (and only if it is a checkpoint), pickled objects need ``--allow-pickle``, and bad input leaves
nothing behind."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch
from cli_checkpoints import ckpts_fixture  # noqa: F401 - the fixture ckpts
from cli_checkpoints import copy_dir as _copy
from lightning.fabric.plugins import TorchCheckpointIO

from helpers import assert_tree_equal, assert_user_error
from helpers import run_cli as run
from lightning_asyncckpt.format import dcp as dcp_format
from lightning_asyncckpt.storage import commit


@dataclasses.dataclass
class Config:  # an object that torch.load(weights_only=True) refuses
    name: str


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
