"""The reliability matrix on 2 gloo ranks: one launch runs several fault cases in a row.

``--case ddp`` uses AsyncDDPStrategy, ``--case mp`` AsyncModelParallelStrategy (FSDP2); ``--faults`` lists
the cases as ``kind@ranks`` (e.g. ``enospc@1,crash@0+1,metadata@0``). For each case the second save
(step 8) fails on the target ranks; each rank reports what it saw to ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import os
import shutil
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import ShardedModel, SlowSteps, TinyModel, assert_tree_equal, loader
from lightning_asyncckpt import (
    AsyncCheckpointIO,
    AsyncDDPStrategy,
    AsyncModelParallelStrategy,
    CheckpointWriteError,
    testing,
)
from processes import other_children, run_job

WIDTH = 64


def _strategy(kind):
    if kind == "mp":
        return AsyncModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    return AsyncDDPStrategy()


def _model(kind):
    return ShardedModel(width=WIDTH) if kind == "mp" else TinyModel(width=WIDTH)


def _state(trainer, pl_module, kind):
    """(all ranks) The full model and optimizer state, as a checkpoint must hold it."""
    if kind == "mp":
        from jobs.mp_job import full_state

        return full_state(trainer, pl_module)
    from jobs.mp_job import _sorted

    return _sorted({"state_dict": dict(pl_module.state_dict()),
                    "optimizer_0": {"state": trainer.optimizers[0].state_dict()["state"]}})


def _read(path, kind, out):
    if kind == "mp":
        from jobs.mp_job import read_with_dcp

        return read_with_dcp(path, out)
    from jobs.mp_job import _sorted

    got = AsyncCheckpointIO().load_checkpoint(path, weights_only=False)
    return _sorted({"state_dict": dict(got["state_dict"]), "optimizer_0": {"state": got["optimizer_states"][0]["state"]}})


class Recorder(L.Callback):
    def __init__(self, kind):
        self.kind, self.copies, self.saved_at = kind, {}, {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.copies[trainer.global_step] = _state(trainer, pl_module, self.kind)
        self.saved_at[trainer.global_step] = time.monotonic()


class StartStep(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


def _children():
    return [line for _, line in other_children(lambda pid, line: "jobs.fault_job" in line)]


def _faults(item):
    """``kind@ranks`` (the 2nd save fails there), then optional ``&kind@ranks:save`` faults that run with it
    (a ``slow`` one delays that save by 2 s)."""
    faults = []
    for i, part in enumerate(item.split("&")):
        spec, _, save = part.partition(":")
        fault, _, ranks = spec.partition("@")
        ranks = tuple(int(r) for r in ranks.split("+"))
        faults.append(testing.Fault(fault, ranks=ranks, saves=[int(save or 2)], delay=60.0 if i == 0 else 2.0))
    return faults


def run_case(args, kind, item, report):
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("LOCAL_RANK", 0))
    faults = _faults(item)
    dirpath = os.path.join(args.out, item.replace("@", "-").replace("&", "_").replace(":", "-"))
    io = AsyncCheckpointIO(args.engine, worker=args.worker, timeout_s=3.0)
    rec = Recorder(kind)
    ck = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, save_top_k=-1)
    t = L.Trainer(accelerator="cpu", devices=2, strategy=_strategy(kind), plugins=[io], callbacks=[SlowSteps(), rec, ck],
                  max_steps=40, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=args.out)
    if t.strategy.launcher is not None:
        t.strategy.launcher.kill = lambda *a, **k: None  # each rank must raise by itself
    with testing.inject_faults(*faults):
        try:
            t.fit(_model(kind), loader(width=WIDTH, n=512, batch_size=4))
            raised = None
        except CheckpointWriteError as e:
            raised = {"path": e.path, "ranks": list(e.ranks), "error_type": e.error_type, "errno": e.errno,
                      "message": str(e), "after_s": time.monotonic() - rec.saved_at.get(8, float("nan"))}
    out = {"raised": raised, "step": t.global_step, "children": _children()}
    torch.distributed.barrier()
    out["files"] = sorted(os.listdir(dirpath))
    good = os.path.join(dirpath, "epoch=0-step=4.ckpt")
    if rank == 0 and os.path.isdir(good):
        assert_tree_equal(_read(good, kind, args.out), rec.copies[4], "previous checkpoint")
        out["previous_exact"] = True
    torch.distributed.barrier()
    # restart from the last good checkpoint, without faults
    start = StartStep()
    t2 = L.Trainer(accelerator="cpu", devices=2, strategy=_strategy(kind), plugins=[AsyncCheckpointIO(args.engine, worker=args.worker)],
                   callbacks=[start], max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False, default_root_dir=args.out)
    t2.fit(_model(kind), loader(width=WIDTH, n=512, batch_size=4), ckpt_path=good)
    out["restart_step"] = start.step
    out["children_after_restart"] = _children()
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(dirpath, ignore_errors=True)
    report["cases"][item] = out


def run_all(args, report):
    # rank 0 launches rank 1 inside its first case's `inject_faults`, and rank 1 inherits those faults
    # (which is how an unmodified script gets them): each case here sets its own
    os.environ.pop(testing.ENV_VAR, None)
    for item in args.faults.split(","):
        run_case(args, args.case, item, report)


def main():
    run_job(run_all, extra=("--faults",), seen={"cases": {}})


if __name__ == "__main__":
    main()
