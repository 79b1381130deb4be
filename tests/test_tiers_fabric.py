"""The local tier in a Fabric loop, in this process (one device): ``FabricTiers`` saves every 2 steps and
resumes exactly, eagerly and with ``snapshot="lazy"`` (the loop calls ``io.wait_for_snapshot()`` before
each optimizer step, as the Fabric docs of both tiers say); a lazy save torn by an edit fails, unsaved."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from helpers import assert_tree_equal, clone_tree
from lightning_asyncckpt import AsyncCheckpointIO, CheckpointWriteError, FabricTiers, LocalTier, testing
from processes import PL_PYTHON, job_command, launch, rank_reports


def _state_of(state):
    return clone_tree({"model": state["model"].state_dict(), "optimizer": state["optimizer"].state_dict()["state"],
                       "step": state["step"]})


def _loop(tmp_path, steps, snapshot, resume=False, edit_after=None, hold=None, sigterm_at=None, persist_at=None):
    """Trains to ``steps`` (or resumes, and returns the step and state it resumed at); ``edit_after``: once the
    local save of that step returned, changes a weight in place before the next optimizer step;
    ``sigterm_at``: this process sends itself SIGTERM after that step (the tier then holds SIGTERM);
    ``persist_at``: ``fabric.save`` of that step to ``tmp_path/persistent.ckpt`` (a resume is offered it)."""
    (tmp_path / "local").mkdir(exist_ok=True)
    io = AsyncCheckpointIO("nvrx", snapshot=snapshot, local=LocalTier(
        tmp_path / "local", every_n_train_steps=2, replication_factor=1, timeout_s=60,
        emergency_signals=("SIGTERM",) if sigterm_at is not None else ()))
    io.copy_hook = hold
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
    fabric.launch()
    L.seed_everything(0)
    # 128 wide: each weight and moment is 64 KiB, the least a lazy snapshot leaves to its background copy
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    io.track_optimizers([optimizer])
    state = {"model": model, "optimizer": optimizer, "step": 0}
    tiers = FabricTiers(fabric)
    saved = {}
    with io:
        try:
            # at every start, with the same path (it names the run), whether it exists yet or not
            resumed = tiers.resume(state, persistent=tmp_path / "persistent.ckpt")
            if resume:
                assert resumed
                return state["step"], _state_of(state)
            assert not resumed
            g = torch.Generator().manual_seed(0)
            while state["step"] < steps:
                loss = model(torch.randn(8, 128, generator=g)).pow(2).mean()
                optimizer.zero_grad()
                fabric.backward(loss)
                if state["step"] == edit_after:
                    hold.wait_started(timeout_s=30)  # the save call returned; its copy waits
                    with torch.no_grad():
                        next(model.parameters()).add_(1.0)
                    hold.release()
                io.wait_for_snapshot()
                optimizer.step()
                state["step"] += 1
                saved[state["step"]] = _state_of(state)
                if state["step"] == persist_at:
                    fabric.save(tmp_path / "persistent.ckpt", state)
                if state["step"] == sigterm_at:
                    os.kill(os.getpid(), signal.SIGTERM)  # only a flag is set; step_end acts on it
                if tiers.step_end(state["step"], state):
                    break
        finally:
            tiers.close()
    return saved


@pytest.mark.parametrize("snapshot", ["eager", "lazy"])
def test_fabric_tiers_resume_the_newest_local_step_bit_exactly(tmp_path, snapshot):
    saved = _loop(tmp_path, 10, snapshot)
    step, state = _loop(tmp_path, 0, snapshot, resume=True)
    assert step == 10
    assert_tree_equal(state, saved[10], "resume from the local tier")


def test_a_lazy_fabric_local_save_torn_by_an_edit_fails_at_the_next_step_unsaved(tmp_path):
    hold = testing.HoldCopy(timeout_s=60)
    with pytest.raises(CheckpointWriteError, match="changed in place"):
        _loop(tmp_path, 6, "lazy", edit_after=2, hold=hold)
    holder = tmp_path / "local" / "asyncckpt-local" / "default" / "holder-0"
    assert not list(holder.glob("step-0000000002.*.json"))


def test_a_sigterm_handler_of_the_users_runs_after_the_emergency_save_and_may_exit(tmp_path):
    """A handler installed before ``FabricTiers`` is passed the signal once the emergency save of that step
    is complete; its ``sys.exit`` leaves the loop, and the next launch resumes at that step."""
    holder = tmp_path / "local" / "asyncckpt-local" / "default" / "holder-0"
    seen = []

    def mine(signum, frame):
        seen.append((signum, sorted(p.name for p in holder.glob("*.json"))))
        sys.exit(0)

    before = signal.signal(signal.SIGTERM, mine)
    try:
        with pytest.raises(SystemExit):
            _loop(tmp_path, 100, "eager", sigterm_at=3)
        assert signal.getsignal(signal.SIGTERM) is mine  # given back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert seen == [(signal.SIGTERM, ["step-0000000003.owner-0.json"])]  # once, the emergency save complete
    step, _ = _loop(tmp_path, 0, "eager", resume=True)
    assert step == 3


def test_a_persistent_fabric_checkpoint_newer_than_the_local_tier_wins(tmp_path, caplog):
    """A Fabric state has ``step``, not ``global_step``: the resume reads it from the persistent file and
    takes that file when it is newer than the local tier's newest step (10 here, the file 11)."""
    saved = _loop(tmp_path, 11, "eager", persist_at=11)
    with caplog.at_level("WARNING"):
        step, state = _loop(tmp_path, 0, "eager", resume=True)
    assert step == 11
    assert_tree_equal(state, saved[11], "resume from the persistent file")
    assert "its step 11 is newer than the local tier's 10" in caplog.text


# the tensor-parallel case runs in `make test-all` (80 s at load; `make test` keeps its 15 minutes)
@pytest.mark.parametrize("distribution,snapshot,layout", [
    ("pytorch_lightning", "eager", "fsdp2"), ("lightning", "lazy", "fsdp2"),
    pytest.param("lightning", "eager", "tp", marks=pytest.mark.slow)])
def test_fabric_sharded_local_tier_resumes_each_ranks_shards(tmp_path, distribution, snapshot, layout):
    """``FabricTiers`` with ``AsyncFabricModelParallelStrategy`` over 2 CPU ranks (FSDP2, or 2-way tensor
    parallel) saves each rank's shards to the local tier (lazy: the optimizer's shards copied while the next
    step runs), and ``resume`` loads them back onto the model's mesh bit for bit; under ``.venv-pl`` with
    ``lightning_fabric`` alone too (``tests/jobs/pl_fabric_tier_job.py``)."""
    python = PL_PYTHON if distribution == "pytorch_lightning" else Path(sys.executable)
    if not python.exists():
        pytest.skip(f"{python} is missing: `make test` builds it (the pytorch-lightning environment)")
    out = tmp_path / "out"
    (out / "local").mkdir(parents=True)
    with launch([*job_command("pl_fabric_tier_job", python), "--out", str(out)], out, 120, cwd=tmp_path,
                env={"JOB_SNAPSHOT": snapshot, "JOB_LAYOUT": layout}) as job:
        job.wait()
    for report in rank_reports(out, 2, lambda: (out / "log.txt").read_text()[-4000:]):
        assert report["lightning_importable"] is (distribution == "lightning")
        assert report["complete"] == 6 and report["resumed"] and report["step"] == 6, report
        assert report["tensors"] == 16 and report["exact"] is True, report
        assert report.get("deferred", False) is (snapshot == "lazy")


def test_fabric_tiers_with_a_strategy_that_takes_no_local_tier_says_what_to_give(tmp_path):
    """Fabric's own ``ModelParallelStrategy`` takes no checkpoint plugin: the error names the strategy to use."""
    from lightning.fabric.strategies import ModelParallelStrategy

    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(lambda m, _mesh: m))
    with pytest.raises(ValueError, match="AsyncFabricModelParallelStrategy"):
        FabricTiers(fabric)
    io = AsyncCheckpointIO("nvrx")
    with pytest.raises(ValueError, match=r"plugins need an AsyncCheckpointIO\(local=LocalTier"):
        FabricTiers(L.Fabric(accelerator="cpu", devices=1, plugins=[io]))
