"""A single-device training script that the test SIGKILLs in the middle of a background write.

``--case train``: saves every 4 steps (top-2 and ``last``); writes ``<out>/ready`` once the step-12 saves
are in flight (a ``reports.RankReport``), then trains on slowly until killed. The step-12 saves are made slow through the
environment (``LIGHTNING_ASYNCCKPT_FAULTS``), as a user's CI would do with an unmodified script.
``--case resume``: ``fit(ckpt_path="last")`` and reports the step it resumed from (``<out>/rank0.json``).
"""

from __future__ import annotations

import os

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import SlowSteps, TinyModel, loader, trainer
from lightning_asyncckpt import AsyncCheckpointIO
from processes import job_args
from reports import RankReport, report_path, reported


class Ready(L.Callback):
    def __init__(self, out, io):
        self.out, self.io = out, io

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == 13:
            seen = {"pending": self.io.session.num_pending, "workers": self.io.session.worker_pids()}
            RankReport(rank=0, seen=seen).write(os.path.join(self.out, "ready"))  # whole: the test polls for it


class StartStep(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


def main():
    args = job_args()
    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    ck = ModelCheckpoint(dirpath=os.path.join(args.out, "c"), every_n_train_steps=4, save_top_k=2,
                         monitor="step", mode="max", save_last=True)
    if args.case == "train":
        t = trainer(args.out, [io], [Ready(args.out, io), SlowSteps(0.2), ck], max_steps=1000)
        t.fit(TinyModel(width=256), loader(width=256, n=4096))
    else:
        reported(0, report_path(args.out, 0), lambda report: resume(args.out, io, ck, report))


def resume(out, io, ck, report):
    start = StartStep()
    t = trainer(out, [io], [start, ck], max_steps=18)
    t.fit(TinyModel(width=256), loader(width=256, n=4096), ckpt_path="last")
    report["start"], report["files"] = start.step, sorted(os.listdir(ck.dirpath))


if __name__ == "__main__":
    main()
