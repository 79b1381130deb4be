"""The local tier with a single-device Trainer, in this process (the persistent writer is a real worker):
``ckpt_path="last"`` picks the newer tier, and a SIGTERM stops training after an emergency local save."""

from __future__ import annotations

import os
import signal

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import TinyModel, assert_tree_equal, clone_tree, loader, mounted_tmpfs, slurm_job, trainer
from lightning_asyncckpt import AsyncCheckpointIO, CheckpointWriteError, LocalTier, testing
from lightning_asyncckpt.integration import replaced_handlers


class States(L.Callback):
    def __init__(self):
        self.saved, self.start_step, self.start = {}, None, None

    def _state(self, trainer, pl_module):
        return clone_tree({"model": pl_module.state_dict(), "opt": trainer.optimizers[0].state_dict()["state"]})

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.saved[trainer.global_step] = self._state(trainer, pl_module)

    def on_train_start(self, trainer, pl_module):
        self.start_step, self.start = trainer.global_step, self._state(trainer, pl_module)


def _fit(tmp_path, max_steps, ckpt_path=None, every=8, callbacks=(), local_every=2, snapshot="eager", hold=None,
         width=16, dirpath=None, **kw):
    # no replication_factor: on one device the default keeps no replica (nothing to give it)
    io = AsyncCheckpointIO("nvrx", snapshot=snapshot, local=LocalTier(tmp_path / "local", every_n_train_steps=local_every))
    io.copy_hook = hold
    states = States()
    ck = ModelCheckpoint(dirpath=dirpath or tmp_path / "c", every_n_train_steps=every, save_top_k=-1, save_last=True)
    t = trainer(tmp_path, [io], [states, *callbacks, ck], max_steps=max_steps, **kw)
    L.seed_everything(0)
    t.fit(TinyModel(width=width), loader(width=width, n=512, batch_size=4), ckpt_path=ckpt_path)
    return t, states


@pytest.fixture
def local_dir(tmp_path):
    (tmp_path / "local").mkdir()
    return tmp_path / "local"


# the eager local save's resume is also every case of test_tiers_trainer_cases.py (mid-epoch, accumulation,
# schedulers, max_steps), so its run here is in `make test-all`, to keep `make test` under 15 minutes
@pytest.mark.parametrize("snapshot", [pytest.param("eager", marks=pytest.mark.slow), "lazy"])
def test_last_resumes_from_the_local_step_when_it_is_newer(tmp_path, local_dir, snapshot):
    """``snapshot="lazy"``: the local saves' optimizer tensors copied while the next step runs, bit for bit."""
    # width 128: each weight and moment is 64 KiB, the least a lazy snapshot leaves to its background copy
    _, first = _fit(tmp_path, 10, snapshot=snapshot, width=128)  # persistent at 8, local at 2, 4, ..., 10
    holder = local_dir / "asyncckpt-local" / "default" / "holder-0"
    assert sorted(p.name for p in holder.glob("*.pt")) == ["step-0000000010.owner-0.pt"]  # older ones removed
    t, again = _fit(tmp_path, 11, ckpt_path="last", snapshot=snapshot, width=128)
    assert again.start_step == 10 and t.ckpt_path.endswith("restore-step-10")
    assert_tree_equal(again.start, first.saved[10], "resume from the local tier")
    assert (tmp_path / "c" / "epoch=0-step=8.ckpt").is_file()  # the local tier deletes nothing persistent


def test_a_lazy_local_save_whose_weights_change_before_their_copy_fails_and_commits_nothing(tmp_path, local_dir):
    """The local save of step 2 returns before its weights are copied (held); a callback then changes a weight
    in place before the optimizer step: that save fails on the next step, naming the tensor, and nothing
    of step 2 is committed, rather than a checkpoint holding weights from after it."""
    hold = testing.HoldCopy(timeout_s=60)

    class EditAfterTheSave(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2:
                hold.wait_started(timeout_s=30)  # the save call of step 2 has returned; its copy waits
                with torch.no_grad():
                    pl_module.net[0].weight.add_(1.0)
                hold.release()

    with pytest.raises(CheckpointWriteError, match="changed in place"):
        _fit(tmp_path, 6, every=100, snapshot="lazy", hold=hold, callbacks=[EditAfterTheSave()], width=128)
    holder = local_dir / "asyncckpt-local" / "default" / "holder-0"
    assert not list(holder.glob("step-0000000002.*.json"))


def test_run_from_a_source_checkout_without_the_entry_point_the_local_tier_still_saves(tmp_path, local_dir, monkeypatch):
    """No entry point installed (the package on ``PYTHONPATH``): the local tier saves, as installed. Before,
    no callback drove it, and it saved nothing, silently."""
    from lightning_asyncckpt.integration.lightning_api import trainer_module

    monkeypatch.setattr(trainer_module("trainer.connectors.callback_connector"), "_load_external_callbacks",
                        lambda group: [])
    _, states = _fit(tmp_path, 4, every=100)
    assert sorted(states.saved) == [2, 4]
    holder = local_dir / "asyncckpt-local" / "default" / "holder-0"
    assert sorted(p.name for p in holder.glob("*.pt")) == ["step-0000000004.owner-0.pt"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_model_resumes_from_the_local_step_bit_exactly(tmp_path, local_dir):
    """On a GPU: the shares copied from CUDA memory into the mapped files, and the restored step loaded
    back onto the GPU, bit for bit (``scripts/gpu_check.sh`` runs it)."""
    _, first = _fit(tmp_path, 10, accelerator="gpu")
    t, again = _fit(tmp_path, 11, ckpt_path="last", accelerator="gpu")
    assert again.start_step == 10 and t.ckpt_path.endswith("restore-step-10")
    assert all(v.is_cuda for v in again.start["model"].values())
    assert_tree_equal(again.start, first.saved[10], "resume on the GPU from the local tier")


def test_the_first_local_saves_files_are_made_without_running_the_users_checkpoint_hooks(tmp_path, local_dir):
    """Before the first local save its files are made ahead, sized from the model and optimizer states:
    ``on_save_checkpoint`` runs for the local saves (steps 2 and 4) and for no other step."""
    _, states = _fit(tmp_path, 4, every=100)
    assert sorted(states.saved) == [2, 4]
    holder = local_dir / "asyncckpt-local" / "default" / "holder-0"
    assert sorted(p.name for p in holder.glob("*.pt")) == ["step-0000000004.owner-0.pt"]


def test_last_resumes_from_the_persistent_step_when_it_is_newer(tmp_path, local_dir):
    _, first = _fit(tmp_path, 8, local_every=3)  # local at 3 and 6, persistent at 8
    t, again = _fit(tmp_path, 9, ckpt_path="last", local_every=3)
    assert again.start_step == 8 and t.ckpt_path.endswith("last.ckpt")
    assert_tree_equal(again.start, first.saved[8], "resume from the persistent tier")


def test_last_resumes_from_a_newer_persistent_step_on_s3(tmp_path, local_dir, s3, caplog):
    """The persistent tier on an S3-protocol server (moto on loopback), as in the README: its step is read
    from the object's pickle (a few range reads), so a persistent step newer than the local tier's wins."""
    _, first = _fit(tmp_path, 8, local_every=3, dirpath="s3://ckpt/run1")  # local at 3 and 6, persistent at 8
    with caplog.at_level("WARNING"):
        t, again = _fit(tmp_path, 9, ckpt_path="last", local_every=3, dirpath="s3://ckpt/run1")
    assert again.start_step == 8 and str(t.ckpt_path).endswith("last.ckpt")
    assert_tree_equal(again.start, first.saved[8], "resume from the persistent tier on S3")
    assert "its step 8 is newer than the local tier's 6" in caplog.text


class SigtermAt(L.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)  # only a flag is set; the next boundary acts on it


def test_sigterm_saves_the_step_locally_and_stops_training_without_an_error(tmp_path, local_dir):
    before = signal.getsignal(signal.SIGTERM)
    t, first = _fit(tmp_path, 100, callbacks=[SigtermAt(3)])
    # the signal came in a callback before the finalizer's: that same step's boundary acts on it
    assert t.global_step == 3 and not t.interrupted
    assert signal.getsignal(signal.SIGTERM) == before  # handlers given back
    _, again = _fit(tmp_path, 5, ckpt_path="last")
    assert again.start_step == 3  # 3 is not a multiple of every_n_train_steps=2: the emergency save
    assert_tree_equal(again.start, first.saved[3], "resume after the emergency save")


def test_a_sigterm_handler_of_the_users_runs_once_after_the_emergency_save(tmp_path, local_dir):
    """Stock Lightning calls a SIGTERM handler installed before ``fit`` from its own composed handler. The
    local tier passes the signal on to it (not to Lightning's notifier) once the emergency save is complete."""
    holder = local_dir / "asyncckpt-local" / "default" / "holder-0"
    seen = []

    def mine(signum, frame):
        seen.append((signum, sorted(p.name for p in holder.glob("*.json"))))

    before = signal.signal(signal.SIGTERM, mine)
    try:
        t, _ = _fit(tmp_path, 100, callbacks=[SigtermAt(3)])
        assert signal.getsignal(signal.SIGTERM) is mine  # given back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert t.global_step == 3 and not t.interrupted
    assert seen == [(signal.SIGTERM, ["step-0000000003.owner-0.json"])]


def test_the_local_argument_is_checked(tmp_path):
    with pytest.raises(TypeError, match=r"AsyncCheckpointIO\(local=\.\.\.\) takes a LocalTier"):
        AsyncCheckpointIO(local=str(tmp_path))


def test_a_missing_local_directory_is_refused_at_setup(tmp_path):
    with pytest.raises(Exception, match=r"does not exist on node 0 \(global rank 0\).*mkdir -p"):
        _fit(tmp_path, 2)
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").iterdir())


class FillAt(L.Callback):
    """At ``step``, another process's file fills the local tier's filesystem (a real ENOSPC for the next
    local save)."""

    def __init__(self, step, path):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == self.step:
            trainer.strategy.checkpoint_io.session.tier.finish()  # the local save before is written in full first
            with open(self.path, "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                except OSError:
                    pass


def test_a_local_save_that_hits_enospc_raises_on_the_next_step_and_keeps_the_previous_step(tmp_path):
    with mounted_tmpfs(tmp_path / "local", "2m") as local:
        with pytest.raises(CheckpointWriteError, match=r"rank 0: LocalTierError: local save of step 4: OSError.*No space left"):
            _fit(tmp_path, 100, callbacks=[FillAt(3, local / "other-process.bin")])
        holder = local / "asyncckpt-local" / "default" / "holder-0"
        assert sorted(p.name for p in holder.glob("*.pt")) == ["step-0000000002.owner-0.pt"]


class SignalAt(L.Callback):
    def __init__(self, step, signum):
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)  # only a flag is set; the next boundary acts on it


def test_slurm_requeue_signal_saves_locally_then_lets_lightning_save_and_requeue(tmp_path, local_dir, monkeypatch,
                                                                                  caplog):
    """Under Lightning's SLURM auto-requeue, SIGUSR1 is the requeue signal. The local tier saves the step and
    stops training, and then passes the signal on, outside the handler, to Lightning's requeue: it writes
    ``hpc_ckpt_1.ckpt`` and runs ``scontrol requeue``, as without the local tier."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    slurm_job(monkeypatch, tmp_path)
    before = signal.getsignal(signal.SIGUSR1)
    io = AsyncCheckpointIO("nvrx", local=LocalTier(local_dir, every_n_train_steps=2, replication_factor=1))
    states = States()
    t = trainer(tmp_path, [io, SLURMEnvironment(auto_requeue=True)], [states, SignalAt(3, signal.SIGUSR1)],
                max_steps=100, enable_checkpointing=False)
    try:
        with caplog.at_level("INFO"):
            L.seed_everything(0)
            t.fit(TinyModel(width=16), loader(width=16, n=512, batch_size=4))
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert t.global_step == 3 and not t.interrupted
    assert "requeing job 4242" in caplog.text  # Lightning's handler ran
    hpc = io.load_checkpoint(tmp_path / "hpc_ckpt_1.ckpt", weights_only=False)
    assert hpc["global_step"] == 3
    holder = local_dir / "asyncckpt-local" / "default" / "holder-0"
    assert (holder / "step-0000000003.owner-0.json").is_file()  # the emergency local save came first


def test_only_the_users_own_handlers_are_passed_on_never_lightnings():
    """Pure logic on Lightning's real composed handlers: its SIGTERM notifier (which kills the launcher's
    processes and runs a collective) is never passed the signal; the user's handler inside it is."""
    from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector

    connector = _SignalConnector(trainer=None)

    def mine(signum, frame):
        pass

    sigterm = _HandlersCompose([connector._sigterm_notifier_fn, connector._sigterm_handler_fn, _HandlersCompose(mine)])
    assert replaced_handlers.users_own(sigterm) == [mine]
    assert replaced_handlers.users_own(mine) == [mine]
    assert replaced_handlers.users_own(signal.SIG_DFL) == replaced_handlers.users_own(None) == []
    assert replaced_handlers.is_lightnings_requeue(_HandlersCompose([connector._slurm_sigusr_handler_fn]))
    assert not replaced_handlers.is_lightnings_requeue(sigterm) and not replaced_handlers.is_lightnings_requeue(mine)


def test_a_stock_sharded_strategy_with_the_local_tier_is_refused_at_setup_naming_the_one_to_use(tmp_path, local_dir):
    """Lightning's own ``ModelParallelStrategy`` loads its checkpoints without the plugin, so it could save to
    the local tier but never resume from it: fit refuses it before the first step, and nothing is saved.
    (``FSDPStrategy`` and ``DeepSpeedStrategy`` are refused alike; Lightning runs them on GPUs only.)"""
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_asyncckpt.tiers.cliques import TierConfigError

    # the strategy's launcher sets LOCAL_RANK, WORLD_SIZE, ... in this process and starts a process group of
    # one: both undone after, or a later job started from here would take itself for an already launched rank
    saved = dict(os.environ)
    try:
        with pytest.raises(TierConfigError, match="use `lightning_asyncckpt.AsyncModelParallelStrategy"):
            _fit(tmp_path, 4, strategy=ModelParallelStrategy())
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if dist.is_initialized():
            dist.destroy_process_group()
    assert not list(local_dir.rglob("*.pt"))
