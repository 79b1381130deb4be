"""Jobs for the simulated-node tests (tests/test_nodes.py): ``tests/nodes.py`` starts this script once per
node with ``NODE_RANK``; Lightning's launcher starts the node's other local ranks. Every rank writes
``<out>/rank<global rank>.json``: the global rank comes from ``NODE_RANK * devices + LOCAL_RANK`` (what the
launch means) and is checked against the process group's.

Cases: ``ddp`` (``--strategy async``: AsyncDDPStrategy, ``plain``: DDP with the plugin, rank 0 writes),
``mp`` (FSDP2 over all ranks; ``--tp 2``: 2-way tensor parallel inside each node, FSDP2 across nodes),
``resume`` (``--dir``: resume on this launch's ranks, then save), ``fail`` (a write fails on global rank 3),
``loss`` (saves held on node 1, which the test kills) and ``last`` (resume from ``ckpt_path="last"``).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from nodes import node_job_args, run_and_report

from helpers import ShardedModel, TinyModel, assert_tree_equal, loader
from jobs.mp_job import _sorted, full_state, read_with_dcp
from lightning_asyncckpt import (
    AsyncCheckpointIO,
    AsyncDDPStrategy,
    AsyncModelParallelStrategy,
    CheckpointWriteError,
    testing,
)
from processes import STACKS_AFTER_VAR, STACKS_PREFIX

WIDTH = 64
DATA = dict(width=WIDTH, n=128, batch_size=4)  # 8 steps per epoch on 4 data-parallel ranks
SHM_MARK = "/dev/shm/asyncckpt-test-node-mark-rank{}"


class TPModel(TinyModel):
    """2-way tensor parallel (column-, then row-wise) inside each node, FSDP2 over the data-parallel ranks."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(self.net, self.device_mesh["tensor_parallel"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        dp = self.device_mesh["data_parallel"]
        for layer in self.net:
            fully_shard(layer, mesh=dp)
        fully_shard(self.net, mesh=dp)


def _ddp_state(trainer, pl_module):
    return _sorted({"state_dict": dict(pl_module.state_dict()),
                    "optimizer_0": {"state": trainer.optimizers[0].state_dict()["state"]}})


class Recorder(L.Callback):
    """(all ranks) The full state at each save, and at the start and end of training."""

    def __init__(self, sharded):
        self.state = full_state if sharded else _ddp_state
        self.copies, self.start, self.start_step = {}, None, None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.copies[trainer.global_step] = self.state(trainer, pl_module)

    def on_train_start(self, trainer, pl_module):
        self.start_step, self.start = trainer.global_step, self.state(trainer, pl_module)


def _read(path, sharded, out):
    """The full state in the checkpoint at ``path`` (plain DCP for a sharded one, the plugin otherwise)."""
    if sharded:
        return read_with_dcp(path, out)
    got = AsyncCheckpointIO().load_checkpoint(path, weights_only=False)
    return _sorted({"state_dict": dict(got["state_dict"]), "optimizer_0": {"state": got["optimizer_states"][0]["state"]}})


def _setup(args, sharded, max_steps, callbacks=(), ckpt=None, **io_kw):
    io = AsyncCheckpointIO(args.engine, worker=args.worker, **io_kw)
    if not sharded:
        strategy = AsyncDDPStrategy() if args.strategy == "async" else "ddp"
    else:
        tp = int(args.tp or 1)
        strategy = AsyncModelParallelStrategy(data_parallel_size=args.nodes * args.devices // tp,
                                              tensor_parallel_size=tp, timeout=timedelta(seconds=30))
    rec = Recorder(sharded)
    cbs = [rec, *callbacks] + ([ckpt] if ckpt is not None else [])
    t = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.nodes, strategy=strategy, plugins=[io],
                  callbacks=cbs, max_steps=max_steps, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=ckpt is not None, num_sanity_val_steps=0,
                  default_root_dir=os.environ.get("NODE_SCRATCH", args.out))
    return t, io, rec


def _model(args, sharded):
    L.seed_everything(1)
    if not sharded:
        return TinyModel(width=WIDTH)
    return TPModel(width=WIDTH) if int(args.tp or 1) > 1 else ShardedModel(width=WIDTH)


def _listing(path):
    return {f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))} if os.path.isdir(path) else None


def _fit_save_check(args, report, sharded, resume=True):
    """Fits with saves at steps 4 and 8; rank 0 checks each against the state it was taken from; then a new
    launch of the same ranks resumes from step 4: exact weights and optimizer state at the start."""
    dirpath = os.path.join(args.out, "c")
    ck = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, save_top_k=-1)
    t, io, rec = _setup(args, sharded, 8, ckpt=ck)
    t.fit(_model(args, sharded), loader(**DATA))
    _identity(t, report)
    report["records"] = {os.path.basename(r.path): [r.nbytes, r.local_nbytes] for r in io.history}
    torch.distributed.barrier()
    report["files"] = sorted(os.listdir(dirpath))
    report["layout"] = {name: _listing(os.path.join(dirpath, name)) for name in report["files"]}
    if t.global_rank == 0:
        for name, step in (("epoch=0-step=4.ckpt", 4), ("epoch=0-step=8.ckpt", 8)):
            assert_tree_equal(_read(os.path.join(dirpath, name), sharded, args.out), rec.copies[step], name)
        report["verified"] = True
    torch.distributed.barrier()
    if resume:
        path = os.path.join(dirpath, "epoch=0-step=4.ckpt")
        t2, _, rec2 = _setup(args, sharded, 6)
        t2.fit(_model(args, sharded), loader(**DATA), ckpt_path=path)
        assert rec2.start_step == 4, rec2.start_step
        assert_tree_equal(rec2.start, rec.copies[4], "state at resume")
        report["resume_exact"] = True
    return t


def _identity(trainer, report):
    """(all ranks) Who this rank is, and which ranks' marks its node's /dev/shm holds (its own node's only)."""
    report["identity"] = {"global": trainer.global_rank, "local": trainer.local_rank, "node": trainer.node_rank,
                          "dist": torch.distributed.get_rank(), "world": torch.distributed.get_world_size()}
    open(SHM_MARK.format(trainer.global_rank), "w").close()
    torch.distributed.barrier()
    report["shm_marks"] = sorted(int(f.rsplit("rank", 1)[1]) for f in os.listdir("/dev/shm") if "node-mark" in f)


def case_ddp(args, report):
    _fit_save_check(args, report, sharded=False)


def case_mp(args, report):
    _fit_save_check(args, report, sharded=True, resume=not args.dir)


def case_resume(args, report):
    """Resumes on this launch's ranks from the sharded checkpoint ``--dir`` (exact), trains 4 more steps and
    saves ``<out>/r/final.ckpt``; rank 0 checks that save against the state at the end of training."""
    expected = read_with_dcp(args.dir, args.out)
    step = torch.load(os.path.join(args.dir, "meta.pt"), weights_only=False)["global_step"]
    ck = ModelCheckpoint(dirpath=os.path.join(args.out, "r"), filename="final", every_n_train_steps=step + 4)
    t, _, rec = _setup(args, True, step + 4, ckpt=ck)
    t.fit(_model(args, True), loader(**DATA), ckpt_path=args.dir)
    assert rec.start_step == step
    assert_tree_equal(rec.start, expected, "state at resume")
    report["resume_exact"] = True
    _identity(t, report)
    if t.global_rank == 0:
        assert_tree_equal(read_with_dcp(ck.best_model_path, args.out), rec.copies[step + 4], "save after resume")
    report["saved"] = ck.best_model_path


class FailOnRank3(L.Callback):
    """The saves from step 8 on fail (ENOSPC in the background write) on global rank 3 only."""

    def __init__(self, io):
        self.io = io

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == 7:
            self.io.faults = testing.FaultList([testing.Fault("enospc", ranks=(3,))])


def case_fail(args, report):
    dirpath = os.path.join(args.out, "c")
    ck = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, save_top_k=-1)
    t, io, _ = _setup(args, True, 40, ckpt=ck)
    t.callbacks.insert(0, FailOnRank3(io))
    if t.strategy.launcher is not None:
        t.strategy.launcher.kill = lambda *a, **k: None  # every rank must raise by itself
    try:
        t.fit(_model(args, True), loader(width=WIDTH, n=640, batch_size=4))
        report["raised"] = None
    except CheckpointWriteError as e:
        report["raised"] = {"type": type(e).__name__, "path": e.path, "ranks": list(e.ranks),
                            "error_type": e.error_type, "message": str(e)}
    report["global_step"] = t.global_step
    torch.distributed.barrier()
    report["files"] = sorted(os.listdir(dirpath))


class HoldOnNode1(L.Callback):
    """Every rank commits the step-4 save first; then node 1's writes of the step-8 save are held (in the
    writer process), each rank saying so with a ``held-rank<r>`` file: the test kills node 1 then."""

    def __init__(self, io, out):
        self.io, self.out = io, out

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == 7:
            self.io.finalize(blocking=True)  # (all ranks) the step-4 save is committed
            if trainer.node_rank == 1:
                self.io.write_hook = testing.HoldWrite(os.path.join(self.out, "never"), timeout_s=600,
                                                       started_file=os.path.join(self.out, f"held-rank{trainer.global_rank}"))


def case_loss(args, report):
    dirpath = os.path.join(args.out, "c")
    ck = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, save_top_k=-1, save_last=True)
    t, io, _ = _setup(args, True, 400, ckpt=ck, drain_timeout_s=30.0)
    t.callbacks.insert(0, HoldOnNode1(io, args.out))
    report["node"] = int(os.environ["NODE_RANK"])
    try:
        t.fit(_model(args, True), loader(width=WIDTH, n=6400, batch_size=4))
    finally:
        report["fit_ended"] = time.time()


def case_last(args, report):
    """A new launch resumes from ``ckpt_path="last"`` in the directory of ``case_loss``: the last committed
    checkpoint; exact, then saves again over the directory."""
    dirpath = os.path.join(args.out, "c")
    report["before"] = sorted(os.listdir(dirpath))
    ck = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, save_top_k=-1, save_last=True)
    t, _, rec = _setup(args, True, 8, ckpt=ck)
    t.fit(_model(args, True), loader(**DATA), ckpt_path="last")
    report["start_step"] = rec.start_step
    torch.distributed.barrier()
    if t.global_rank == 0:  # the start state equals the checkpoint at step 4 (it was saved again at 8 since)
        assert_tree_equal(rec.start, read_with_dcp(os.path.join(dirpath, "epoch=0-step=4.ckpt"), args.out), "resume")
        report["resume_exact"] = True
    report["after"] = sorted(os.listdir(dirpath))


def main():
    args = node_job_args(strategy="async", dir=None, tp=None)
    stacks_after = os.environ.get(STACKS_AFTER_VAR)  # see processes.run_job: stacks of a hang
    if stacks_after:
        stacks = open(os.path.join(args.out, f"{STACKS_PREFIX}{os.getpid()}.txt"), "w")  # noqa: SIM115
        faulthandler.dump_traceback_later(float(stacks_after), exit=False, file=stacks)
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    def body(report):
        globals()[f"case_{args.case}"](args, report)
        rank = torch.distributed.get_rank()
        assert rank == report.rank, (rank, report.rank)

    run_and_report(args.out, args.devices, body)


if __name__ == "__main__":
    main()
