"""The read-once resume on simulated nodes (tests/test_read_once_nodes.py): DDP with the plugin saves one
checkpoint (global rank 0 writes it, in the shared directory ``--out``); then the same ranks resume from it
twice through ``--shared``, the test's counting mount of ``--out``: once with the plugin (``ours.ckpt``) and
once with stock Lightning (``stock.ckpt``), hard links to the same file, so that the storage counts each
resume's bytes apart (case ``file``); every rank checks that each resume started from exactly the saved
state (against a ``torch.load`` of the file from ``--out``, which the mount does not count). Case
``directory``: AsyncDDPStrategy saves a checkpoint directory, which every rank loads as the resume does
(``dir-ours``) and by itself, as before (``dir-alone``)."""

from __future__ import annotations

import os
import shutil
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from nodes import node_job_args, run_and_report

from helpers import TinyModel, assert_tree_equal, loader
from jobs.mp_job import _sorted
from lightning_asyncckpt import AsyncCheckpointIO, AsyncDDPStrategy

STEPS = 2


def _state(trainer, pl_module):
    return _sorted({"state_dict": dict(pl_module.state_dict()),
                    "optimizer_0": {"state": trainer.optimizers[0].state_dict()["state"]}})


class AtStart(L.Callback):
    """(all ranks) The step, the full state and the time at the start of training (after the resume's load)."""

    def on_train_start(self, trainer, pl_module):
        self.step, self.state, self.at = trainer.global_step, _state(trainer, pl_module), time.monotonic()


def _trainer(args, plugins, max_steps, callbacks):
    return L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.nodes, strategy="ddp", plugins=plugins,
                     callbacks=callbacks, max_steps=max_steps, logger=False, enable_progress_bar=False,
                     enable_model_summary=False,
                     enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                     num_sanity_val_steps=0, default_root_dir=os.environ.get("NODE_SCRATCH", args.out))


def _data(width):
    return loader(width=width, n=8 * 4, batch_size=2)


def _full(checkpoint):
    return _sorted({"state_dict": dict(checkpoint["state_dict"]),
                    "optimizer_0": {"state": checkpoint["optimizer_states"][0]["state"]}})


def case_directory(args, report):
    """AsyncDDPStrategy saves a checkpoint directory (every rank writes its share); every rank then loads it
    through ``--shared`` as the resume does (the strategy's ``load_checkpoint``: together, ``dir-ours``) and
    by itself (the plugin's ``load_checkpoint`` called directly: each rank alone, as before, ``dir-alone``);
    both must equal the directory loaded from ``--out`` (not counted)."""
    width = int(args.width)
    dirpath = os.path.join(args.out, "d")
    ck = ModelCheckpoint(dirpath=dirpath, filename="saved", every_n_train_steps=STEPS)
    L.seed_everything(1)
    io = AsyncCheckpointIO("mcore", worker="fork")
    t = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.nodes, strategy=AsyncDDPStrategy(),
                  plugins=[io], callbacks=[ck], max_steps=STEPS, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0,
                  default_root_dir=os.environ.get("NODE_SCRATCH", args.out))
    t.fit(TinyModel(width=width), _data(width))
    saved = os.path.join(dirpath, "saved.ckpt")
    if t.global_rank == 0:
        for name in ("dir-ours", "dir-alone"):
            shutil.copytree(saved, os.path.join(args.out, name))
    torch.distributed.barrier()
    expected = _full(io.load_checkpoint(saved, weights_only=True))
    report["dir_size"] = sum(e.stat().st_size for e in os.scandir(saved))
    torch.distributed.barrier()
    began = time.monotonic()
    together = t.strategy.load_checkpoint(os.path.join(args.shared, "dir-ours"), weights_only=True)
    report["dir_ours_load_s"] = time.monotonic() - began
    assert_tree_equal(_full(together), expected, "directory, read once")
    torch.distributed.barrier()
    began = time.monotonic()
    alone = io.load_checkpoint(os.path.join(args.shared, "dir-alone"), weights_only=True)
    report["dir_alone_load_s"] = time.monotonic() - began
    assert_tree_equal(_full(alone), expected, "directory, each rank alone")
    report["dir_exact"] = True


def case_file(args, report):
    width = int(args.width)
    dirpath = os.path.join(args.out, "c")
    ck = ModelCheckpoint(dirpath=dirpath, filename="saved", every_n_train_steps=STEPS)
    L.seed_everything(1)
    t = _trainer(args, [AsyncCheckpointIO(args.engine, worker=args.worker)], STEPS, [ck])
    t.fit(TinyModel(width=width), _data(width))
    saved = os.path.join(dirpath, "saved.ckpt")
    if t.global_rank == 0:
        for name in ("ours.ckpt", "stock.ckpt", "ours-timed.ckpt", "stock-timed.ckpt"):  # counted apart
            os.link(saved, os.path.join(args.out, name))
    torch.distributed.barrier()
    expected = _full(torch.load(saved, weights_only=True))  # from --out: not counted
    report["size"] = os.path.getsize(saved)
    for name, plugins in (("ours", [AsyncCheckpointIO(args.engine, worker=args.worker)]), ("stock", [])):
        at = AtStart()
        L.seed_everything(2)  # another initial state: only the load can make it the saved one
        t = _trainer(args, plugins, STEPS + 1, [at])
        torch.distributed.barrier()
        began = time.monotonic()
        t.fit(TinyModel(width=width), _data(width), ckpt_path=os.path.join(args.shared, f"{name}.ckpt"))
        assert at.step == STEPS, (name, at.step)
        assert_tree_equal(at.state, expected, f"{name}: state at resume")
        report[f"{name}_exact"] = True
        report[f"{name}_to_start_s"] = at.at - began
        torch.distributed.barrier()
        began = time.monotonic()  # the load alone, as the resume runs it (every rank, the strategy's load)
        t.strategy.load_checkpoint(os.path.join(args.shared, f"{name}-timed.ckpt"), weights_only=True)
        report[f"{name}_load_s"] = time.monotonic() - began


def main():
    args = node_job_args(shared=None, width="512")

    def body(report):
        globals()[f"case_{args.case}"](args, report)
        assert torch.distributed.get_rank() == report.rank

    run_and_report(args.out, args.devices, body)


if __name__ == "__main__":
    main()
