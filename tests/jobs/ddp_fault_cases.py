"""The 2-rank DDP job's cases where a save fails (run by tests/jobs/ddp_job.py): a full disk, a killed
writer, an unpicklable object, a failing rank, a snapshot edited after a lazy save, a weights-only save, the
automatic finalizer. Each trains with slow steps, saves every 4 steps, and reports what ``CheckpointWriteError``
every rank raised, the step it stopped at and the files left.
"""

from __future__ import annotations

import os
import signal
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import FailOnRankFrom, SlowSteps, TinyModel, loader
from jobs.ddp_common import ddp_trainer, no_kill, own_children
from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback, CheckpointWriteError, testing


def _failing_run(args, report, callbacks, explicit_callback=True, weights_only=False, snapshot="eager", **kw):
    io = AsyncCheckpointIO(args.engine, worker=args.worker, snapshot=snapshot)
    dirpath = os.path.join(args.dir or args.out, "c")
    ck = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, save_top_k=-1, save_weights_only=weights_only)
    cbs = ([AsyncFinalizerCallback()] if explicit_callback else []) + [SlowSteps()] + [cb(io) for cb in callbacks] + [ck]
    t = ddp_trainer(args, [io], cbs, max_steps=40, **kw)
    no_kill(t)
    t0 = time.monotonic()
    try:
        t.fit(TinyModel(width=128), loader(width=128))
        report["raised"] = None
    except CheckpointWriteError as e:
        report["raised"] = {"type": type(e).__name__, "path": e.path, "ranks": list(e.ranks), "errno": e.errno,
                            "error_type": e.error_type, "message": str(e)}
    report["fit_s"] = time.monotonic() - t0
    report["global_step"] = t.global_step
    report["children_after_fit"] = own_children(t)
    torch.distributed.barrier()  # rank 0 has finished cleaning up before anyone looks at the directory
    report["files"] = sorted(os.listdir(dirpath)) if os.path.isdir(dirpath) else []


class FillDiskAt(L.Callback):
    def __init__(self, io, mnt, step):
        self.io, self.mnt, self.step = io, mnt, step

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == self.step and trainer.global_rank == 0:
            self.io.session.wait_for_local_writes()  # the step-4 checkpoint is written first
            st = os.statvfs(self.mnt)
            with open(os.path.join(self.mnt, "filler"), "wb") as f:
                f.write(b"\0" * (st.f_bavail * st.f_frsize - 4096))


class KillWorkerAt(L.Callback):
    def __init__(self, io, step):
        self.io, self.step = io, step

    def on_train_batch_start(self, trainer, *a):
        if trainer.global_step == self.step and trainer.global_rank == 0:
            self.io.write_hook = None
            for pid in self.io.session.worker_pids():
                os.kill(pid, signal.SIGKILL)


class SlowWritesFrom(L.Callback):
    def __init__(self, io, step):
        self.io, self.step = io, step

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == self.step - 1:
            if trainer.global_rank == 0:
                self.io.session.wait_for_local_writes()  # earlier saves are written before the slow one
            self.io.write_hook = testing.DelayWrite(30.0)


class FailWritesFrom(L.Callback):
    def __init__(self, io, step):
        self.io, self.step = io, step

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == self.step - 1:
            self.io.write_hook = testing.FailWrite()


class UnpicklableAt(L.Callback):
    """Puts an object that cannot be pickled into the checkpoint at one save (bad input, on rank 0)."""

    def __init__(self, io, step):
        self.io, self.step = io, step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.global_step == self.step:
            import threading

            if trainer.global_rank == 0:
                self.io.session.wait_for_local_writes()  # the earlier save is committed first
            checkpoint["bad"] = threading.Lock()


def case_badinput(args, report):
    _failing_run(args, report, [lambda io: UnpicklableAt(io, 8)])


def case_parallel_fail(args, report):
    from lightning_asyncckpt import AsyncDDPStrategy

    _failing_run(args, report, [lambda io: FailOnRankFrom(io, 8, rank=1)], strategy=AsyncDDPStrategy())


class SnapshotFailsOnRank(L.Callback):
    """From ``step`` on, taking the snapshot fails on one rank only (as an out-of-memory would)."""

    def __init__(self, io, step, rank):
        self.io, self.step, self.rank = io, step, rank

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == self.step - 1 and trainer.global_rank == self.rank:
            self.io.faults = testing.FaultList([testing.Fault("snapshot")])


def case_parallel_snapfail(args, report):
    from lightning_asyncckpt import AsyncDDPStrategy

    _failing_run(args, report, [lambda io: SnapshotFailsOnRank(io, 8, rank=1)], strategy=AsyncDDPStrategy())


def case_enospc(args, report):
    _failing_run(args, report, [lambda io: FillDiskAt(io, args.dir, 6)])


def case_kill(args, report):
    _failing_run(args, report, [lambda io: SlowWritesFrom(io, 8), lambda io: KillWorkerAt(io, 9)])


def case_weights_only(args, report):
    """Lightning runs no callback hook for weights-only saves: their errors must still stop every rank."""
    _failing_run(args, report, [lambda io: FailWritesFrom(io, 8)], weights_only=True)


class EditAfterLazySave(L.Callback):
    """On ``rank``, holds the lazy copy of the save at ``step`` and edits a weight in place before letting it
    go (a callback editing weights right after a save): that save must fail on every rank."""

    def __init__(self, io, step, rank=0):
        self.io, self.step, self.rank, self.hold = io, step, rank, testing.HoldCopy()

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == self.step - 1 and trainer.global_rank == self.rank:
            self.io.copy_hook = self.hold  # runs before ModelCheckpoint (checkpoint callbacks run last)

    def on_train_batch_start(self, trainer, pl_module, *a):
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            self.hold.wait_started()
            with torch.no_grad():  # rank 0 writes every tensor; another rank its share: edit every weight there
                for layer in pl_module.net if self.rank else pl_module.net[:1]:
                    layer.weight.add_(1)
            self.hold.release()


def case_lazy_torn(args, report):
    _failing_run(args, report, [lambda io: EditAfterLazySave(io, 8)], snapshot="lazy")


def case_lazy_torn_parallel(args, report):
    """AsyncDDPStrategy: rank 1 edits a weight while its lazy copy of its share is held."""
    from lightning_asyncckpt import AsyncDDPStrategy

    _failing_run(args, report, [lambda io: EditAfterLazySave(io, 8, rank=1)], snapshot="lazy", strategy=AsyncDDPStrategy())


def case_auto(args, report):
    _failing_run(args, report, [lambda io: FailWritesFrom(io, 8)], explicit_callback=False)

