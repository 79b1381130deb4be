"""The ``lightning-asyncckpt`` command line as a whole, on real checkpoints written by ``AsyncCheckpointIO``:
the errors every command gives for a missing path, a directory or file that is not a checkpoint, and a
``.metadata`` that is garbage or would run code; usage errors; and the installed command (``python -m``, the
console script). Each command has its own file: ``test_cli_inspect.py``, ``test_cli_verify.py``,
``test_cli_convert.py``, ``test_cli_clean.py``."""

from __future__ import annotations

import importlib
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_checkpoints import ckpts_fixture  # noqa: F401 - the fixture ckpts
from cli_checkpoints import copy_dir as _copy

from helpers import assert_user_error
from helpers import run_cli as run
from lightning_asyncckpt.format import dcp as dcp_format
from lightning_asyncckpt.tools import cli

ROOT = Path(__file__).resolve().parents[1]


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
