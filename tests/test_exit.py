"""Interpreter exit without teardown (Fabric never tears down): the last save still lands."""

import os

import psutil
import pytest
import torch

from helpers import combo_params
from lightning_asyncckpt.storage import commit
from processes import job_command, launch
from reports import read_report

JOB = job_command("exit_job")


def _run(tmp_path, how, engine="nvrx", worker="persistent", **extra):
    """Runs the script (its output in ``<tmp_path>/job``) and returns its exit status, its output and its report."""
    out = tmp_path / "job"
    out.mkdir()
    cmd = [*JOB, "--how", how, "--engine", engine, "--worker", worker, "--out", out]
    for k, v in extra.items():
        cmd += [f"--{k}", str(v)]
    with launch(cmd, tmp_path, timeout=120) as job:
        code = job.wait()
    report = read_report(out / "report.json")
    for pid in report["pids"]:  # no writer outlives the script
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    return code, job.log_text(), report


@pytest.mark.parametrize("how", ["end", pytest.param("raise", marks=pytest.mark.slow)])
@pytest.mark.parametrize("engine,worker", combo_params(fast={("nvrx", "persistent")}))
def test_the_last_save_lands_when_the_script_exits(tmp_path, how, engine, worker):
    code, log, report = _run(tmp_path, how, engine, worker)
    assert code == (0 if how == "end" else 1), log[-3000:]
    if how == "raise":
        assert "uncaught error after fabric.save" in log
    assert report["committed_at_return"] is False and report["pids"]
    assert commit.is_complete(tmp_path / "job" / "ckpt"), log[-3000:]
    loaded = torch.load(tmp_path / "job" / "ckpt", weights_only=True)  # stock's format: one torch.save file
    assert loaded["step"] == 3
    for k, v in report["expected"].items():
        assert torch.equal(loaded["model"][k], torch.tensor(v)), k  # the state at save time
    assert "1 of 1 checkpoint write(s) in flight committed before stopping" in log


def test_the_exit_drain_is_bounded(tmp_path):
    """A write that outlasts ``drain_timeout_s`` is dropped at exit: no partial checkpoint, no hang."""
    code, log, _ = _run(tmp_path, "end", delay=60, drain=0.5)
    assert code == 0, log[-3000:]
    assert sorted(os.listdir(tmp_path / "job")) == ["report.json"]
    assert "0 of 1 checkpoint write(s) in flight committed before stopping" in log
