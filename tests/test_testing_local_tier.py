"""``lightning_asyncckpt.testing.local_tier``: what a user's CI does to a node's local tier between two runs of a
real single-device fit (local saves every 2 steps, persistent every 8), and the tier's next resume seeing it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import TinyModel, loader, trainer
from lightning_asyncckpt import AsyncCheckpointIO, LocalTier
from lightning_asyncckpt.testing import local_tier

pytest.importorskip("nvidia_resiliency_ext")


class StartStep(L.Callback):
    def __init__(self):
        self.step = None

    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


def _fit(base, max_steps, ckpt_path=None):
    io = AsyncCheckpointIO("nvrx", local=LocalTier(base / "local", every_n_train_steps=2, replication_factor=1))
    start = StartStep()
    ck = ModelCheckpoint(dirpath=base / "c", every_n_train_steps=8, save_last=True)
    t = trainer(base, [io], [start, ck], max_steps=max_steps)
    t.fit(TinyModel(), loader(), ckpt_path=ckpt_path)
    return start.step


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """Ten steps: step 8 persistent, step 10 in the local tier only."""
    base = tmp_path_factory.mktemp("fit")
    (base / "local").mkdir()
    _fit(base, 10)
    return base


@pytest.fixture
def job(fitted, tmp_path):
    shutil.copytree(fitted, tmp_path / "job")
    # the copy is the same run, its persistent directory moved along: its run record says so (a run is
    # named by where its persistent checkpoints go, tiers/run_identity.py)
    for record in (tmp_path / "job" / "local").rglob("run.record"):
        raw = json.loads(record.read_text())
        raw["destination"] = raw["destination"].replace(str(fitted), str(tmp_path / "job"))
        record.write_text(json.dumps(raw))
    return tmp_path / "job"


def _resume(job, caplog):
    with caplog.at_level("WARNING", logger="lightning_asyncckpt"):
        return _fit(job, 12, ckpt_path="last")


def test_held_lists_the_newest_share_and_an_untouched_resume_takes_it(job, caplog):
    [share] = local_tier.held(job / "local")
    assert (share.step, share.owner, share.holder) == (10, 0, 0) and share.path.is_file()
    assert local_tier.held(job / "local", session="other") == []
    assert _resume(job, caplog) == 10  # the control: without a fault the local step wins


def test_a_corrupted_share_fails_its_check_and_the_job_resumes_from_the_persistent_tier(job, caplog):
    changed = local_tier.corrupt_share(job / "local", owner=0)
    assert changed == local_tier.held(job / "local")[0].path
    assert _resume(job, caplog) == 8
    assert "step 10 failed its checks: rank 0's share in the copy held by rank 0 has CRC32" in caplog.text


def test_a_dropped_share_leaves_its_step_incomplete_and_the_job_resumes_from_the_persistent_tier(job, caplog):
    removed = local_tier.drop_share(job / "local", owner=0, step=10)
    assert sorted(p.suffix for p in removed) == [".head", ".json", ".pt"] and not any(p.exists() for p in removed)
    assert local_tier.held(job / "local") == []
    assert _resume(job, caplog) == 8
    assert "local tier: no rank holds any local checkpoint" in caplog.text


def test_a_lost_node_keeps_nothing_of_the_tier_and_nothing_else_is_touched(job, caplog):
    keep = job / "local" / "not-the-tiers.txt"
    keep.write_text("mine")
    assert local_tier.lose_node(job / "local") > 0
    assert keep.read_text() == "mine" and local_tier.held(job / "local") == []
    assert local_tier.lose_node(job / "local") == 0  # already lost: nothing to do
    assert _resume(job, caplog) == 8
    assert "local tier: no rank holds any local checkpoint (every local directory is empty)" in caplog.text


def test_a_node_whose_files_a_process_still_holds_is_not_lost_and_nothing_is_removed(job):
    share = local_tier.held(job / "local")[0].path
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(share)!r}, 'rb'); print('open', flush=True);"
                               " import sys; sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "open\n"  # handshake: the file is open in that process
        with pytest.raises(RuntimeError, match=rf"is in use by pid {holder.pid} .*stop the job first"):
            local_tier.lose_node(job / "local")
        assert share.is_file()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_a_share_that_is_not_there_or_not_one_is_refused_naming_what_the_node_holds(job, tmp_path):
    with pytest.raises(ValueError, match=r"owner=3, step=None, holder=None\): .* holds no such share; it holds:"
                                         r" step 10 owner 0 holder 0"):
        local_tier.corrupt_share(job / "local", owner=3)
    with pytest.raises(ValueError, match="holds no such share"):
        local_tier.drop_share(job / "local", owner=0, step=4)
    with pytest.raises(ValueError, match=r"holds no local-tier share of session 'default'"):
        local_tier.corrupt_share(tmp_path, owner=0)
    # two holders on one node keep the share (a jump smaller than the node): which copy is meant must be said
    root = job / "local" / "asyncckpt-local" / "default"
    shutil.copytree(root / "holder-0", root / "holder-1")
    with pytest.raises(ValueError, match=r"several holders on this node keep that share \(0, 1\); pass holder="):
        local_tier.corrupt_share(job / "local", owner=0)
    assert local_tier.corrupt_share(job / "local", owner=0, holder=1).parent.name == "holder-1"
