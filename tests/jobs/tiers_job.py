"""Jobs for the two-tier tests (tests/test_tiers_nodes.py), on simulated nodes (tests/nodes.py) whose
``/dev/shm/local`` is each node's own directory, kept across launches (``node_local=True``).

Local saves every 2 steps (``LocalTier``), persistent ones every 8 (``ModelCheckpoint``, ``save_last``).

Cases:
- ``train``: fits until step 10 is complete in the local tier (and the step-8 save persistent), saves each
  rank's state at steps 8 and 10 to ``<out>/state-rank<r>-step<k>.pt``, says so with ``held-rank<r>``, and
  waits there to be killed (the test kills node 1, then node 0: the job restarts).
- ``resume``: ``fit(ckpt_path="last")`` for one step; reports the step it started from, the path Lightning
  loaded and whether the state at the start equals the saved one exactly.
- ``preempt``: fits; the test sends SIGTERM to global rank 3 once ``at-step-5`` exists; every rank saves
  the agreed step locally and stops; reports the step training stopped at.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from nodes import node_job_args, run_and_report

from helpers import ShardedModel, TinyModel, assert_tree_equal, loader
from jobs.nodes_job import WIDTH, Recorder, TPModel
from lightning_asyncckpt import (
    AsyncCheckpointIO,
    AsyncDDPStrategy,
    AsyncFinalizerCallback,
    AsyncModelParallelStrategy,
    LocalTier,
)

LOCAL = "/dev/shm/local"


class HoldAt10(L.Callback):
    """(all ranks, at the start of the batch after step 10: step 10's local save is made after every
    callback's ``on_train_batch_end``) The local save complete and replicated, the persistent step-8 save
    committed; the states of steps 8 and 10 saved aside; then waits to be killed."""

    def __init__(self, io, rec, out):
        self.io, self.rec, self.out = io, rec, out

    def on_train_batch_start(self, trainer, *a):
        if trainer.global_step != 10:
            return
        assert self.io.session.tier.finish() == 10
        self.io.finalize(blocking=True)
        r = trainer.global_rank
        for step in (8, 10):
            torch.save(self.rec.copies[step], os.path.join(self.out, f"state-rank{r}-step{step}.pt"))
        open(os.path.join(self.out, f"held-rank{r}"), "w").close()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # the test kills this process
            time.sleep(0.1)


class TierState(L.Callback):
    """(all ranks; before the finalizer, which ends the tier at the end of fit) The local tier's newest
    complete step when training ends."""

    def __init__(self, io):
        self.io, self.complete = io, None

    def on_train_end(self, trainer, pl_module):
        self.complete = self.io.session.tier.complete if self.io.session.tier is not None else None


class MarkStep(L.Callback):
    def __init__(self, out, step):
        self.out, self.step = out, step

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == self.step:
            with open(os.path.join(self.out, f"at-step-{self.step}-rank{trainer.global_rank}.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(f.name, f.name.removesuffix(".tmp"))
        time.sleep(0.05)  # a step takes a while, so the signal arrives in the middle of training


def _trainer(args, max_steps, callbacks, save_last=True):
    io = AsyncCheckpointIO(args.engine, local=LocalTier(LOCAL, every_n_train_steps=2, timeout_s=60,
                                                        overlap_agreement=args.overlap == "1"))
    # a resume that only checks where it starts leaves the persistent tier as it is (no last.ckpt at its end)
    ck = ModelCheckpoint(dirpath=os.path.join(args.out, "c"), every_n_train_steps=8, save_top_k=-1,
                         save_last=save_last)
    if args.strategy == "fsdp2":
        strategy = AsyncModelParallelStrategy(data_parallel_size=args.nodes * args.devices // int(args.tp),
                                              tensor_parallel_size=int(args.tp), timeout=timedelta(seconds=60),
                                              save_distributed_checkpoint=args.full != "1")
    else:  # async_ddp: every rank writes a share of each persistent checkpoint
        strategy = AsyncDDPStrategy(timeout=timedelta(seconds=60)) if args.strategy == "async_ddp" else "ddp"
    rec = Recorder(args.strategy == "fsdp2")
    t = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.nodes, strategy=strategy, plugins=[io],
                  callbacks=[TierState(io), AsyncFinalizerCallback(), rec, *[c(io, rec) for c in callbacks], ck],
                  max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, default_root_dir=os.environ.get("NODE_SCRATCH", args.out))
    return t, io, rec


def _model(args):
    L.seed_everything(1)
    if args.strategy != "fsdp2":
        return TinyModel(width=WIDTH)
    return TPModel(width=WIDTH) if int(args.tp) > 1 else ShardedModel(width=WIDTH)


def case_train(args, report):
    t, io, rec = _trainer(args, 400, [lambda io, rec: HoldAt10(io, rec, args.out)])
    t.fit(_model(args), loader(width=WIDTH, n=6400, batch_size=4))


def case_resume(args, report):
    report["local_before"] = sorted(os.listdir(LOCAL))
    t, io, rec = _trainer(args, 11, [], save_last=False)
    t.fit(_model(args), loader(width=WIDTH, n=6400, batch_size=4), ckpt_path="last")
    report["start_step"] = rec.start_step
    report["ckpt_path"] = str(t.ckpt_path)
    saved = torch.load(os.path.join(args.out, f"state-rank{t.global_rank}-step{rec.start_step}.pt"), weights_only=False)
    assert_tree_equal(rec.start, saved, "state at resume")
    report["resume_exact"] = True


def case_preempt(args, report):
    t, io, rec = _trainer(args, 400, [lambda io, rec: MarkStep(args.out, 5)])
    t.fit(_model(args), loader(width=WIDTH, n=6400, batch_size=4))
    report["stopped_at"] = t.global_step
    report["complete"] = t.callbacks[0].complete
    torch.save(rec.copies[t.global_step], os.path.join(args.out, f"state-rank{t.global_rank}-step{t.global_step}.pt"))


def main():
    args = node_job_args(strategy="ddp", tp="1", overlap="0", full="0")
    run_and_report(args.out, args.devices, lambda report: globals()[f"case_{args.case}"](args, report))


if __name__ == "__main__":
    main()
