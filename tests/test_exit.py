"""Interpreter exit without teardown (Fabric never tears down): the last save still lands."""

import json
import os
import subprocess
import sys

import psutil
import pytest
import torch

from helpers import combo_params, job_script
from lightning_asyncckpt import commit, dcp_format

JOB = job_script("exit_job.py")


def _run(tmp_path, how, engine="nvrx", worker="persistent", **extra):
    cmd = [sys.executable, JOB, "--how", how, "--engine", engine, "--worker", worker, "--out", str(tmp_path)]
    for k, v in extra.items():
        cmd += [f"--{k}", str(v)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the script did not exit within 120 s: {e.stderr}")
    report = json.loads((tmp_path / "report.json").read_text())
    for pid in report["pids"]:  # no writer outlives the script
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    return proc, report


@pytest.mark.parametrize("how", ["end", "raise"])
@pytest.mark.parametrize("engine,worker", combo_params(fast={("nvrx", "persistent")}))
def test_the_last_save_lands_when_the_script_exits(tmp_path, how, engine, worker):
    proc, report = _run(tmp_path, how, engine, worker)
    assert proc.returncode == (0 if how == "end" else 1), proc.stderr[-3000:]
    if how == "raise":
        assert "uncaught error after fabric.save" in proc.stderr
    assert report["committed_at_return"] is False and report["pids"]
    assert commit.is_committed(tmp_path / "ckpt"), proc.stderr[-3000:]
    loaded = dcp_format.load(tmp_path / "ckpt", weights_only=True)
    assert loaded["step"] == 3
    for k, v in report["expected"].items():
        assert torch.equal(loaded["model"][k], torch.tensor(v)), k  # the state at save time
    assert "1 of 1 checkpoint write(s) in flight committed before stopping" in proc.stderr


def test_the_exit_drain_is_bounded(tmp_path):
    """A write that outlasts ``drain_timeout_s`` is dropped at exit: no partial checkpoint, no hang."""
    proc, _ = _run(tmp_path, "end", delay=60, drain=0.5)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["report.json"]
    assert "0 of 1 checkpoint write(s) in flight committed before stopping" in proc.stderr
