"""The 2-rank DDP job's cases that train to the end (run by tests/jobs/ddp_job.py): every checkpoint
ModelCheckpoint keeps is bit-exact against a copy of the state taken at save time, a resume starts from it
exactly (as stock Lightning's would), under DDP (rank 0 writes) and AsyncDDPStrategy (every rank writes its
share), with eager and lazy snapshots, to local files and to S3; and a save in flight lands when every rank
dies.
"""

from __future__ import annotations

import os

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import HoldWriteAt, SnapshotRecorder, TinyModel, assert_tree_equal, clone_tree, loader
from jobs.ddp_common import ddp_trainer, no_kill, own_children
from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback, testing


def _recorded_checkpointing(args, top_k):
    """A plugin whose writes outlast a few steps, a snapshot recorder, and a top-k ModelCheckpoint."""
    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    io.write_hook = testing.DelayWrite(0.1)
    ck = ModelCheckpoint(dirpath=os.path.join(args.out, "c"), monitor="step", mode="max", save_top_k=top_k,
                         every_n_train_steps=4, save_last=True)
    return io, SnapshotRecorder(), ck


def case_fit(args, report):
    io, rec, ck = _recorded_checkpointing(args, top_k=3)
    data = dict(width=64, n=64, batch_size=4)  # 8 steps per epoch per rank
    L.seed_everything(1)
    model = TinyModel(width=64)
    t = ddp_trainer(args, [io], [AsyncFinalizerCallback(), rec, ck], max_steps=16)
    t.fit(model, loader(**data))
    report["children_after_fit"] = own_children(t)
    report["files"] = sorted(os.listdir(ck.dirpath))
    report["steps_while_pending"] = rec.steps_while_pending
    if t.global_rank == 0:
        for name in report["files"]:
            loaded = io.load_checkpoint(os.path.join(ck.dirpath, name), weights_only=False)
            got = {"state_dict": loaded["state_dict"], "optimizer_states": loaded["optimizer_states"]}
            assert_tree_equal(got, rec.copies[loaded["global_step"]], name)
        report["verified"] = report["files"]

    # Resume from our checkpoint with the same plugin, and, for reference, with stock Lightning from a
    # torch.save copy of the same checkpoint: the two continuations must be bit-identical.
    path = os.path.join(ck.dirpath, "epoch=0-step=8.ckpt")
    saved = io.load_checkpoint(path, weights_only=False)
    finals = []
    for plugin, ckpt_path in ((io, path), (TorchCheckpointIO(), os.path.join(args.out, "stock.ckpt"))):
        if plugin is not io and t.global_rank == 0:
            torch.save(saved, ckpt_path)
        torch.distributed.barrier()
        L.seed_everything(99)
        resumed = TinyModel(width=64)
        check = ResumeCheck()
        cbs = [check] + ([AsyncFinalizerCallback()] if plugin is io else [])
        t2 = ddp_trainer(args, [plugin], cbs, max_steps=16, enable_checkpointing=False)
        t2.fit(resumed, loader(**data), ckpt_path=ckpt_path)
        assert check.step == 8
        assert_tree_equal(check.weights, clone_tree(dict(saved["state_dict"])), "weights at resume")
        assert_tree_equal(check.optim, saved["optimizer_states"][0]["state"], "optimizer at resume")
        finals.append(clone_tree(resumed.state_dict()))
        report.setdefault("resumed_steps", []).append(t2.global_step)
        report["children_after_resume"] = own_children(t2)
    assert_tree_equal(finals[0], finals[1], "ours vs stock resume")
    report["resume_exact"] = True


class ResumeCheck(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step
        self.weights = clone_tree(pl_module.state_dict())
        self.optim = clone_tree(trainer.optimizers[0].state_dict()["state"])


def case_die(args, report):
    """Every rank raises at step 6 while rank 0 is still writing the step-4 save: it must land."""
    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    io.write_hook = testing.DelayWrite(1.5)
    rec = SnapshotRecorder()
    ck = ModelCheckpoint(dirpath=os.path.join(args.out, "c"), every_n_train_steps=4, save_top_k=-1)

    class Dies(TinyModel):
        def training_step(self, batch, batch_idx):
            if self.global_step == 6:
                raise ValueError(f"boom on rank {self.global_rank}")
            return super().training_step(batch, batch_idx)

    t = ddp_trainer(args, [io], [AsyncFinalizerCallback(), rec, ck], max_steps=16)
    no_kill(t)
    try:
        t.fit(Dies(width=64), loader(width=64, n=64, batch_size=4))
    except ValueError as e:
        report["raised"] = str(e)
    report["children_after_fit"] = own_children(t)
    if t.global_rank == 0:
        report["files"] = sorted(os.listdir(ck.dirpath))
        loaded = io.load_checkpoint(os.path.join(ck.dirpath, "epoch=0-step=4.ckpt"), weights_only=False)
        got = {"state_dict": loaded["state_dict"], "optimizer_states": loaded["optimizer_states"]}
        assert_tree_equal(got, rec.copies[4], "step 4")
        report["verified"] = True


def case_parallel(args, report):
    """AsyncDDPStrategy: every rank writes a share of the replicated state."""
    from lightning_asyncckpt import AsyncDDPStrategy

    io, rec, ck = _recorded_checkpointing(args, top_k=2)
    data = dict(width=96, n=64, batch_size=4)
    L.seed_everything(1)
    t = ddp_trainer(args, [io], [AsyncFinalizerCallback(), rec, ck], max_steps=16, strategy=AsyncDDPStrategy())
    t.fit(TinyModel(width=96, layers=3), loader(**data))
    report["children_after_fit"] = own_children(t)
    torch.distributed.barrier()
    report["files"] = sorted(os.listdir(ck.dirpath))
    report["steps_while_pending"] = rec.steps_while_pending
    if t.global_rank == 0:
        for name in report["files"]:
            path = os.path.join(ck.dirpath, name)
            loaded = io.load_checkpoint(path, weights_only=False)
            got = {"state_dict": loaded["state_dict"], "optimizer_states": loaded["optimizer_states"]}
            assert_tree_equal(got, rec.copies[loaded["global_step"]], name)
            report.setdefault("shards", {})[name] = {
                f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))
            }
        state = rec.copies[16]
        report["state_bytes"] = sum(
            t.numel() * t.element_size() for t in _tensors(state)
        )
    # resume on 2 ranks with the same strategy: exact at the start of training
    saved = io.load_checkpoint(os.path.join(ck.dirpath, "epoch=1-step=12.ckpt"), weights_only=False)
    check = ResumeCheck()
    t2 = ddp_trainer(args, [io], [AsyncFinalizerCallback(), check], max_steps=16, enable_checkpointing=False,
                  strategy=AsyncDDPStrategy())
    t2.fit(TinyModel(width=96, layers=3), loader(**data), ckpt_path=os.path.join(ck.dirpath, "epoch=1-step=12.ckpt"))
    assert check.step == 12
    assert_tree_equal(check.weights, clone_tree(dict(saved["state_dict"])), "weights at resume")
    assert_tree_equal(check.optim, saved["optimizer_states"][0]["state"], "optimizer at resume")
    report["resume_exact"] = True
    report["children_after_resume"] = own_children(t2)


def case_load1(args, report):
    """Resume on 2 ranks (AsyncDDPStrategy) from a checkpoint written on 1 rank (``--dir``)."""
    from lightning_asyncckpt import AsyncDDPStrategy

    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    saved = io.load_checkpoint(args.dir, weights_only=False)
    check = ResumeCheck()
    t = ddp_trainer(args, [io], [AsyncFinalizerCallback(), check], max_steps=saved["global_step"] + 2,
                 enable_checkpointing=False, strategy=AsyncDDPStrategy())
    t.fit(TinyModel(width=96, layers=3), loader(width=96, n=64, batch_size=4), ckpt_path=args.dir)
    assert check.step == saved["global_step"]
    assert_tree_equal(check.weights, clone_tree(dict(saved["state_dict"])), "weights at resume")
    assert_tree_equal(check.optim, saved["optimizer_states"][0]["state"], "optimizer at resume")
    report["resume_exact"] = True
    report["children_after_fit"] = own_children(t)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def case_lazy(args, report):
    """snapshot="lazy": DDP from rank 0 and AsyncDDPStrategy (each rank its share) copy lazily and exactly."""
    from lightning_asyncckpt import AsyncDDPStrategy

    data = dict(width=160, n=64, batch_size=4)  # 100 KiB weights: above the lazy threshold
    for name, strategy in (("ddp", "ddp"), ("parallel", AsyncDDPStrategy())):
        io = AsyncCheckpointIO(args.engine, worker=args.worker, snapshot="lazy")
        rec = SnapshotRecorder()
        dirpath = os.path.join(args.out, name)
        ck = ModelCheckpoint(dirpath=dirpath, monitor="step", mode="max", save_top_k=2, every_n_train_steps=4,
                             save_last=True)
        L.seed_everything(1)
        t = ddp_trainer(args, [io], [AsyncFinalizerCallback(), rec, ck], max_steps=12, strategy=strategy)
        t.fit(TinyModel(width=160), loader(**data))
        torch.distributed.barrier()
        report[f"{name}_files"] = sorted(os.listdir(dirpath))
        report[f"{name}_lazy_bytes"] = [r.lazy_nbytes for r in io.history]
        report[f"{name}_children_after_fit"] = own_children(t)
        if t.global_rank == 0:
            for f in report[f"{name}_files"]:
                loaded = io.load_checkpoint(os.path.join(dirpath, f), weights_only=False)
                got = {"state_dict": loaded["state_dict"], "optimizer_states": loaded["optimizer_states"]}
                assert_tree_equal(got, rec.copies[loaded["global_step"]], f"{name} {f}")
            report[f"{name}_verified"] = report[f"{name}_files"]


def case_lazy_follow(args, report):
    """AsyncDDPStrategy, snapshot="lazy": a save made while the previous write is in flight follows it into
    the one staging copy on every rank; every checkpoint is exact."""
    from lightning_asyncckpt import AsyncDDPStrategy

    data = dict(width=160, n=64, batch_size=4)
    io = AsyncCheckpointIO(args.engine, worker=args.worker, snapshot="lazy")
    rec, hold = SnapshotRecorder(), HoldWriteAt(io, args.out, 4)
    dirpath = os.path.join(args.out, "ckpts")
    ck = ModelCheckpoint(dirpath=dirpath, save_top_k=-1, every_n_train_steps=2)
    L.seed_everything(1)
    t = ddp_trainer(args, [io], [AsyncFinalizerCallback(), rec, hold, ck], max_steps=8, strategy=AsyncDDPStrategy())
    t.fit(TinyModel(width=160), loader(**data))
    torch.distributed.barrier()
    report["files"] = sorted(os.listdir(dirpath))
    report["staged"] = hold.staged
    report["lazy_bytes"] = [r.lazy_nbytes for r in io.history]
    report["children_after_fit"] = own_children(t)
    if t.global_rank == 0:
        for f in report["files"]:
            loaded = io.load_checkpoint(os.path.join(dirpath, f), weights_only=False)
            got = {"state_dict": loaded["state_dict"], "optimizer_states": loaded["optimizer_states"]}
            assert_tree_equal(got, rec.copies[loaded["global_step"]], f)
        report["verified"] = report["files"]


def case_remote(args, report):
    """Two DDP ranks save to an S3 URL (``--dir``; the endpoint comes from the environment): rank 0 writes."""
    import fsspec

    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    ck = ModelCheckpoint(dirpath=args.dir, monitor="step", mode="max", save_top_k=2, every_n_train_steps=4, save_last=True)
    t = ddp_trainer(args, [io], [AsyncFinalizerCallback(), ck], max_steps=8)
    t.fit(TinyModel(width=32), loader(width=32, n=64, batch_size=4))
    torch.distributed.barrier()
    fs, root = fsspec.core.url_to_fs(args.dir)
    fs.invalidate_cache()
    report["objects"] = sorted(os.path.basename(p) for p in fs.ls(root))
    with fs.open(f"{root}/last.ckpt", "rb") as f:
        report["last_step"] = torch.load(f, weights_only=False)["global_step"]
    report["children_after_fit"] = own_children(t)


def case_remote_dcp(args, report):
    """``AsyncDDPStrategy`` (every rank writes a share of one DCP directory) to an S3 URL; then resume."""
    from lightning_asyncckpt import AsyncDDPStrategy, last_checkpoint

    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    rec = SnapshotRecorder()
    ck = ModelCheckpoint(dirpath=args.dir, monitor="step", mode="max", save_top_k=2, every_n_train_steps=4, save_last=True)
    L.seed_everything(1)
    t = ddp_trainer(args, [io], [rec, ck], max_steps=8, strategy=AsyncDDPStrategy())
    t.fit(TinyModel(width=32), loader(width=32, n=64, batch_size=4))
    torch.distributed.barrier()
    import fsspec

    fs, root = fsspec.core.url_to_fs(args.dir)
    fs.invalidate_cache()
    report["objects"] = sorted(os.path.basename(p) for p in fs.ls(root))
    for name in report["objects"]:
        got = io.load_checkpoint(f"{args.dir}/{name}", weights_only=False)
        assert_tree_equal({"state_dict": got["state_dict"], "optimizer_states": got["optimizer_states"]},
                          rec.copies[got["global_step"]], name)
    report["verified"] = report["objects"]
    started = []

    class AtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            started.append(trainer.global_step)

    t2 = ddp_trainer(args, [AsyncCheckpointIO(args.engine, worker=args.worker)], [AtStart()], max_steps=10,
                  strategy=AsyncDDPStrategy(), enable_checkpointing=False)
    t2.fit(TinyModel(width=32), loader(width=32, n=64, batch_size=4), ckpt_path=last_checkpoint(args.dir))
    report["resumed_at"] = started
    report["children_after_fit"] = own_children(t)

