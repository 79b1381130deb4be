"""A single-device training script that the test SIGKILLs in the middle of a background write.

``--case train``: saves every 4 steps (top-2 and ``last``); writes ``<out>/ready`` once the step-12 saves
are in flight, then trains on slowly until killed. The step-12 saves are made slow through the
environment (``LIGHTNING_ASYNCCKPT_FAULTS``), as a user's CI would do with an unmodified script.
``--case resume``: ``fit(ckpt_path="last")`` and reports the step it resumed from.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from helpers import SlowSteps, TinyModel, loader, trainer  # noqa: E402
from lightning_asyncckpt import AsyncCheckpointIO  # noqa: E402
from processes import job_args  # noqa: E402


class Ready(L.Callback):
    def __init__(self, out, io):
        self.out, self.io = out, io

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == 13:
            tmp = os.path.join(self.out, "ready.tmp")
            with open(tmp, "w") as f:
                json.dump({"pending": self.io.session.num_pending, "workers": self.io.session.worker_pids()}, f)
            os.replace(tmp, os.path.join(self.out, "ready"))  # the test never reads a partial file


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
        start = StartStep()
        t = trainer(args.out, [io], [start, ck], max_steps=18)
        t.fit(TinyModel(width=256), loader(width=256, n=4096), ckpt_path="last")
        with open(os.path.join(args.out, "resumed.json"), "w") as f:
            json.dump({"start": start.step, "files": sorted(os.listdir(ck.dirpath))}, f)


if __name__ == "__main__":
    main()
