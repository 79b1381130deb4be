"""The 2-rank DDP job's soak case (run by tests/jobs/ddp_job.py): 100 saves (and 100 of ``last``) with
``save_top_k=2`` under AsyncDDPStrategy, recording at a few steps each rank's open files, worker processes,
shared-memory segments and memory, which must not grow.
"""

from __future__ import annotations

import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import TinyModel, loader
from jobs.ddp_common import ddp_trainer, own_children
from lightning_asyncckpt import AsyncCheckpointIO
from processes import live_children


def _resources(io):
    import psutil

    me = psutil.Process()
    workers = [psutil.Process(pid) for pid in io.session.worker_pids()]
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "children": len(live_children()),
        "shm": len(os.listdir("/dev/shm")),
        "rss": me.memory_info().rss + sum(w.memory_info().rss for w in workers),
        "worker_rss": sum(w.memory_info().rss for w in workers),
        # shared-memory segments mapped by this rank and its workers (the staging buffers among them)
        "shm_maps": sum(_shm_maps(p.pid) for p in [me, *workers]),
    }


def _shm_maps(pid):
    try:
        with open(f"/proc/{pid}/maps") as f:
            return len({line.split()[-1] for line in f if "/dev/shm/" in line or "(deleted)" in line and "torch_" in line})
    except OSError:
        return 0


class Measure(L.Callback):
    """At the given steps, commits everything (all ranks), then records this rank's resources."""

    def __init__(self, io, steps):
        self.io, self.steps, self.seen = io, steps, {}

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step in self.steps:
            self.io.finalize(blocking=True)
            self.seen[trainer.global_step] = _resources(self.io)


def case_soak(args, report):
    """100 saves (and 100 of `last`) with save_top_k=2 under AsyncDDPStrategy: nothing may grow."""
    from lightning_asyncckpt import AsyncDDPStrategy

    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    ck = ModelCheckpoint(dirpath=os.path.join(args.out, "c"), every_n_train_steps=1, save_top_k=2, monitor="step",
                         mode="max", save_last=True)
    steps = int(os.environ.get("SOAK_STEPS", 100))
    measure = Measure(io, (10, steps // 3, 2 * steps // 3, steps))
    t = ddp_trainer(args, [io], [measure, ck], max_steps=steps, strategy=AsyncDDPStrategy())
    t.fit(TinyModel(width=int(os.environ.get("SOAK_WIDTH", 64))), loader(width=int(os.environ.get("SOAK_WIDTH", 64)), n=512, batch_size=2))
    report["saves"] = len(io.history)
    report["resources"] = measure.seen
    report["children_after_fit"] = own_children(t)
    torch.distributed.barrier()
    report["files"] = sorted(os.listdir(ck.dirpath))

