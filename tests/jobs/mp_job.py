"""ModelParallel (FSDP2) jobs on gloo/CPU for tests/test_model_parallel.py. Each rank writes <out>/rank<r>.json.

``fit`` runs on 2 ranks; ``resume1`` on 1 rank (from a 2-rank checkpoint, then saves one of its own);
``resume2`` on 2 ranks from that 1-rank checkpoint.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from helpers import FailOnRankFrom, ShardedModel, assert_tree_equal, clone_tree, loader
from lightning_asyncckpt import AsyncCheckpointIO, AsyncModelParallelStrategy, testing
from lightning_asyncckpt.integration.io import META_FILE
from lightning_asyncckpt.storage import commit
from processes import other_children, run_job

WIDTH = 64
DATA = dict(width=WIDTH, n=64, batch_size=4)  # 8 steps per epoch per rank on 2 ranks


def full_state(trainer, pl_module):
    """(all ranks) The full model and optimizer state, gathered: what a checkpoint must contain."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)  # on every rank (cpu_offload would keep it on rank 0 only)
    model = get_model_state_dict(pl_module, options=opts)
    optim = get_optimizer_state_dict(pl_module, trainer.optimizers[0], options=opts)
    return _sorted({"state_dict": dict(model), "optimizer_0": {"state": dict(optim["state"])}})


def _sorted(tree):
    """A copy with dict keys in sorted order (DCP does not keep the order of optimizer state keys)."""
    if isinstance(tree, dict):
        return {k: _sorted(tree[k]) for k in sorted(tree, key=str)}
    return clone_tree(tree)


class FullStateRecorder(L.Callback):
    def __init__(self):
        self.copies = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.copies[trainer.global_step] = full_state(trainer, pl_module)


class ResumeCheck(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step
        self.state = full_state(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self.final = full_state(trainer, pl_module)


class ProbedStrategy(AsyncModelParallelStrategy):
    """Records whether each checkpoint was already complete when ``save_checkpoint`` returned."""

    complete_on_return: list

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        existed = Path(filepath).exists()  # `last.ckpt` is saved again over the committed one
        super().save_checkpoint(checkpoint, filepath, storage_options)
        self.complete_on_return = getattr(self, "complete_on_return", [])
        if not existed:
            self.complete_on_return.append((Path(filepath) / ".metadata").exists())


class Rank0LoadsFirst(AsyncModelParallelStrategy):
    """Rank 1 reads ``meta.pt`` (the last file of a sharded load, which each rank reads alone) only once
    rank 0's ``load_checkpoint`` has returned, and with it rank 0's local copy of a remote checkpoint is
    gone: as for ranks on different nodes, each rank must read its own copy."""

    def __init__(self, signal, **kw):
        super().__init__(**kw)
        self.signal = Path(signal)

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        load = torch.load

        def after_rank0(f, *a, **k):  # a handshake: rank 0 touches the signal file when its load returns
            deadline = time.monotonic() + 60
            while isinstance(f, (str, os.PathLike)) and Path(f).name == META_FILE and not self.signal.exists():
                assert time.monotonic() < deadline, "rank 0's load_checkpoint did not return within 60 s"
                time.sleep(0.01)
            return load(f, *a, **k)

        torch.load = after_rank0 if self.global_rank == 1 else load
        try:
            return super().load_checkpoint(checkpoint_path, weights_only)
        finally:
            torch.load = load
            if self.global_rank == 0:
                self.signal.touch()


def read_with_dcp(path, out):
    """The checkpoint read with torch.distributed.checkpoint alone (nothing from this package)."""
    target = os.path.join(out, f"read-{os.path.basename(path)}-{os.getpid()}.pt")
    dcp_to_torch_save(path, target)
    got = torch.load(target, weights_only=False)
    os.unlink(target)
    return _sorted({"state_dict": got["state_dict"], "optimizer_0": {"state": got["optimizer_0"]["state"]}})


def _trainer(args, strategy, callbacks, devices=2, plugins=(), **kw):
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, plugins=list(plugins), callbacks=callbacks,
        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.out, **kw,
    )


def _own_children():
    """Child processes other than the ranks (a process that is already exiting gets a moment to go)."""
    return other_children(lambda pid, line: "jobs.mp_job" in line)


def _resume(args, strategy, ckpt_path, max_steps, callbacks=(), plugins=()):
    L.seed_everything(7)
    check = ResumeCheck()
    t = _trainer(args, strategy, [check, *callbacks], plugins=plugins, max_steps=max_steps,
                 devices=2 if args.case != "resume1" else 1, enable_checkpointing=bool(callbacks))
    t.fit(ShardedModel(width=WIDTH), loader(**DATA), ckpt_path=ckpt_path)
    return check


def case_save(args, report):
    """Trains with sharded saves and checks every committed checkpoint against the state it was taken from."""
    _fit_and_check(args, report)


def case_fit(args, report):
    """``case_save``, then resumes from one of our checkpoints with stock ``ModelParallelStrategy`` and with
    ours (both start from the saved state exactly and continue identically), and from stock's with ours."""
    t, ck, rec = _fit_and_check(args, report)
    _resume_both_ways(args, report, ck, rec)


def _fit_and_check(args, report):
    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    io.write_hook = testing.DelayWrite(0.1)  # each write outlasts a few steps
    rec = FullStateRecorder()
    ck = ModelCheckpoint(dirpath=os.path.join(args.out, "c"), monitor="step", mode="max", save_top_k=2,
                         every_n_train_steps=4, save_last=True)
    strategy = ProbedStrategy(data_parallel_size=2, tensor_parallel_size=1)
    L.seed_everything(1)
    t = _trainer(args, strategy, [rec, ck], plugins=[io], max_steps=16)
    t.fit(ShardedModel(width=WIDTH), loader(**DATA))
    report["children_after_fit"] = _own_children()
    report["complete_on_return"] = strategy.complete_on_return
    report["records"] = {os.path.basename(r.path): [r.nbytes, r.local_nbytes] for r in io.history}
    report["info"] = commit.read_info(Path(ck.dirpath) / "last.ckpt")
    torch.distributed.barrier()
    report["files"] = sorted(os.listdir(ck.dirpath))
    if t.global_rank == 0:
        for name in report["files"]:
            path = os.path.join(ck.dirpath, name)
            report.setdefault("layout", {})[name] = {f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))}
            meta = torch.load(os.path.join(path, "meta.pt"), weights_only=False)
            assert_tree_equal(read_with_dcp(path, args.out), rec.copies[meta["global_step"]], name)
        report["verified"] = report["files"]
    torch.distributed.barrier()
    return t, ck, rec


def _resume_both_ways(args, report, ck, rec):
    # Stock ModelParallelStrategy resumes from our checkpoint, and so do we: both start from the saved state
    # exactly and continue identically. Stock saves at the end; we resume from that too.
    ours = os.path.join(ck.dirpath, "epoch=1-step=12.ckpt")
    stock_dir = os.path.join(args.out, "stock")
    stock_ck = ModelCheckpoint(dirpath=stock_dir, filename="final", every_n_train_steps=20)
    stock = _resume(args, ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), ours, 20, [stock_ck])
    again = _resume(args, AsyncModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), ours, 20)
    for check, who in ((stock, "stock"), (again, "ours")):
        assert check.step == 12, (who, check.step)
        assert_tree_equal(check.state, rec.copies[12], f"{who} resume state")
    assert_tree_equal(stock.final, again.final, "stock vs ours continuation")
    report["stock_resume_exact"] = True
    from_stock = _resume(
        args, AsyncModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        os.path.join(stock_dir, "final.ckpt"), 22,
    )
    assert from_stock.step == 20
    assert_tree_equal(from_stock.state, stock.final, "ours from stock's checkpoint")
    report["resume_from_stock_exact"] = True
    report["children_after_resume"] = _own_children()


def case_remote(args, report):
    """Sharded saves to an S3 URL (``--dir``; the endpoint comes from the environment): every committed
    checkpoint read with plain DCP from a local copy matches its state; resume from the newest ``last``, each
    rank from its own local copy (rank 1 reads ``meta.pt`` after rank 0's copy is gone: ``Rank0LoadsFirst``)."""
    from lightning_asyncckpt import last_checkpoint
    from lightning_asyncckpt.storage import remote

    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    rec = FullStateRecorder()
    ck = ModelCheckpoint(dirpath=args.dir, monitor="step", mode="max", save_top_k=2, every_n_train_steps=4, save_last=True)
    L.seed_everything(1)
    t = _trainer(args, AsyncModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), [rec, ck],
                 plugins=[io], max_steps=8)
    t.fit(ShardedModel(width=WIDTH), loader(**DATA))
    torch.distributed.barrier()
    fs, root = remote.filesystem(args.dir)
    fs.invalidate_cache()
    report["objects"] = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root))
    if t.global_rank == 0:
        for name in report["objects"]:
            with remote.localize(f"{args.dir}/{name}") as local:
                meta = torch.load(local / "meta.pt", weights_only=False)
                assert_tree_equal(read_with_dcp(str(local), args.out), rec.copies[meta["global_step"]], name)
        report["verified"] = report["objects"]
    torch.distributed.barrier()
    last = last_checkpoint(args.dir)
    report["last"] = last
    strategy = Rank0LoadsFirst(os.path.join(args.out, "rank0-loaded"), data_parallel_size=2, tensor_parallel_size=1)
    check = _resume(args, strategy, last, 10)
    assert check.step == 8, check.step
    assert_tree_equal(check.state, rec.copies[8], "resume from S3")
    report["resume_exact"] = True
    report["children_after_fit"] = _own_children()


def case_after_fit(args, report):
    """``trainer.save_checkpoint`` after ``fit`` (the plugin is torn down): the sharded save is complete
    when it returns, on every rank, and holds the final state."""
    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    check = ResumeCheck()
    t = _trainer(args, AsyncModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), [check],
                 plugins=[io], max_steps=6, enable_checkpointing=False)
    L.seed_everything(1)
    t.fit(ShardedModel(width=WIDTH), loader(**DATA))
    path = os.path.join(args.out, "final.ckpt")
    t.save_checkpoint(path)
    report["complete_on_return"] = os.path.exists(os.path.join(path, ".metadata"))
    report["children_after_save"] = _own_children()
    torch.distributed.barrier()
    if t.global_rank == 0:
        assert_tree_equal(read_with_dcp(path, args.out), check.final, "saved after fit")
        report["verified"] = True


def case_after_fit_fail(args, report):
    """As ``case_after_fit``, but handing the save to rank 1's worker fails (after the ranks agreed to
    save): both ranks raise the same error, and neither waits for the other forever."""
    from lightning_asyncckpt import CheckpointWriteError

    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    t = _trainer(args, AsyncModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), [],
                 plugins=[io], max_steps=2, enable_checkpointing=False)
    t.fit(ShardedModel(width=WIDTH), loader(**DATA))
    if t.global_rank == 1:
        io.faults = testing.FaultList([testing.Fault("handover")])  # ENOSPC handing the write to the worker
    path = os.path.join(args.out, "final.ckpt")
    try:
        t.save_checkpoint(path)
        report["raised"] = None
    except CheckpointWriteError as e:
        report["raised"] = {"ranks": list(e.ranks), "path": e.path, "message": str(e)}
    report["children_after_save"] = _own_children()
    torch.distributed.barrier()
    report["final_exists"] = os.path.exists(path)
    report["leftovers"] = [n for n in os.listdir(args.out) if n.startswith(".asyncckpt-incomplete-")]


def case_resume1(args, report):
    """1 rank resumes from a 2-rank checkpoint (``--dir``) through ``ckpt_path``, then saves on 1 rank."""
    expected = read_with_dcp(args.dir, args.out)
    step = torch.load(os.path.join(args.dir, "meta.pt"), weights_only=False)["global_step"]
    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    ck = ModelCheckpoint(dirpath=os.path.join(args.out, "one"), filename="one", every_n_train_steps=step + 4)
    check = _resume(args, AsyncModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), args.dir,
                    step + 4, callbacks=[ck], plugins=[io])
    assert check.step == step
    assert_tree_equal(check.state, expected, "1-rank resume state")
    report["resume_exact"] = True
    saved = os.path.join(args.out, "one", "one.ckpt")
    assert_tree_equal(read_with_dcp(saved, args.out), check.final, "1-rank save")
    report["saved"] = saved
    report["children_after_fit"] = _own_children()


def case_resume2(args, report):
    """2 ranks resume from a 1-rank checkpoint (``--dir``)."""
    expected = read_with_dcp(args.dir, args.out)
    step = torch.load(os.path.join(args.dir, "meta.pt"), weights_only=False)["global_step"]
    check = _resume(args, AsyncModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                     checkpoint_io=AsyncCheckpointIO(args.engine, worker=args.worker)),
                    args.dir, step + 2)
    assert check.step == step
    assert_tree_equal(check.state, expected, "2-rank resume state")
    report["resume_exact"] = True
    report["children_after_fit"] = _own_children()


def case_fail(args, report):
    """One rank's write fails: both ranks raise, at the same step; the earlier checkpoint stays."""
    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    failing_fit(args, report, io, FailOnRankFrom(io, 8, rank=1), WIDTH, _own_children)


def failing_fit(args, report, io, callback, width, own_children):
    """Fits with ``callback`` and saves every 4 steps, catching the ``CheckpointWriteError`` that must stop
    every rank; reports it, the step reached, leftover processes and the committed checkpoints."""
    from lightning_asyncckpt import CheckpointWriteError

    dirpath = os.path.join(args.out, "c")
    ck = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, save_top_k=-1)
    t = _trainer(args, AsyncModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                 [callback, ck], plugins=[io], max_steps=40)
    if t.strategy.launcher is not None:  # rank 0: see every rank raise by itself, not killed by rank 0
        t.strategy.launcher.kill = lambda *a, **k: None
    try:
        t.fit(ShardedModel(width=width), loader(width=width, n=256, batch_size=4))
        report["raised"] = None
    except CheckpointWriteError as e:
        report["raised"] = {"path": e.path, "ranks": list(e.ranks), "error_type": e.error_type, "message": str(e)}
    report["global_step"] = t.global_step
    report["children_after_fit"] = own_children()
    torch.distributed.barrier()
    report["files"] = sorted(os.listdir(dirpath))


def case_die(args, report):
    """Every rank raises at step 6 while the sharded step-4 save is still being written: the ranks
    commit it together on the way out."""
    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    io.write_hook = testing.DelayWrite(1.5)
    rec = FullStateRecorder()
    dirpath = os.path.join(args.out, "c")
    ck = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, save_top_k=-1)

    class Dies(ShardedModel):
        def training_step(self, batch, batch_idx):
            if self.global_step == 6:
                raise ValueError(f"boom on rank {self.global_rank}")
            return super().training_step(batch, batch_idx)

    class ExitGroupAtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):  # made at setup, not inside the first save's stall
            report["exit_group_at_start"] = io.session.exit_group_ready

    t = _trainer(args, AsyncModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                 [rec, ExitGroupAtStart(), ck], plugins=[io], max_steps=40)
    if t.strategy.launcher is not None:
        t.strategy.launcher.kill = lambda *a, **k: None
    L.seed_everything(1)
    try:
        t.fit(Dies(width=WIDTH), loader(**DATA))
    except ValueError as e:
        report["raised"] = str(e)
    report["children_after_fit"] = _own_children()
    report["history"] = [os.path.basename(r.path) for r in io.history]
    torch.distributed.barrier()
    report["files"] = sorted(os.listdir(dirpath))
    if t.global_rank == 0:
        path = os.path.join(dirpath, "epoch=0-step=4.ckpt")
        assert_tree_equal(read_with_dcp(path, args.out), rec.copies[4], "step 4")
        report["verified"] = True


def main():
    run_job(lambda args, report: globals()[f"case_{args.case}"](args, report))


if __name__ == "__main__":
    main()
