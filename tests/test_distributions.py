"""Both Lightning distributions: with ``pip install pytorch-lightning`` alone (``pytorch_lightning`` and
``lightning_fabric``, no ``lightning``), the README's quick start, ``load_from_checkpoint``, resuming from
``ckpt_path="last"``, a 2-rank DDP run (stock DDP and ``AsyncDDPStrategy``), ``lightning_fabric.Fabric`` and a
resume from the local tier work as with ``lightning``.

The environment is ``.venv-pl``, which ``make test`` builds beside ``.venv`` (pinned torch,
``pytorch-lightning``, nvidia-resiliency-ext and this checkout); the job runs there in its own process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from processes import PL_PYTHON, job_command, launch, rank_reports
from reports import RankReport


@pytest.fixture
def pl_python() -> Path:
    if not PL_PYTHON.exists():
        message = f"{PL_PYTHON} is missing: `make test` builds it (the pytorch-lightning environment)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return PL_PYTHON


def _run(python: Path, case: str, tmp_path: Path, ranks: int) -> list[RankReport]:
    out = tmp_path / "out"
    with launch([*job_command("pl_job", python), "--case", case, "--out", str(out)], out, 240, cwd=tmp_path) as job:
        job.wait()
    reports = rank_reports(out, ranks, lambda: (out / "log.txt").read_text()[-4000:])
    for report in reports:
        assert report["lightning_importable"] is False  # the standalone distribution only
        assert report["plugin"] == "AsyncCheckpointIO" and report["finalizers"] >= 1
    return reports


def test_pytorch_lightning_alone_quick_start_load_and_resume(pl_python, tmp_path):
    (r0,) = _run(pl_python, "quickstart", tmp_path, ranks=1)
    assert r0["files"] == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    assert r0["last_step"] == 6 and r0["loaded_equal"] and r0["hparams"] == {"width": 8}
    assert r0["resumed_step"] == 8
    assert r0["files_after_resume"] == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]


@pytest.mark.parametrize("case", ["ddp", "async_ddp"])
def test_pytorch_lightning_alone_ddp(pl_python, tmp_path, case):
    """Stock DDP with the plugin (rank 0 writes a file), and ``AsyncDDPStrategy`` (every rank writes a share of
    a DCP directory): both on ``pytorch_lightning``'s own strategy classes."""
    r0, _r1 = _run(pl_python, case, tmp_path, ranks=2)
    assert r0["files"] == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    assert r0["last_step"] == 6 and r0["loaded_equal"]
    assert r0.get("last_is_dir", False) is (case == "async_ddp")


def test_lightning_fabric_alone(pl_python, tmp_path):
    (r0,) = _run(pl_python, "fabric", tmp_path, ranks=1)
    assert r0["loaded_equal"] is True


def test_pytorch_lightning_alone_resumes_from_the_local_tier(pl_python, tmp_path):
    """``LocalTier`` on ``pytorch_lightning``'s Trainer: ``ckpt_path="last"`` picks local step 10 over the
    persistent step 8, and the model starts with step 10's weights exactly."""
    (r0,) = _run(pl_python, "local", tmp_path, ranks=1)
    assert r0["resumed_step"] == 10 and r0["ckpt_path"].endswith("restore-step-10"), r0
    assert r0["start_equal"] is True
    assert "epoch=0-step=8.ckpt" in r0["persistent"]  # the local tier deletes nothing persistent


def test_lightning_fabric_alone_resumes_from_the_local_tier(pl_python, tmp_path):
    """``FabricTiers`` on ``lightning_fabric.Fabric``: a new loop resumes at local step 10, model and optimizer
    state exactly."""
    (r0,) = _run(pl_python, "fabric_local", tmp_path, ranks=1)
    assert r0.get("resumed") is True and r0["resumed_step"] == 10, r0
    assert r0["start_equal"] is True
