"""Lazy snapshots of sharded (FSDP2) saves on gloo/CPU for tests/test_model_parallel.py: the jobs of
``mp_job.py`` with ``snapshot="lazy"``. Each rank writes <out>/rank<r>.json."""

from __future__ import annotations

import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import HoldWriteAt, ShardedModel, assert_tree_equal, loader
from jobs.mp_job import FullStateRecorder, _trainer, failing_fit, read_with_dcp
from lightning_asyncckpt import AsyncCheckpointIO, AsyncModelParallelStrategy, testing
from processes import other_children, run_job


def _own_children():
    """Child processes other than the ranks (the writers must be gone after fit)."""
    return other_children(lambda pid, line: "jobs.mp_lazy_job" in line)


LAZY_WIDTH = 256  # a 256x256 weight's local shard on 2 ranks is 128 KiB: above the lazy threshold


class EditShardAfterLazySave(L.Callback):
    """On ``rank``, holds the lazy copy of the save at ``step`` and edits its local shard of a weight in place
    before letting the copy go (a callback editing weights right after a save)."""

    def __init__(self, io, step, rank):
        self.io, self.step, self.rank, self.hold, self.armed = io, step, rank, testing.HoldCopy(), False

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == self.step - 1 and trainer.global_rank == self.rank:
            self.io.copy_hook, self.armed = self.hold, True  # before ModelCheckpoint (checkpoint callbacks run last)

    def on_train_batch_start(self, trainer, pl_module, *a):
        if trainer.global_step == self.step and self.armed:
            self.armed = False
            self.hold.wait_started()
            weight = pl_module.net[0].weight
            with torch.no_grad():  # through the local shard, or as a DTensor (each bumps a different counter)
                (weight if os.environ.get("EDIT_AS_DTENSOR") else weight.to_local()).add_(1)
            self.hold.release()


def _report_and_verify(args, report, t, io, ck, rec):
    """After ``fit``: what each rank copied lazily and left behind; rank 0 reads every checkpoint with plain
    DCP and compares it with the state recorded at its step."""
    report["lazy_bytes"] = [r.lazy_nbytes for r in io.history]
    report["children_after_fit"] = _own_children()
    torch.distributed.barrier()
    report["files"] = sorted(os.listdir(ck.dirpath))
    if t.global_rank == 0:
        for name in report["files"]:
            path = os.path.join(ck.dirpath, name)
            meta = torch.load(os.path.join(path, "meta.pt"), weights_only=False)
            assert_tree_equal(read_with_dcp(path, args.out), rec.copies[meta["global_step"]], name)
        report["verified"] = report["files"]


def case_lazy(args, report):
    """snapshot="lazy" with sharded saves and gradient accumulation: each rank copies its local shards of the
    parameters and optimizer state after the save call returned; every checkpoint is exact."""
    io = AsyncCheckpointIO(args.engine, worker=args.worker, snapshot="lazy")
    rec = FullStateRecorder()
    ck = ModelCheckpoint(dirpath=os.path.join(args.out, "c"), monitor="step", mode="max", save_top_k=2,
                         every_n_train_steps=2, save_last=True)
    L.seed_everything(1)
    t = _trainer(args, AsyncModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), [rec, ck],
                 plugins=[io], max_steps=6, accumulate_grad_batches=2)
    t.fit(ShardedModel(width=LAZY_WIDTH), loader(width=LAZY_WIDTH, n=64, batch_size=4))
    _report_and_verify(args, report, t, io, ck, rec)


def case_lazy_follow(args, report):
    """Sharded saves, snapshot="lazy": the step-6 save is made while every rank's step-4 write is held; it
    follows that write into the one staging copy; every checkpoint is exact."""
    io = AsyncCheckpointIO(args.engine, worker=args.worker, snapshot="lazy")
    rec, hold = FullStateRecorder(), HoldWriteAt(io, args.out, 4)
    ck = ModelCheckpoint(dirpath=os.path.join(args.out, "c"), save_top_k=-1, every_n_train_steps=2)
    L.seed_everything(1)
    t = _trainer(args, AsyncModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), [rec, hold, ck],
                 plugins=[io], max_steps=8)
    t.fit(ShardedModel(width=LAZY_WIDTH), loader(width=LAZY_WIDTH, n=64, batch_size=4))
    report["staged"] = hold.staged
    _report_and_verify(args, report, t, io, ck, rec)


def case_lazy_torn(args, report):
    """Rank 1 edits its shard of a weight while its lazy copy is held: the save fails on both ranks."""
    io = AsyncCheckpointIO(args.engine, worker=args.worker, snapshot="lazy")
    failing_fit(args, report, io, EditShardAfterLazySave(io, 8, rank=1), LAZY_WIDTH, _own_children)


def main():
    run_job(lambda args, report: globals()[f"case_{args.case}"](args, report))


if __name__ == "__main__":
    main()
